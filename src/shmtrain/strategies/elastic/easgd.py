"""EASGD: elastic averaging SGD (ShmCaffe eqs. (2)-(4)), the paper's comparison point.

Every ``update_interval`` iterations, with W_x the weights before the local SGD step,
W_g the global weights and alpha the ``moving_rate``::

    W'_x  = W_x - eta G_x                (2)   the optimizer's step
    W''_x = W'_x - alpha (W_x - W_g)     (3)
    W'_g  = W_g + alpha (W_x - W_g)      (4)

The elastic difference is taken at the weights the gradient was computed at (W_x), not
after the step as in SEASGD's eq. (5), and the exchange is synchronous: the worker reads
W_g at the start of the iteration (``rgw``) and, after its step, applies eq. (3) (``ulw``),
writes the difference (``wwi``) and waits while the buffer service's owner adds it into
W_g (``ugw``), the parameter-server side of eq. (4). Nothing overlaps computation. With
``--compress`` a worker across a link from the memory server reads its mirror of W_g and
sends the difference compressed (:mod:`shmtrain.strategies.elastic.compress`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shmtrain.strategies.base import register
from shmtrain.strategies.elastic.shared_weights import ElasticConfig, SharedWeightsStrategy


@register
class EASGD(SharedWeightsStrategy):
    """Elastic averaging with a synchronous exchange through the buffer service."""

    name = "easgd"

    @dataclass(kw_only=True, slots=True)
    class Config(ElasticConfig):
        pass

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.global_copy = torch.empty_like(self.weights)
        self.difference = torch.empty_like(self.weights)
        self._exchanging = False

    def start_iteration(self) -> None:
        self._exchanging = self.iteration % self.config.update_interval == 0
        if not self._exchanging:
            return
        with self.timer.phase("rgw"):
            if self.compressed is not None:  # across the link: the mirror of W_g, updated compressed
                self.compressed.read(self.global_copy)
            else:
                self.service.read(self.global_weights, self.global_copy)
        with self.timer.phase("ulw"):  # alpha (W_x - W_g), before the step moves W_x
            torch.sub(self.weights, self.global_copy, out=self.difference).mul_(self.config.moving_rate)

    def after_update(self) -> None:
        if self._exchanging:
            timer = self.timer
            with timer.phase("ulw"):
                self.weights.sub_(self.difference)  # (3)
            if self.compressed is not None:
                with timer.phase("ugw"):  # (4) across the link: C(difference + e), applied by the server
                    self.compressed.accumulate(self.difference)
            else:
                with timer.phase("wwi"):
                    self.service.write(self.weight_increment, self.difference)
                with timer.phase("ugw"):  # (4), applied by the service's owner
                    self.service.wait(self.service.accumulate(self.weight_increment, self.global_weights))
            t = timer.current
            timer.add("comm", sum(t.get(k, 0.0) for k in ("rgw", "ulw", "wwi", "ugw")))
            self._exchanging = False
        super().after_update()
