"""The geometry of CaffeGPI's one-sided tree reduction over one host's workers.

CaffeGPI (Section III) reduces each layer's gradient up a binomial tree rooted at local
rank 0 with one-sided writes and notifications, and sends the new weights back down the
same way. :class:`TreeWindow` lays that out on a
:class:`~shmtrain.fabric.exchanges.onesided.OneSidedWindow`: rank ``r``'s area holds its
parameters, then one gradient slot per child of ``r``; the notification ids are, per
layer, one per child slot (a gradient arrived), one for new weights and, across hosts,
one for "the job's sum is in place" (raised by the host combiner). Built by
:meth:`shmtrain.fabric.transports.Transports.tree_window`.
"""

from __future__ import annotations

import torch

from shmtrain.fabric.exchanges.onesided import OneSidedWindow
from shmtrain.fabric.shm.host import HostGroup


def tree_parent(rank: int) -> int:
    """Parent of ``rank`` in the binomial tree rooted at 0 (-1 for the root)."""
    return rank - (rank & -rank) if rank else -1


def tree_children(rank: int, world: int) -> list[int]:
    """Children of ``rank`` in the binomial tree over ``world`` ranks, nearest first."""
    limit = (rank & -rank) if rank else world
    children, step = [], 1
    while step < limit and rank + step < world:
        children.append(rank + step)
        step <<= 1
    return children


class TreeWindow:
    """The one-sided window of the host's tree, with its areas and notification ids.

    Args:
        host: this host's workers (the tree spans its local ranks).
        layer_bytes: bytes of one full copy of the flat parameters.
        layers: the layers (parameters) reduced one by one.
        across_hosts: also reserve the per-layer "job's sum in place" notifications.
    """

    def __init__(self, host: HostGroup, layer_bytes: int, layers: int, *, across_hosts: bool,
                 tag: str = "gpi") -> None:
        self.world = world = host.local_world
        self.me = me = host.local_rank
        self.layer_bytes = layer_bytes
        self.layers = layers
        self.parent = tree_parent(me)
        self.children = tree_children(me, world)
        self.fanin = max(len(tree_children(r, world)) for r in range(world))
        areas = [layer_bytes * (1 + len(tree_children(r, world))) for r in range(world)]
        self.window = OneSidedWindow(host, areas, layers * (self.fanin + 1 + int(across_hosts)), tag=tag)
        #: this rank's slot in its parent's area (-1 for the root)
        self.parent_slot = tree_children(self.parent, world).index(me) if self.parent >= 0 else -1

    def weights(self, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s parameters in its area."""
        return self.window.area(rank, dtype, 0, numel)

    def slot(self, rank: int, child_slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Gradient slot ``child_slot`` of rank ``rank``'s area."""
        return self.window.area(rank, dtype, (1 + child_slot) * self.layer_bytes, numel)

    def grad_id(self, layer: int, child_slot: int) -> int:
        """Notification: the child of ``child_slot`` wrote its gradient of ``layer``."""
        return layer * self.fanin + child_slot

    def weights_id(self, layer: int) -> int:
        """Notification: the new weights of ``layer`` are in the parent's area."""
        return self.layers * self.fanin + layer

    def combined_id(self, layer: int) -> int:
        """Notification (across hosts): the job's sum of ``layer`` is in place."""
        return self.layers * (self.fanin + 1) + layer
