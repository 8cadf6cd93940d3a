"""A byte-level language model on text every machine has: the source files of Python's
standard library (``sysconfig.get_paths()["stdlib"]``; nothing is downloaded).

``--data examples.lm_text:stdlib_text`` returns a ``(train, val)`` pair of byte chunks,
held out by file (the files are split, not the chunks, so no held-out file was seen in
training); ``--model examples.lm_text:Net`` is a small causal transformer; ``--task
language-model`` scores next-byte prediction and reports the held-out perplexity (256
for a model that knows nothing, 1 for a perfect one). Run from the repository's root (the
current directory is importable)::

    shmtrain train --task language-model --data examples.lm_text:stdlib_text \\
        --model examples.lm_text:Net --optimizer adamw --lr 3e-3 --batch-size 16 \\
        --workers 2 --iterations 300

or ``python examples/lm_text.py`` (the same command). The run gets everything a
classification run gets (run folder, checkpoints and exact resume, plots, trace,
TensorBoard, ``shmtrain compare``, ``shmtrain evaluate``), with every strategy.
"""

from __future__ import annotations

import math
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

#: bytes are the tokens
VOCAB = 256


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (installed packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file())


class ByteChunks(Dataset):
    """Non-overlapping windows of ``length + 1`` bytes (a LongTensor each) of ``text``: the
    model reads the first ``length``, and predicts each next byte."""

    vocab_size = VOCAB

    def __init__(self, text: bytes, length: int) -> None:
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.length = length

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.length)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.length
        return self.tokens[start : start + self.length + 1].long()


def stdlib_text(files: int = 200, length: int = 64, val_share: float = 0.1, seed: int = 0) -> tuple[ByteChunks,
                                                                                                     ByteChunks]:
    """(train, val) chunks of ``files`` standard-library files drawn with ``seed``; the
    first ``val_share`` of them (at least one file) are held out."""
    every = stdlib_files()
    if not every:
        raise ValueError(f"--data examples.lm_text:stdlib_text: no .py files under {sysconfig.get_paths()['stdlib']}")
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = [every[i] for i in order[: max(2, min(files, len(every)))]]
    held = max(1, round(val_share * len(chosen)))
    val = b"".join(f.read_bytes() for f in chosen[:held])
    train = b"".join(f.read_bytes() for f in chosen[held:])
    return ByteChunks(train, length), ByteChunks(val, length)


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to its input."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    """A small causal transformer over bytes: ``(B, T)`` ids -> ``(B, T, num_classes)``
    logits (no dropout, so data-parallel runs equal single-process ones)."""

    def __init__(self, num_classes: int = VOCAB, width: int = 64, layers: int = 2, heads: int = 4,
                 max_length: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, width)
        self.position = nn.Parameter(torch.randn(max_length, width) * 0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        return self.head(self.norm(self.blocks(x)))


COMMAND = ["train", "--task", "language-model", "--data", "examples.lm_text:stdlib_text",
           "--model", "examples.lm_text:Net", "--optimizer", "adamw", "--lr", "3e-3", "--batch-size", "16",
           "--workers", "2", "--iterations", "300"]


if __name__ == "__main__":
    from shmtrain.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples importable
    status = main([*COMMAND, *sys.argv[1:]])
    print(f"(a model that knows nothing has perplexity {VOCAB}; ln {VOCAB} = {math.log(VOCAB):.3f} nats/byte)")
    sys.exit(status)
