"""Runs of tests/support/lightning_script.py: Lightning's Trainer under its own launcher,
or the same method through DataParallel in a plain loop under torchrun; the results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from conftest import at_once
from support.paths import SUPPORT
from support.torchrun import TORCHRUN, env, free_port

SCRIPT = str(SUPPORT / "lightning_script.py")


def lightning_command(out: Path, **settings: Any) -> tuple[list[str], dict[str, str]]:
    """Lightning's Trainer (its subprocess launcher starts the other ranks) writing ``out``."""
    run_env = env()
    run_env["MASTER_PORT"] = str(free_port())
    return [sys.executable, SCRIPT, "lightning", str(out), json.dumps(settings)], run_env


def lightning_torchrun_command(out: Path, workers: int = 2, nodes: int = 1, node: int = 0, port: int = 0,
                               **settings: Any) -> tuple[list[str], dict[str, str]]:
    """Lightning's Trainer under torchrun (host ``node`` of ``nodes``, ``workers`` each; one
    ``port`` for all the hosts of a job), writing ``out``."""
    settings = {"workers": workers, "nodes": nodes, **settings}
    return (TORCHRUN + ["--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", str(workers),
                        "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()), SCRIPT, "lightning",
                        str(out), json.dumps(settings)], env())


def plain_command(out: Path, workers: int = 2, **settings: Any) -> tuple[list[str], dict[str, str]]:
    """DataParallel in a plain loop under torchrun writing ``out``."""
    return (TORCHRUN + ["--nproc-per-node", str(workers), "--master-addr", "127.0.0.1", "--master-port",
                        str(free_port()), SCRIPT, "plain", str(out), json.dumps(settings)], env())


def run(commands: dict[str, tuple[list[str], dict[str, str]]], timeout: float = 170) -> None:
    """Run the commands at once; each must exit 0."""
    done = at_once(commands, timeout=timeout)
    for key, result in done.items():
        assert result.returncode == 0, (key, result.stdout[-3000:], result.stderr[-6000:])


def weights(out: Path) -> torch.Tensor:
    return torch.load(out)


def seen(out: Path) -> dict[str, Any]:
    return json.loads(Path(f"{out}.json").read_text())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm())
