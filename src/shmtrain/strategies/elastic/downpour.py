"""Downpour ASGD (ShmCaffe eq. (1)), the paper's comparison point.

The global weights take every worker's update: with one SGD step per exchange
(``update_interval`` 1) and a plain SGD optimizer::

    W'_g = W_g - eta G_x     (1)

where G_x is the gradient worker x computed at the global weights it last fetched. The
worker steps its local copy with its optimizer, so the update it sends is
``W_x - W_fetched`` (exactly -eta G_x for plain SGD, the sum of its steps for
``update_interval`` > 1 or another optimizer): it writes that increment (``wwi``), the
buffer service's owner adds it into W_g (``ugw``), and the worker fetches the new W_g
into its local weights (``rgw``) and keeps a copy as the next reference (``ulw``).
The exchange is synchronous; nothing overlaps computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shmtrain.strategies.base import register
from shmtrain.strategies.elastic.shared_weights import AsyncConfig, SharedWeightsStrategy


@register
class Downpour(SharedWeightsStrategy):
    """Asynchronous SGD pushing updates into, and fetching weights from, the service."""

    name = "downpour"

    @dataclass(kw_only=True, slots=True)
    class Config(AsyncConfig):
        pass

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.service.read(self.global_weights, self.weights)
        self.fetched = self.weights.clone()  # W_fetched: where this worker's gradients start
        self.update = torch.empty_like(self.weights)

    def after_update(self) -> None:
        if (self.iteration + 1) % self.config.update_interval == 0:
            timer = self.timer
            with timer.phase("wwi"):
                torch.sub(self.weights, self.fetched, out=self.update)
                self.service.write(self.weight_increment, self.update)
            with timer.phase("ugw"):  # (1), applied by the service's owner
                self.service.wait(self.service.accumulate(self.weight_increment, self.global_weights))
            with timer.phase("rgw"):
                self.service.read(self.global_weights, self.weights)
            with timer.phase("ulw"):
                self.fetched.copy_(self.weights)
            t = timer.current
            timer.add("comm", sum(t.get(k, 0.0) for k in ("rgw", "ulw", "wwi", "ugw")))
        super().after_update()

    def state_dict(self) -> dict:
        """Adds W_fetched, where this worker's gradients since the last push started."""
        return {**super().state_dict(), "fetched": self.fetched.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.fetched.copy_(state["fetched"])
