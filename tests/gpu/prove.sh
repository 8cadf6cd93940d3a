#!/usr/bin/env bash
# The GPU proof: every CUDA path checked and measured on a GPU host, in stages
# that fit the device tool's 10-minute commands. Run from the repository root:
#
#   bash tests/gpu/prove.sh tests        # the CUDA tests (test_cuda.py, test_staging.py)
#   bash tests/gpu/prove.sh overlap      # bench overlap --device cuda, ResNet-50 224x224, + DDP/gloo
#   bash tests/gpu/prove.sh trl          # reproduce trl-table3 and trl-table4 on the GPU
#   bash tests/gpu/prove.sh allreduce    # CPU allreduce scaling at 2 4 8 16 processes
#   bash tests/gpu/prove.sh all          # every stage in turn (about 20 minutes)
#
# Every figure lands as JSON (and each stage's log) in $OUT (default ./gpu-proof).
# It installs shmtrain without dependencies into the machine's own PyTorch (the GPU
# machine reaches no package index); see docs/gpu.md for what ran where.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-proof}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

setup() {
    if ! "$PY" -c 'import shmtrain' 2>/dev/null; then
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
            || { cat "$OUT/install.log"; exit 1; }
    fi
    {
        date -u +%FT%TZ
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
        nproc
    } | tee "$OUT/machine.txt"
}

stage_tests() {
    "$PY" -m pytest -p no:cacheprovider -q -rfE --timeout 600 -o addopts="" \
        tests/test_cuda.py tests/test_staging.py "$@" --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
}

stage_overlap() {
    "$PY" -m shmtrain bench overlap --device cuda:0 --model resnet50 --input-shape 3x224x224 \
        --batch-size 32 --workers 2 --rounds 10 --threads 4 \
        --modes nocomm ssgd gpi cpu_acc ssgd_overlap ddp "$@" \
        --json "$OUT/bench_overlap_cuda.json" 2>&1 | tee "$OUT/overlap.log"
}

stage_trl() {
    # NOTE: `shmtrain reproduce` has no --device yet; the TRL tables still measure the CPU
    # path. Giving them a GPU setting is still to do.
    for table in trl-table3 trl-table4; do
        "$PY" -m shmtrain reproduce "$table" --out "$OUT" 2>&1 | tee "$OUT/$table.log"
    done
}

stage_allreduce() {
    # mpich and deepspeed are not on the GPU machine (no package index there): carry their
    # wheels (docs/gpu.md) and add `--peers gloo mpich deepspeed` to compare with them too
    "$PY" -m shmtrain bench allreduce --procs 2 4 8 16 --peers gloo "$@" \
        --json "$OUT/bench_allreduce_16core.json" 2>&1 | tee "$OUT/allreduce.log"
}

setup
stage="${1:-all}"; shift || true
case "$stage" in
    tests) stage_tests "$@" ;;
    overlap) stage_overlap "$@" ;;
    trl) stage_trl "$@" ;;
    allreduce) stage_allreduce "$@" ;;
    all) stage_tests; stage_overlap; stage_trl; stage_allreduce ;;
    *) echo "prove.sh: unknown stage '$stage'; choose tests, overlap, trl, allreduce or all" >&2; exit 2 ;;
esac
