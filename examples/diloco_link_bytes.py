"""Bytes that cross the link between two hosts per iteration: ssgd against diloco.

Two network namespaces joined by a veth pair (``shmtrain.bench.hosts.command.two_hosts``), one
torchrun launch of 2 workers in each; the veth pair's byte counters (``ip -s link``,
both directions) are read before and after every run. ``floor`` (diloco with no outer
step in the run: the rendezvous, rank 0's weights broadcast to every worker, the
end-of-run gathers, which every method pays once) is subtracted from the others. Needs root and iproute2. Run from the
checkout::

    sudo python examples/diloco_link_bytes.py --iterations 60 --json link_bytes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from shmtrain.bench.hosts.net import host_env, link_bytes, two_hosts, why_not

METHODS = {
    "floor": ["--strategy", "diloco", "--sync-every", "100000"],
    "ssgd": ["--strategy", "ssgd"],
    "ssgd-bf16": ["--strategy", "ssgd", "--comm-dtype", "bf16"],
    "diloco-H20": ["--strategy", "diloco", "--sync-every", "20"],
    "diloco-H20-bf16": ["--strategy", "diloco", "--sync-every", "20", "--outer-dtype", "bf16"],
    "diloco-H20-F4-overlap2": ["--strategy", "diloco", "--sync-every", "20", "--fragments", "4",
                               "--overlap-steps", "2", "--mixing", "0.5"],
    "hybrid-H20-bf16": ["--strategy", "diloco", "--sync-every", "20", "--inner", "host-sync",
                        "--outer-dtype", "bf16"],
}


def run_method(hosts: tuple[str, str, str], flags: list[str], args: argparse.Namespace, out: Path) -> dict:
    a, b, master = hosts
    procs = []
    for node, ns in enumerate((a, b)):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", master, "--master-port",
               "29500", "-m", "shmtrain", "train", *flags, "--model", args.model, "--iterations",
               str(args.iterations), "--batch-size", "32", "--seed", "1", "--timeout", "60", "--no-progress",
               "--checkpoint-every", "0", "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=host_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(outputs))
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--model", default="wide_mlp")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--json", default="")
    args = p.parse_args()
    reason = why_not("none")
    if reason:
        print(f"skipped: {reason}")
        return 0
    rows = []
    with two_hosts("none") as hosts, tempfile.TemporaryDirectory() as tmp:
        for name in args.methods:
            before = link_bytes(hosts[0])
            summary = run_method(hosts, METHODS[name], args, Path(tmp) / name)
            total = link_bytes(hosts[0]) - before
            rows.append({"method": name, "link_bytes": total, "iterations": summary["iterations"],
                         "accuracy": summary.get("accuracy"),
                         "comm_ms": summary["phases_ms"].get("comm")})
    floor = next((r["link_bytes"] for r in rows if r["method"] == "floor"), 0)
    print(f"{'method':26} {'link MB':>9} {'kB/iter over floor':>20} {'comm ms/iter':>13} {'accuracy':>9}")
    for r in rows:
        r["bytes_per_iteration"] = (r["link_bytes"] - floor) / r["iterations"]
        print(f"{r['method']:26} {r['link_bytes'] / 1e6:9.2f} {r['bytes_per_iteration'] / 1e3:20.1f} "
              f"{r['comm_ms'] or 0:13.2f} {r['accuracy'] or 0:9.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"iterations": args.iterations, "model": args.model, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
