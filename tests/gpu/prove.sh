#!/usr/bin/env bash
# The GPU proof: every stage in one command, under 8 minutes, one archive back. From the
# repository root on the GPU machine:
#
#   bash tests/gpu/prove.sh            # all stages: tests, overlap, allreduce, trl
#   bash tests/gpu/prove.sh overlap    # one stage (tests, overlap, allreduce or trl)
#
# Stages, in this order (each under `timeout`, its limit taken from what is left of
# BUDGET_S, default 470 s; a stage that has no time left is skipped and says so):
#   tests      the CUDA tests (gpu/test_cuda.py, strategies/layout/test_staging.py and
#              test_staged_hooks.py, and strategies/test_bucket_step.py's) in SHARDS
#              parallel shards (default 6), each in its own /dev/shm mount (unshare -m + a
#              tmpfs), so the leak fixture of a shard sees only its own segments; junit XML each
#   overlap    shmtrain bench overlap --device cuda:0, ResNet-50 3x224x224, batch 32, 2 workers
#              sharing the GPU, 4 threads, 10 rounds, every mode: nocomm ddp_gloo ssgd
#              ssgd_overlap gpi cpu_acc ps_grad (one launch: the same load for all)
#   allreduce  bench allreduce --procs 2 4 8 16 --peers gloo (the CPU allreduce on 16 cores)
#   trl        shmtrain reproduce trl-table3 / trl-table4 --quick (the CPU path)
#
# Everything lands in a scratch folder, archived into $OUT/proof.tgz (default ./gpu-proof)
# from an EXIT trap, so a stage stopped by its limit still returns what ran; $OUT/summary.txt
# is the log of stage times and results. PROVE_CPU=1 is the dry run on a CPU-only machine:
# the same stages and commands with small settings (the CUDA tests skip themselves, the
# bench runs every strategy's staged path with MODE@copy). The GPU machine reaches no
# package index: shmtrain runs from src/ (PYTHONPATH), on the machine's own PyTorch.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT="${OUT:-$ROOT/gpu-proof}"
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/shmtrain-proof.XXXXXX)
PY="${PYTHON:-python3}"
SHARDS="${SHARDS:-6}"
BUDGET_S="${BUDGET_S:-470}"
CPU="${PROVE_CPU:-0}"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$WORK/summary.txt"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
finish() {
    log "archive: $OUT/proof.tgz"
    cp "$WORK/summary.txt" "$OUT/summary.txt" 2>/dev/null
    tar czf "$OUT/proof.tgz" -C "$WORK" . 2>/dev/null
    rm -rf "$WORK"
}
trap finish EXIT

# limit NEED: the seconds a stage may take (what is left, at most NEED); 0 when under 20 s are left
limit() { local l; l=$(left); [ "$l" -lt 20 ] && { echo 0; return; }; echo $(( l - 5 < $1 ? l - 5 : $1 )); }

machine() {
    {
        date -u +%FT%TZ
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
        echo "cores $(nproc)"; git -C "$ROOT" log --oneline -1 2>/dev/null
    } > "$WORK/machine.txt" 2>&1
    log "machine: $(tr '\n' ' ' < "$WORK/machine.txt")"
}

