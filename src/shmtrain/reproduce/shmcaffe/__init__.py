"""Reproductions of the ShmCaffe paper (Ahn et al.): Table II,
Tables V-VI with eq. (8), and Fig. 7, one module each.

``shmcaffe-table2`` (Table II, Figs. 8, 11, 12; :mod:`.table2`): digits with ``smallcnn``,
the same epochs for one worker (``single``: Caffe, 1 GPU) and 2 workers of ``ssgd``
(MPICaffe's allreduce), ``ps_grad`` (Caffe-MPI's star) and ``seasgd`` (ShmCaffe-A), and
``hsgd`` S2xA2 on 4 workers (ShmCaffe-H, Table III's 4 (S2*A2)): training time for the
epochs (Table II's measure), time to a held-out accuracy (rank 0's ``--eval-every`` rows)
and the final accuracy.

``shmcaffe-tables5-6`` (Tables IV-VI; :mod:`.tables5_6`): computation vs exposed
communication per iteration (eq. (8): T_iter = max[T_comp, T_wwi + T_ugw] + T_rgw + T_ulw;
HSGD adds its allreduce and broadcast) of torchvision's networks on synthetic inputs, under
SEASGD and HSGD layouts.

``shmcaffe-fig7`` (Fig. 7; :mod:`.fig7`): aggregate read/write bandwidth of the buffer
service against the number of processes (``bench smb``), as a share of a plain memory copy
of the same bytes by as many processes, measured in the same run (in the role of the
paper's HCA).

:mod:`.common` holds what they share. Importing this package registers all three with
:func:`shmtrain.reproduce.core.reproduction`.
"""

from shmtrain.reproduce.shmcaffe import fig7, table2, tables5_6

__all__ = ["fig7", "table2", "tables5_6"]
