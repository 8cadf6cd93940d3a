"""A label-skewed shard per host (``--class-split N``): the task no single host can learn alone.

With ``--class-split N`` the classes are dealt into N groups (class ``c`` to group
``c mod N``) and the workers of host ``k`` (torchrun's node rank) train only on the
training samples of group ``k mod N``; inside a host they shard that subset as
:class:`shmtrain.runtime.data.tensors.ShardSampler` shards the whole set (no sample twice in an
epoch of the subset). The held-out split keeps every class, so a host alone reaches at
most about its share of the classes (``shmtrain bench hosts``' one-host run shows it);
the job's model must combine the hosts' shards to go further. ``0`` (the default) is
the usual sharding of the whole set over every worker.
"""

from __future__ import annotations

from typing import Any

import torch

from shmtrain.runtime.data.tensors import ShardSampler


def host_classes(num_classes: int, groups: int, group: int) -> list[int]:
    """The classes of group ``group`` of ``groups``: ``c`` with ``c mod groups == group``."""
    if not 1 <= groups <= num_classes:
        raise ValueError(f"--class-split {groups}: the data set has {num_classes} classes; give at most "
                         f"{num_classes} groups (or 0: no split)")
    return [c for c in range(num_classes) if c % groups == group % groups]


class SubsetSampler(ShardSampler):
    """:class:`ShardSampler` over the samples ``subset`` (indices into the training set)."""

    def __init__(self, subset: torch.Tensor, batch: int, world: int, rank: int, seed: int) -> None:
        super().__init__(len(subset), batch, world, rank, seed)
        self.subset = subset

    def indices(self, step: int) -> torch.Tensor:
        return self.subset[super().indices(step)]


def train_labels(data: Any) -> torch.Tensor:
    """The training labels of ``data``: a :class:`~shmtrain.runtime.data.sources.DataSource` (its
    tensors, or a folder's ``targets``) or a tensor :class:`~shmtrain.runtime.data.tensors.Dataset`."""
    tensors = getattr(data, "tensors", None) or data
    if hasattr(tensors, "train_y"):
        return tensors.train_y
    targets = getattr(getattr(data, "train", None), "targets", None)
    if targets is None:
        raise ValueError(f"--class-split with --data {data.name}: the training labels are not known up front "
                         "(no 'targets' attribute); use digits, synthetic or an image folder, or give your "
                         "Dataset a 'targets' list")
    return torch.as_tensor(targets)


def shard_sampler(data: Any, batch: int, seed: int, ctx: Any, class_split: int = 0) -> ShardSampler:
    """This worker's sampler: the whole set over every worker, or (``class_split`` N > 0)
    its host's group of classes over the host's workers."""
    if not class_split:
        size = data.train_samples if hasattr(data, "train_samples") else len(data.train_x)
        return ShardSampler(size, batch, ctx.world_size, ctx.rank, seed)
    node = getattr(ctx, "node_rank", 0)
    chosen = torch.tensor(host_classes(data.num_classes, class_split, node))
    subset = torch.nonzero(torch.isin(train_labels(data), chosen)).flatten()
    return SubsetSampler(subset, batch, ctx.local_world, ctx.local_rank, seed + 7919 * node)