stage_tests() {
    local lim; lim=$(limit 240); [ "$lim" -eq 0 ] && { log "tests: skipped, no time left"; return; }
    local files="tests/gpu/test_cuda.py tests/strategies/layout/test_staging.py tests/strategies/layout/test_staged_hooks.py
        tests/strategies/test_bucket_step.py::test_per_bucket_steps_on_cuda_equal_one_step"
    # shellcheck disable=SC2086
    "$PY" -m pytest -p no:cacheprovider -o addopts="" --collect-only -q $files 2>/dev/null \
        | grep '::' > "$WORK/tests.ids"
    local n; n=$(wc -l < "$WORK/tests.ids")
    local isolate=1
    unshare -m true 2>/dev/null || isolate=0
    [ "$isolate" -eq 0 ] && SHARDS=1  # without a mount namespace per shard, one shard only
    log "tests: $n collected, $SHARDS shard(s), limit ${lim}s, own /dev/shm: $isolate"
    local pids=() s
    for (( s = 0; s < SHARDS; s++ )); do
        awk -v s="$s" -v n="$SHARDS" '(NR - 1) % n == s' "$WORK/tests.ids" > "$WORK/shard.$s.ids"
        # (set -f: the ids' [params] are not file patterns)
        local run="set -f; exec $PY -m pytest -p no:cacheprovider -o addopts='' -q -rfEs --timeout 600 \
            --junitxml='$WORK/tests.$s.xml' \$(cat '$WORK/shard.$s.ids')"
        if [ "$isolate" -eq 1 ]; then
            timeout -k 10 "$lim" unshare -m sh -c "mount -t tmpfs -o size=16g tmpfs /dev/shm || exit 97; $run" \
                > "$WORK/tests.$s.log" 2>&1 &
        else
            timeout -k 10 "$lim" sh -c "$run" > "$WORK/tests.$s.log" 2>&1 &
        fi
        pids+=("$!")
    done
    for (( s = 0; s < SHARDS; s++ )); do
        wait "${pids[$s]}"; log "tests shard $s rc=$? $(tail -1 "$WORK/tests.$s.log")"
    done
    grep -h -E '^(FAILED|ERROR)' "$WORK"/tests.*.log | tee -a "$WORK/summary.txt"
}

stage_overlap() {
    local lim; lim=$(limit 150); [ "$lim" -eq 0 ] && { log "overlap: skipped, no time left"; return; }
    local args=(--device cuda:0 --model resnet50 --input-shape 3x224x224 --batch-size 32 --workers 2
                --threads 4 --rounds 10 --warmup 2
                --modes nocomm ddp_gloo ssgd ssgd_overlap gpi cpu_acc ps_grad)
    [ "$CPU" = 1 ] && args=(--device cpu --model smallcnn --input-shape 1x8x8 --batch-size 4 --workers 2
                            --threads 1 --rounds 2 --warmup 1 --modes nocomm ddp_gloo ssgd@copy
                            ssgd_overlap@copy gpi@copy cpu_acc@copy ps_grad@copy)
    log "overlap: limit ${lim}s: bench overlap ${args[*]}"
    timeout -k 10 "$lim" "$PY" -m shmtrain bench overlap "${args[@]}" --json "$WORK/bench_overlap.json" \
        > "$WORK/overlap.log" 2>&1
    log "overlap rc=$?"; cat "$WORK/overlap.log" >> "$WORK/summary.txt"; head -30 "$WORK/overlap.log"
}

stage_allreduce() {
    local lim; lim=$(limit 150); [ "$lim" -eq 0 ] && { log "allreduce: skipped, no time left"; return; }
    local args=(--procs 2 4 8 16 --sizes 4KiB 256KiB 4MiB 64MiB 256MiB --peers gloo)
    [ "$CPU" = 1 ] && args=(--procs 2 --sizes 4KiB 64KiB --reps 2 --peers gloo)
    log "allreduce: limit ${lim}s: bench allreduce ${args[*]}"
    timeout -k 10 "$lim" "$PY" -m shmtrain bench allreduce "${args[@]}" --json "$WORK/bench_allreduce.json" \
        > "$WORK/allreduce.log" 2>&1
    log "allreduce rc=$?"; tail -12 "$WORK/allreduce.log" | tee -a "$WORK/summary.txt"
}

stage_trl() {
    local table lim
    for table in trl-table3 trl-table4; do
        lim=$(limit 120); [ "$lim" -eq 0 ] && { log "$table: skipped, no time left"; continue; }
        log "$table: limit ${lim}s"
        timeout -k 10 "$lim" "$PY" -m shmtrain reproduce "$table" --quick --out "$WORK/reproduction" \
            > "$WORK/$table.log" 2>&1
        log "$table rc=$?"
    done
}

stage="${1:-all}"
case "$stage" in
    tests|overlap|allreduce|trl|all) ;;
    *) echo "prove.sh: unknown stage '$stage'; choose tests, overlap, allreduce, trl or all" >&2; exit 2 ;;
esac
log "prove.sh $stage (budget ${BUDGET_S}s, PROVE_CPU=$CPU)"
machine
case "$stage" in
    all) stage_tests; stage_overlap; stage_allreduce; stage_trl ;;
    *) "stage_$stage" ;;
esac
log "done"
