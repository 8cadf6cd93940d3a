"""SMB-REMOTE's progress board: progress, state and liveness in the memory server's store, sealed.

ShmCaffe's control information (Figs. 3-4, Section III-E) for workers on several hosts:
one store entry per worker for its iterations and state (``smb/progress/<rank>``) and one
liveness mark per lost worker (``smb/dead/<rank>``). The store itself authenticates no
one, so every entry is sealed with the job's shared secret and the server's nonce
(:func:`~shmtrain.fabric.smb.wire.seal`): a reader refuses an entry that is not (logged
once, naming the key) and keeps the last sealed value it saw, so a party that has not
proven the secret can neither mark a worker dead nor move its progress.
:class:`StoreAudit` is the server's side: it names every entry such a party wrote.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shmtrain.fabric.smb.api import STATE_SETUP, ProgressBoard
from shmtrain.fabric.smb.wire import seal, unseal

#: counters and announcements clients keep in the store (no state a reader trusts)
COUNTERS = ("smb/joined", "smb/joins", "smb/ready")
#: a liveness mark's values (ALIVE: a lost worker connected again; LEFT: it said goodbye,
#: so its rank may connect again at once)
DEAD, ALIVE, LEFT = "1", "0", "2"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StoreProgressBoard(ProgressBoard):
    """Progress, state and liveness of the remote service's clients, in the server's store,
    sealed with the shared secret (none when the server has none: then the store is
    trusted, as on a loopback-only server). A failure to reach the store is the
    :class:`~shmtrain.fabric.shm.control.PeerFailure` ``lost`` makes (naming the server).

    Args:
        store: the memory server's store; rank, world: this worker and the job's workers.
        lost: turns a store error into the error naming the server.
        secret, nonce: the shared secret and the server's nonce (the seal's key).
        log: where a refused entry is reported (stderr: the worker's log).
    """

    def __init__(self, store: dist.Store, rank: int, world: int,
                 lost: Callable[[RuntimeError, str], Exception] | None = None, *,
                 secret: bytes | None = None, nonce: str = "", log: Callable[[str], None] = _stderr,
                 watch: Any = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        #: times each store call (a :class:`~shmtrain.fabric.smb.stuck.CallWatch`; None: untimed)
        self.watch = watch
        self._lost = lost
        self.secret, self.nonce, self.log = secret, nonce, log
        self._seen: dict[str, tuple[int, str, bytes]] = {}  # key -> (write time, value, entry): newest sealed
        self.forged: list[str] = []  # the keys of refused entries, in the order seen
        self._reported: set[tuple[str, bytes]] = set()
        self._state = STATE_SETUP
        # a worker that connects again (its host was lost) goes on from the iterations the
        # board holds for it (its TERM counter); a new one starts at 0
        self.set_progress(self.progress(rank), STATE_SETUP)

    def _do(self, fn: Callable, what: str):
        try:
            if self.watch is None:
                return fn()
            with self.watch.call(what):
                return fn()
        except RuntimeError as exc:
            if self._lost is None:
                raise
            raise self._lost(exc, what) from None

    def _put(self, key: str, value: str, what: str) -> None:
        raw = seal(self.secret, self.nonce, key, value)
        self._do(lambda: self.store.set(key, raw), what)
        self._seen[key] = (int(raw.split(";")[-2]), value, raw.encode())

    def _get(self, key: str, what: str) -> str | None:
        """The newest sealed value of ``key`` seen so far (None: none yet); an entry that is
        not sealed with the secret, or older than one seen, changes nothing (a forged one is
        replaced by the newest sealed entry this reader saw, unless a sealed one came since)."""
        raw = self._do(lambda: self.store.get(key) if self.store.check([key]) else None, what)
        seen = self._seen.get(key)
        if raw:  # an emptied entry is none
            opened = unseal(self.secret, self.nonce, key, raw.decode(errors="replace"))
            if opened is None:
                self._refuse(key, raw)
                if seen is not None:
                    self._do(lambda: self.store.compare_set(key, raw, seen[2]), what)
            elif seen is None or opened[1] >= seen[0]:
                seen = self._seen[key] = (opened[1], opened[0], raw)
        return None if seen is None else seen[1]

    def _refuse(self, key: str, raw: bytes) -> None:
        if (key, raw) in self._reported:
            return
        self._reported.add((key, raw))
        self.forged.append(key)
        self.log(f"shmtrain: worker {self.rank} ignored store entry {key} = {raw[:60]!r}: it is not sealed with "
                 "the memory server's shared secret (a party that has not proven the secret wrote it); "
                 "the last sealed value stands")

    def set_progress(self, iterations: int, state: int | None = None) -> None:
        if state is not None:
            self._state = state
        self._put(f"smb/progress/{self.rank}", f"{iterations},{self._state}", "publishing progress")

    def _record(self, rank: int) -> tuple[int, int]:
        text = self._get(f"smb/progress/{rank}", "reading progress")
        if text is None:
            return 0, STATE_SETUP
        iterations, state = text.split(",")
        return int(iterations), int(state)

    def progress(self, rank: int) -> int:
        return self._record(rank)[0]

    def state(self, rank: int) -> int:
        return self._record(rank)[1]

    def alive(self, rank: int) -> bool:
        return self._get(f"smb/dead/{rank}", "reading liveness") != DEAD

    def mark_dead(self, rank: int) -> None:
        """Record that worker ``rank`` is lost (its host's launcher saw it die)."""
        self._put(f"smb/dead/{rank}", DEAD, "recording a lost worker")


class StoreAudit:
    """The server's watch on its store: what a party that has not proven the secret wrote.

    Each :meth:`run` lists the store and returns one log line per entry not reported
    before, and puts back what such a party replaced: the server's own entries, and each
    board entry's last sealed value (a forged entry with none is removed). Gloo's
    rendezvous (``smb/pg/``), connection announcements (``smb/join/``: a link starts
    untrusted), the counters and peer addresses are the store's own business; any other key means nothing to the server
    and is only reported. The store
    does not say who wrote an entry, so the lines cannot name the writer's address.

    Args:
        store: the server's store; secret, nonce: the seal's key.
        own: the server's own entries and their values; clients: the job's workers.
    """

    def __init__(self, store: dist.Store, secret: bytes | None, nonce: str, own: dict[str, str],
                 clients: int) -> None:
        self.store, self.secret, self.nonce, self.own = store, secret, nonce, own
        self.board = {f"smb/{kind}/{r}" for kind in ("progress", "dead") for r in range(clients)}
        self.sealed: dict[str, bytes] = {}  # board key -> its last sealed entry
        self.reported: set[tuple[str, bytes]] = set()

    def _put_back(self, key: str, raw: bytes | None) -> str:
        good = self.own[key].encode() if key in self.own else self.sealed.get(key)
        if good is None:  # emptied (not deleted: a sealed entry written meanwhile stays)
            return "removed" if self.store.compare_set(key, raw or b"", b"") == b"" else \
                "a sealed value has replaced it since"
        if raw is None:
            self.store.set(key, good)
        elif self.store.compare_set(key, raw, good) != good:  # a sealed one replaced it meanwhile
            return "a sealed value has replaced it since"
        return "the last sealed value put back"

    def run(self) -> list[str]:
        if not hasattr(self.store, "list_keys"):
            return []
        lines = []
        present = set(self.store.list_keys())
        for key in sorted(present | {k for k in (*self.own, *self.sealed) if k not in present}):
            if key.startswith(("smb/pg/", "smb/peer/", "smb/join/")) or key in COUNTERS:
                continue
            raw = self.store.get(key) if key in present else None
            if raw == b"" and key in self.board:  # emptied: no entry (see _put_back)
                continue
            if key in self.own:
                bad = raw != self.own[key].encode()
            elif key in self.board:
                bad = raw is None or unseal(self.secret, self.nonce, key, raw.decode(errors="replace")) is None
                if not bad:
                    self.sealed[key] = raw
            else:
                bad = None  # a key the server never uses
            if bad is False or (key, raw or b"") in self.reported:
                continue
            self.reported.add((key, raw or b""))
            shown = "deleted" if raw is None else f"= {raw[:60]!r}"
            why = ("a key the server never uses (buffer names and ids are given out only on the "
                   "authenticated link); ignored") if bad is None else \
                f"not sealed with the shared secret; every client ignores it ({self._put_back(key, raw)})"
            lines.append(f"shmtrain smb-server: refused store entry {key} {shown} from an unauthenticated party "
                         f"(the store cannot name its address): {why}; keep the server's port on a network only "
                         "the job's hosts reach")
        return lines
