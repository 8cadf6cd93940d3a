"""The shared memory buffer service (SMB-API): named buffers, keys, read, write, accumulate.

ShmCaffe's Soft Memory Box (Section III-B, Figs. 2, 5 and 7), one module per part:

:mod:`~shmtrain.fabric.smb.api`
    The types both sides share: :class:`BufferService` (the client interface),
    :class:`BufferKey`, :class:`Buffer`, :class:`Ticket`, :class:`ProgressBoard` and the
    worker states ``STATE_SETUP``, ``STATE_TRAINING``, ``STATE_DONE``.
:mod:`~shmtrain.fabric.smb.local`
    The service for the workers of one host, over POSIX shared memory:
    :class:`LocalBufferService`, its :class:`BufferServer` (the one owner applying
    accumulations) and :class:`LocalProgressBoard`.
:mod:`~shmtrain.fabric.smb.wire`
    SMB-REMOTE's wire format: request headers, replies, tags, ops and status codes, the
    seals of store entries, the gloo link; :mod:`~shmtrain.fabric.smb.handshake` the
    proof of the shared secret that client and server give each other per connection.
:mod:`~shmtrain.fabric.smb.server`
    SMB-REMOTE's memory server (``MemoryServer``), which ``shmtrain smb-server`` runs;
    :mod:`~shmtrain.fabric.smb.gate` its trust (its side of the handshake, buffer names,
    the audit of its store), :mod:`~shmtrain.fabric.smb.snapshot` its snapshot files.
:mod:`~shmtrain.fabric.smb.board`
    ``StoreProgressBoard``: progress, state and liveness in the server's store, sealed
    with the shared secret; ``StoreAudit``, the server's check of that store.
:mod:`~shmtrain.fabric.smb.remote`
    SMB-REMOTE's client: ``RemoteBufferService``, ``read_secret``;
    :mod:`~shmtrain.fabric.smb.job_server` ``start_memory_server`` (global rank 0 starts
    a job's server: its private files, its secret sent over the job's gloo group).

This package re-exports the API and the local service; the remote modules are imported
by their own paths. :func:`shmtrain.fabric.transports.open_buffer_service` builds a
service by name.
"""

from shmtrain.fabric.smb.api import (
    STATE_DONE,
    STATE_SETUP,
    STATE_TRAINING,
    Buffer,
    BufferKey,
    BufferService,
    ProgressBoard,
    Ticket,
)
from shmtrain.fabric.smb.local import LINE, BufferServer, LocalBufferService, LocalProgressBoard

__all__ = [
    "LINE",
    "STATE_DONE",
    "STATE_SETUP",
    "STATE_TRAINING",
    "Buffer",
    "BufferKey",
    "BufferServer",
    "BufferService",
    "LocalBufferService",
    "LocalProgressBoard",
    "ProgressBoard",
    "Ticket",
]
