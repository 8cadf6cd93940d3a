"""Memory and data time of an image folder run (docs/data.md).

Generates folders of small PNGs (``examples/make_image_folder.py``), trains on each with
``shmtrain train`` (``--loader-workers`` DataLoader processes per training worker) and,
while it runs, samples every training worker's resident memory (RSS and USS, psutil) and
that of its loader processes. A run's data phase share comes from its ``summary.json``
(the trainer's ``data`` phase: waiting for the next batch). Prints a table and writes
JSON::

    python examples/data_bench.py --sizes 2000 20000 --out docs/results/data_loading.json

Folders decoded lazily keep a training worker's memory independent of the folder's size
(only the file list grows: about 100 bytes per file); the data set held as tensors would
take ``files x 3 x 32 x 32 x 4`` bytes in every worker (246 MB for 20,000 images).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import psutil
except ImportError:  # the test extra installs it; shmtrain itself does not need it
    sys.exit("examples/data_bench.py needs psutil to sample memory: pip install psutil "
             "(or install shmtrain with its test extra: pip install -e '.[test]')")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from examples.make_image_folder import make  # noqa: E402


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    found = []
    for p in launcher.children(recursive=True):
        try:
            if p.name().startswith("shmtrain-w"):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _memory(p: psutil.Process) -> tuple[int, int]:
    info = p.memory_full_info()
    return info.rss, info.uss


def run_one(folder: Path, out: Path, args: argparse.Namespace) -> dict:
    """One training run on ``folder``; peak memory per training worker and its loaders."""
    cmd = [sys.executable, "-m", "shmtrain", "train", "--data", str(folder / "train"), "--val-data",
           str(folder / "val"), "--model", args.model, "--image-size", str(args.size), "--workers", str(args.workers),
           "--loader-workers", str(args.loader_workers), "--batch-size", str(args.batch_size), "--iterations",
           str(args.iterations), "--eval-every", "0", "--checkpoint-every", "0", "--no-progress", "--out", str(out)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(launcher.pid)
    peak: dict[int, dict[str, int]] = {}
    while launcher.poll() is None:
        for worker in _workers(parent):
            try:
                rss, uss = _memory(worker)
                loaders = [_memory(c) for c in worker.children()]
            except psutil.Error:
                continue
            best = peak.setdefault(worker.pid, {"rss": 0, "uss": 0, "loader_rss": 0, "loader_uss": 0, "loaders": 0})
            best["rss"], best["uss"] = max(best["rss"], rss), max(best["uss"], uss)
            if loaders:
                best["loaders"] = max(best["loaders"], len(loaders))
                best["loader_rss"] = max(best["loader_rss"], max(r for r, _ in loaders))
                best["loader_uss"] = max(best["loader_uss"], max(u for _, u in loaders))
        time.sleep(0.2)
    _, err = launcher.communicate()
    if launcher.returncode != 0:
        raise SystemExit(f"shmtrain train failed ({launcher.returncode}): {err.strip().splitlines()[-1:]}")
    summary = json.loads((out / "summary.json").read_text())
    phases = summary["phases_ms"]
    mib = 1 << 20
    workers = list(peak.values())
    return {
        "files": sum(1 for _ in (folder / "train").rglob("*.png")) + sum(1 for _ in (folder / "val").rglob("*.png")),
        "worker_rss_mib": [round(w["rss"] / mib, 1) for w in workers],
        "worker_uss_mib": [round(w["uss"] / mib, 1) for w in workers],
        "loader_rss_mib": [round(w["loader_rss"] / mib, 1) for w in workers],
        "loader_uss_mib": [round(w["loader_uss"] / mib, 1) for w in workers],
        "data_ms": round(phases["data"], 3), "iteration_ms": round(phases["iteration"], 3),
        "data_share": round(phases["data"] / phases["iteration"], 4), "accuracy": summary["accuracy"],
    }


def probe(folder: Path, batches: int = 150) -> dict:
    """In this process: RSS after opening ``folder`` as the workers do, and after taking
    ``batches`` of 32 through 2 loader processes (``--probe``)."""
    from shmtrain.runtime.config import resolve
    from shmtrain.runtime.data.loader import LoaderBatches
    from shmtrain.runtime.data.sources import open_data
    from shmtrain.runtime.data.tensors import ShardSampler

    me, mib = psutil.Process(), 1 << 20
    config = resolve({"data": str(folder / "train"), "val_data": str(folder / "val"), "device": "cpu"})
    source = open_data(config)
    opened = me.memory_info().rss / mib
    loader = LoaderBatches(source, ShardSampler(source.train_samples, 32, 2, 0, 0), 2, False, 10, 0)
    try:
        for _ in range(batches):
            loader.next()
        taken = me.memory_info().rss / mib
    finally:
        loader.close()
    return {"train_files": source.train_samples, "rss_opened_mib": round(opened, 1),
            "rss_after_batches_mib": round(taken, 1), "batches": batches}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000], help="images per folder (train + val)")
    p.add_argument("--size", type=int, default=32, help="image side (default 32)")
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--work", type=Path, help="folder for the images and runs (default: a temporary one)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--probe", action="store_true", help="also measure in one process: RSS after opening each "
                   "folder and after 150 batches through 2 loader processes (run it once per size: the "
                   "first folder's imports are in the second's figure)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        rows = []
        for files in args.sizes:
            folder = work / f"shapes-{files}"
            if not (folder / "train").is_dir():
                start = time.perf_counter()
                make(folder, classes=4, per_class=round(files / 4 / 1.25), size=args.size, val_share=0.25)
                print(f"generated {folder} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            if args.probe:
                print(json.dumps({"probe": probe(folder)}))
                continue
            row = run_one(folder, work / f"run-{files}-{os.getpid()}", args)
            rows.append(row)
    if args.probe:
        return
    print(f"{'files':>7} {'worker RSS MiB':>16} {'worker USS MiB':>16} {'loader USS MiB':>16} "
          f"{'data ms':>8} {'iter ms':>8} {'data %':>7}")
    for r in rows:
        print(f"{r['files']:>7} {'/'.join(map(str, r['worker_rss_mib'])):>16} "
              f"{'/'.join(map(str, r['worker_uss_mib'])):>16} {'/'.join(map(str, r['loader_uss_mib'])):>16} "
              f"{r['data_ms']:>8.2f} {r['iteration_ms']:>8.2f} {100 * r['data_share']:>6.1f}%")
    if args.out:
        setting = {k: v for k, v in vars(args).items() if k not in ("work", "out")}
        result = {"command": "python examples/data_bench.py " + " ".join(argv or sys.argv[1:]),
                  "setting": setting, "cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0], "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
