"""Reproductions of the swCaffe paper (You, Fang, Li et al.), see :mod:`shmtrain.reproduce.core`.

``swcaffe-fig10-11`` (SCALE, TOPO, RHD): the speed-up (Fig. 10) and the share of
communication in an iteration (Fig. 11) of synchronous SGD (Algorithm 1) on 1-1024
nodes, for AlexNet (232.6 MB of gradients) and ResNet-50 (97.7 MB), by the simulator
(:func:`shmtrain.sim.simulate.simulate_all`: the topology-aware allreduce of eqs. (5)-(6)
on supernodes of 256 nodes, beside plain recursive halving/doubling, eqs. (2)-(4)). The
compute time per iteration is the paper's: sub-mini-batch / the SW26010's images per
second of Table III. Weak scaling as in Section VI-C: the speed-up at P nodes is
``P t_comp / (t_comp + t_allreduce(P))``, which gives back the paper's pairs of Figs.
10 and 11 (e.g. 715.45x at 1024 nodes is 1 - 30.13% of 1024).

The same model is then held to this machine: alpha and beta are fitted on shmtrain's
shared-memory allreduce (a small and a large buffer; 2 processes with --quick, 2 and 4
otherwise), gamma on a local sum; an ``ssgd`` iteration is predicted as compute +
allreduce, once from one worker alone (times ceil(workers / cores): more workers than
cores take turns) and once from the workers computing at once (``nocomm`` in the same
run), and compared with the measured one.

Modules: :mod:`.scaling` (Figs. 10-11 by the simulator), :mod:`.calibration` (this
machine), :mod:`.fig10_11` (the reproduction: claims, report, figure). Importing this
package registers ``swcaffe-fig10-11`` with :func:`shmtrain.reproduce.core.reproduction`.
"""

from shmtrain.reproduce.swcaffe import fig10_11

__all__ = ["fig10_11"]
