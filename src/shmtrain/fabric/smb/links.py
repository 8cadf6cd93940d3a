"""SMB-REMOTE's links: one gloo pair per client connection, so clients come and go.

A client announces itself in the server's store (``smb/joins`` counts connections,
``smb/join/<n>`` holds ``RANK/WORLD`` of connection ``n``) and forms a two-member gloo group
with the server under the prefix ``smb/pg/<n>/`` (the server is its rank 0). A client
whose host was lost connects again the same way, with a new ``n``, and gets a new link;
the server never waits for a fixed number of them (``--clients`` is the largest rank
count it serves). :class:`Acceptor` forms the server's side of each link and
:func:`receive_requests` reads one client's requests; both hand what they see to the
serving thread as events on one queue, so the server's state changes in one thread.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from shmtrain.fabric.shm.control import first_line
from shmtrain.fabric.smb.wire import HEADER, OP_BYE, TAG_REQUEST, gloo_link

#: a link's timeout for its waits: a request's receive must never time out (gloo loses a
#: link's later messages after a timed-out receive: measured); payloads have their own bound
FOREVER = datetime.timedelta(days=365)


def join(store: dist.Store, rank: int, world: int, host: str,
         timeout: datetime.timedelta) -> tuple[int, dist.ProcessGroup]:
    """The client's side: announce connection ``n`` for ``rank`` of a job of ``world``
    workers and form its link; returns ``n`` (the handshake's proofs are bound to it) and
    the link."""
    n = store.add("smb/joins", 1)
    store.set(f"smb/join/{n}", f"{rank}/{world}")
    return n, gloo_link(dist.PrefixStore(f"smb/pg/{n}/", store), 1, 2, host, timeout)


def receive_requests(link: dist.ProcessGroup, client: int, generation: int, inbox: queue.Queue) -> None:
    """One client's requests, in its order: a header is received, handed to the serving
    thread with an event it sets once the request is handled, and only then is the next
    receive posted (as the one any-source receive did before). The receive left posted
    while the client is idle is how its death is seen: gloo fails it as soon as the link
    closes (measured: at once after SIGKILL). Ends after a goodbye."""
    while True:
        header = torch.zeros(HEADER, dtype=torch.int64)
        try:
            link.recv([header], 1, TAG_REQUEST).wait(FOREVER)
        except RuntimeError as exc:
            inbox.put(("closed", client, generation, exc))
            return
        handled = threading.Event()
        inbox.put(("request", client, generation, (header, handled)))
        handled.wait()
        if int(header[0]) == OP_BYE:
            return


class Acceptor:
    """The server's side of joining: waits for each connection's announcement, checks the
    rank (``admit``: None to accept, else the reason it is refused, logged) and forms the
    link in a thread of its own (a client that never completes it stalls no one); each
    formed link is an event ``("joined", client, n, (link, world))`` on ``inbox``."""

    def __init__(self, store: dist.Store, watch: dist.Store, bind: str, clients: int, inbox: queue.Queue,
                 admit: Callable[[int], str | None], log: Callable[[str], None]) -> None:
        # ``watch``: a store client of its own for the blocking waits (a store client
        # serializes its calls: the server's other calls would wait behind them)
        self.store, self.watch, self.bind, self.clients, self.inbox = store, watch, bind, clients, inbox
        self.admit, self.log = admit, log
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="smb-accept", daemon=True)
        self.forming: list[threading.Thread] = []

    def start(self) -> None:
        if not self.thread.is_alive() and not self.stopped.is_set():
            self.thread.start()

    def stop(self) -> None:
        """Stop accepting (links being formed finish on their own)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(5.0)

    @property
    def busy(self) -> int:
        """Threads still inside the store or gloo (the acceptor, links being formed)."""
        return sum(t.is_alive() for t in [self.thread, *self.forming])

    def _run(self) -> None:
        n = 0
        while not self.stopped.wait(0.02):  # polled: a store wait that times out logs from C++
            key = f"smb/join/{n + 1}"
            try:
                if not self.watch.check([key]):
                    continue
                text = self.watch.get(key).decode(errors="replace")
            except RuntimeError:  # the store is closing
                return
            n += 1
            rank, _, world = text.partition("/")
            if not (rank.isdigit() and world.isdigit() and int(rank) < int(world) <= self.clients):
                why = (f"{text[:40]!r} is not RANK/WORLD with RANK < WORLD <= {self.clients} (--clients); "
                       f"restart the server with --clients of the job's workers, or it is not a shmtrain client")
            else:
                why = self.admit(int(rank) + 1)
            if why:
                self.log(f"shmtrain smb-server: connection {n} ({self._announced(rank)}) refused: {why}")
                continue
            self.forming = [t for t in self.forming if t.is_alive()]
            self.forming.append(thread := threading.Thread(target=self._form, args=(int(rank) + 1, n, int(world)),
                                                           name=f"smb-link-{n}", daemon=True))
            thread.start()

    def _announced(self, rank: str) -> str:
        """``rank R, announced address A`` of a connection (the address the client wrote)."""
        key = f"smb/peer/{rank}"
        try:
            address = self.watch.get(key).decode(errors="replace")[:64] if rank.isdigit() and \
                self.watch.check([key]) else "unknown"
        except RuntimeError:
            address = "unknown"
        return f"rank {rank[:20]}, announced address {address}"

    def _form(self, client: int, n: int, world: int) -> None:
        try:
            link = gloo_link(dist.PrefixStore(f"smb/pg/{n}/", self.store), 0, 2, self.bind, FOREVER)
        except RuntimeError as exc:
            self.log(f"shmtrain smb-server: client {client - 1}'s connection {n} did not complete "
                     f"({first_line(exc)})")
            return
        self.inbox.put(("joined", client, n, (link, world)))
