import sys

try:
    from shmtrain.cli import main
except KeyboardInterrupt:  # Ctrl-C at once: no traceback (the command line handles the rest)
    print("shmtrain: interrupted by SIGINT; nothing was started", file=sys.stderr)
    sys.exit(130)
sys.exit(main())
