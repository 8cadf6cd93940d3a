"""How early ``--sub-batch`` delivers the classifier's averaged gradient: ``smallcnn`` on a
3x32x32 batch of 64 over K = 2 threads (1 torch thread each), the time from the model's
post-accumulate-grad hook on the classifier's weight to the end of the threads' backward,
median of 20 steps after 3 of warm-up (docs/subbatch.md). Run from the repository's root:

    python docs/results/subbatch_hooks.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from shmtrain.models.registry import build_model
from shmtrain.runtime.train.subbatch import SubBatch


def main() -> None:
    torch.set_num_threads(1)
    model = build_model("smallcnn", (3, 32, 32), 10)
    name, weight = list(model.named_parameters())[-2]  # the last Linear's weight
    fired: list[float] = []
    weight.register_post_accumulate_grad_hook(lambda _: fired.append(time.perf_counter()))
    sub = SubBatch(model, 2, nn.CrossEntropyLoss())
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    ahead = []
    try:
        for step in range(23):
            model.zero_grad()
            sub.step(x, y)
            if step >= 3:
                ahead.append(1e3 * (time.perf_counter() - fired[-1]))
    finally:
        sub.close()
    print(f"{name}: its averaged gradient reached the model's hook {statistics.median(ahead):.0f} ms before the "
          f"2 threads had finished backward (median of 20 steps; {min(ahead):.0f}-{max(ahead):.0f} ms)")


if __name__ == "__main__":
    main()
