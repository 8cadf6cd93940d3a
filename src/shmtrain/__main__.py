import sys

from shmtrain.cli import main

sys.exit(main())
