"""What the ShmCaffe reproductions share: the paper's name, the one-host caveat, a
percentage, and a matplotlib (Agg) figure with its saving."""

from __future__ import annotations

from pathlib import Path

from shmtrain.reproduce.core import PAPERS

PAPER = PAPERS["shmcaffe"]
NO_HOSTS = ("Multi-host runs are not available here (one machine): the buffer service is local "
            "shared memory (SMB-API), not the paper's memory server over InfiniBand (SMB-REMOTE), "
            "and every 'node' of HSGD is a group of processes on this host.")


def pct(value: float) -> str:
    return f"{value:.0%}"


def figure(ncols: int, size: tuple[float, float]):
    """A matplotlib (Agg) figure and its axes; :func:`save` writes and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size)


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
