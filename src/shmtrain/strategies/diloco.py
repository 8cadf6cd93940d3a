"""DiLoCo: H inner steps on each worker, then an outer Nesterov step on the averaged
pseudo-gradient (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training
of Language Models", Algorithm 1), with Streaming DiLoCo's fragments and low-precision
outer gradients (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication").

Algorithm 1, per worker i, from the same θ^(0) everywhere::

    θ_i ← θ^(t-1)
    for H inner steps:  θ_i ← InnerOpt(θ_i, ∇L(x_i; θ_i))        (the run's optimizer)
    Δ_i = θ^(t-1) − θ_i                                            (the pseudo-gradient)
    Δ = (1/k) Σ_i Δ_i                                              (averaged over k workers)
    θ^(t) ← OuterOpt(θ^(t-1), Δ)                                   (SGD, Nesterov momentum)

and every worker copies θ^(t) into its model. The average goes through the allreduce the
fabric gives ssgd (``Transports.allreduce("shm")``): the workers of a host sum in shared
memory, and only the hosts' leaders send bytes over the link. ``outer_dtype="bf16"``
casts Δ_i to bfloat16 for the exchange (Streaming DiLoCo's quantised outer gradients), halving its bytes;
θ^(t), the outer momentum and the model stay float32.

Streaming DiLoCo (``fragments`` F > 1): the flat parameter vector is cut into F
contiguous pieces of equal size, and fragment f runs the four lines above at the
iterations n with n mod H = f·H/F (n counts finished inner steps), so the bytes of one
outer step are spread over H/F-step intervals instead of arriving at once. With
``overlap_steps`` τ ≥ 1 a fragment's exchange runs on a helper thread while the next τ
inner steps go on (Streaming DiLoCo's overlapping communication), and is applied after step n + τ:
θ^(t) ← OuterOpt(θ^(t-1), Δ) with the Δ of step n, then θ_i ← α θ_i + (1 − α) θ^(t)
(``mixing`` α; 0 takes θ^(t) as it is, which with τ = 0 is Algorithm 1).

``inner="host-sync"`` is the hybrid (:class:`HostSyncDiLoCo`): the gradients are
averaged every step inside each host through shared memory (ssgd's slots), so a host
trains as one synchronous worker with L times the batch, and the outer step runs
between hosts: ShmCaffe's HSGD layout (Section III-D) with DiLoCo in place of SEASGD.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from shmtrain.fabric.compress.codec import parse_compress
from shmtrain.fabric.exchanges.weights import broadcast_parameters
from shmtrain.fabric.shm.control import PeerTimeout
from shmtrain.strategies.base import Strategy, StrategyConfig, register
from shmtrain.strategies.layout.flat import FlatLayout
from shmtrain.strategies.parts import SlotGradients

#: the dtypes of the pseudo-gradient exchange
OUTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _positive_int(flag: str, value: Any, what: str, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{flag} {value!r} must be an integer >= 1: {what}; pass e.g. {flag} {example}")


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """The F contiguous, nearly equal element ranges of a flat vector of ``numel``
    (Streaming DiLoCo's fragments; any partition gives the same equations per element)."""
    if fragments > numel:
        raise ValueError(f"--fragments {fragments}: the model has only {numel} parameters; "
                         f"use at most --fragments {numel}")
    cuts = [numel * f // fragments for f in range(fragments + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


#: the outer step (lr, Nesterov momentum) under an inner SGD with momentum, measured on the
#: main job's task (docs/diloco.md): DiLoCo's (0.7, 0.9) stacked on the inner momentum overshoots
OUTER_UNDER_MOMENTUM = (1.0, 0.5)
#: DiLoCo's published outer step (tuned there with an AdamW inner optimizer)
OUTER_DILOCO = (0.7, 0.9)


def outer_defaults(optimizer: torch.optim.Optimizer | None) -> tuple[float, float]:
    """The outer (lr, momentum) when ``--outer-lr`` / ``--outer-momentum`` are not given:
    :data:`OUTER_UNDER_MOMENTUM` when the inner optimizer is SGD with momentum (the inner
    momentum already carries the steps along; the outer Nesterov momentum 0.9 on top made
    the run diverge), else DiLoCo's :data:`OUTER_DILOCO` (SGD without momentum: measured
    within a point of ssgd; AdamW: the paper's setting)."""
    momentum = max((g.get("momentum", 0) for g in optimizer.param_groups), default=0) if optimizer else 0
    return outer_defaults_for(type(optimizer), momentum)


def outer_defaults_for(optimizer_class: type, momentum: float) -> tuple[float, float]:
    """:func:`outer_defaults` of an optimizer of ``optimizer_class`` with ``momentum``, before it is built."""
    if issubclass(optimizer_class, torch.optim.SGD) and momentum > 0:
        return OUTER_UNDER_MOMENTUM
    return OUTER_DILOCO


def _outer_default_text(index: int) -> Callable[[type, dict], str]:
    """What ``config.toml`` says of ``--outer-lr`` (index 0) or ``--outer-momentum`` (1) when
    it is not given: the value derived from the run's optimizer (its class and keywords)."""

    def text(optimizer_class: type, kwargs: dict) -> str:
        momentum = kwargs.get("momentum", 0)
        value = outer_defaults_for(optimizer_class, momentum)[index]
        inner = f"{optimizer_class.__name__}" + (f" with momentum {momentum}" if momentum else "")
        return f"{value}, derived from the inner optimizer ({inner}; docs/diloco.md)"

    return text


class Flight:
    """One fragment's exchange on a helper thread while the inner steps go on (its waits
    sleep in futexes and gloo, which release the GIL); ``wait`` hands back the mean, a
    float32 copy on the CPU (the slots are reused by the next exchange)."""

    def __init__(self, fragment: int, apply_at: int, exchange: Any = None, *,
                 mean: torch.Tensor | None = None) -> None:
        self.fragment, self.apply_at, self.mean = fragment, apply_at, mean
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if exchange is not None:
            self.thread = threading.Thread(target=self._run, args=(exchange,), name="diloco-exchange",
                                           daemon=True)
            self.thread.start()

    def _run(self, exchange: Any) -> None:
        try:
            self.mean = exchange().to(torch.float32, copy=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the training thread
            self.error = exc

    def wait(self, timeout: float) -> torch.Tensor:
        """The averaged Δ of this fragment (re-raises the exchange's failure)."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise PeerTimeout(f"the outer exchange of fragment {self.fragment} did not finish within "
                                  f"{timeout:.0f} s")
            self.thread = None
        if self.error is not None:
            raise self.error
        assert self.mean is not None
        return self.mean


@register
class DiLoCo(Strategy):
    """Inner steps with the run's optimizer, an outer Nesterov step every ``sync_every``
    (DiLoCo Algorithm 1; Streaming DiLoCo's fragments and bf16 outer gradients)."""

    name = "diloco"

    @dataclass(kw_only=True, slots=True)
    class Config(StrategyConfig):
        #: inner steps H between outer steps (DiLoCo Algorithm 1; the paper uses 500)
        sync_every: int = field(default=20, metadata={
            "help": "inner steps H between outer steps (DiLoCo Algorithm 1; the paper uses 500)",
            "default_text": "20; --inner host-sync across hosts, uncompressed, 10 (docs/choosing_a_method.md)"})
        #: the outer SGD's learning rate; None: derived from the inner optimizer (outer_defaults)
        outer_lr: float | None = field(default=None, metadata={
            "default_text": _outer_default_text(0),
            "help": "learning rate of the outer SGD step on the averaged pseudo-gradient (not given: 1.0 "
                    "under an inner SGD with momentum, else DiLoCo's 0.7; docs/diloco.md)"})
        #: the outer SGD's Nesterov momentum; 0 = plain SGD; None: derived (outer_defaults)
        outer_momentum: float | None = field(default=None, metadata={
            "default_text": _outer_default_text(1),
            "help": "Nesterov momentum of the outer step in [0, 1); 0 = plain SGD (not given: 0.5 under "
                    "an inner SGD with momentum, else DiLoCo's 0.9; docs/diloco.md)"})
        #: the dtype of the pseudo-gradient exchange (bf16: half the bytes)
        outer_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata={
            "help": "dtype of the pseudo-gradient exchange: fp32, or bf16 (half the bytes between hosts; "
                    "the outer state stays float32; Streaming DiLoCo)"})
        #: Streaming DiLoCo: F fragments, fragment f synchronised at offset f*H/F
        fragments: int = field(default=1, metadata={
            "help": "Streaming DiLoCo: F fragments of the parameters, fragment f synchronised at "
                    "offset f*H/F (must divide --sync-every; 1 = plain DiLoCo)"})
        #: Streaming DiLoCo's overlap τ: a fragment's exchange runs during the next τ inner steps
        overlap_steps: int = field(default=0, metadata={
            "help": "Streaming DiLoCo: run a fragment's exchange on a helper thread during the next N inner "
                    "steps and apply it after them (0 = wait for it; N < sync-every / fragments)"})
        #: Streaming DiLoCo's mixing factor α: θ_i ← α θ_i + (1 − α) θ^(t) after an outer step
        mixing: float = field(default=0.0, metadata={
            "help": "after an outer step, keep this share of the worker's own weights: θ_i ← α θ_i + "
                    "(1 − α) θ_global, α in [0, 1) (0 = DiLoCo; e.g. 0.5 with overlap)"})
        #: the compressed exchange: top-k of every chunk, B-bit values, error feedback
        compress: str = field(default="", metadata={
            "help": "compress what crosses the link (diloco: the pseudo-gradient; seasgd, hsgd, easgd: "
                    "the difference to W_g each way): topk:F,bits:B (the kept share F of "
                    "every 4096-element chunk, values of B = 2, 4, 8 or 32 bits) with error feedback "
                    "in the checkpoint, e.g. topk:0.01,bits:4 (SparseLoCo); empty = the exact exchange"})
        #: what a worker does between outer steps: train alone ("local"), or average
        #: gradients every step with its host through shared memory ("host-sync", the hybrid)
        inner: Literal["local", "host-sync"] = field(default="local", metadata={
            "help": "inner steps: local (each worker alone, DiLoCo), or host-sync (gradients averaged every "
                    "step inside a host through shared memory, DiLoCo between hosts: the hybrid)"})

        def __post_init__(self) -> None:
            _positive_int("--sync-every", self.sync_every, "the inner steps between outer steps", "50")
            _positive_int("--fragments", self.fragments, "the pieces synchronised in turn", "1")
            if self.sync_every % self.fragments:
                raise ValueError(
                    f"--fragments {self.fragments} must divide --sync-every {self.sync_every}: fragment f "
                    f"is synchronised at offset f*H/F; choose e.g. --fragments 1 or a divisor of "
                    f"{self.sync_every}")
            if self.outer_lr is not None and not (isinstance(self.outer_lr, int | float) and self.outer_lr > 0):
                raise ValueError(f"--outer-lr {self.outer_lr!r} must be positive: it scales the outer step "
                                 "on the averaged pseudo-gradient; pass e.g. --outer-lr 0.7 (DiLoCo)")
            if self.outer_momentum is not None and not (
                    isinstance(self.outer_momentum, int | float) and 0 <= self.outer_momentum < 1):
                raise ValueError(f"--outer-momentum {self.outer_momentum!r} must lie in [0, 1): the "
                                 "outer Nesterov momentum; pass e.g. --outer-momentum 0.9 (DiLoCo), or 0")
            if not isinstance(self.overlap_steps, int) or isinstance(self.overlap_steps, bool) \
                    or not 0 <= self.overlap_steps < self.sync_every // self.fragments:
                raise ValueError(
                    f"--overlap-steps {self.overlap_steps!r} must be an integer in [0, --sync-every / "
                    f"--fragments = {self.sync_every // self.fragments}): one fragment's exchange is in "
                    "flight at a time; pass e.g. --overlap-steps 1 with --fragments 2 --sync-every 4, or 0")
            if not (isinstance(self.mixing, int | float) and 0 <= self.mixing < 1):
                raise ValueError(f"--mixing {self.mixing!r} must lie in [0, 1): the share of a worker's "
                                 "own weights kept after an outer step; pass e.g. --mixing 0.5, or 0")
            if self.outer_dtype not in OUTER_DTYPES:
                raise ValueError(f"--outer-dtype {self.outer_dtype!r} is unknown; choose fp32 or bf16")
            if parse_compress(self.compress) is not None and self.outer_dtype != "fp32":
                raise ValueError(f"--outer-dtype {self.outer_dtype} with --compress {self.compress}: both set "
                                 "how the pseudo-gradient travels (--compress quantises its values with "
                                 "bits:B); drop --outer-dtype, or --compress")
            if self.inner not in ("local", "host-sync"):
                raise ValueError(f"--inner {self.inner!r} is unknown; choose local (DiLoCo) or "
                                 "host-sync (the hybrid)")

    @classmethod
    def choose(cls, config: StrategyConfig) -> tuple[type[Strategy], str]:
        """:class:`HostSyncDiLoCo` for ``inner="host-sync"``, else DiLoCo itself."""
        if getattr(config, "inner", "local") == "host-sync":
            return HostSyncDiLoCo, "--inner host-sync"
        return cls, f"--strategy {cls.name}"

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        self.layout = FlatLayout(self.params)
        broadcast_parameters(self.layout)
        #: θ_i, the worker's weights: the parameters are views of it
        self.local = torch.empty(self.layout.numel, dtype=self.layout.dtype, device=self.device)
        self.layout.bind_data(self.local)
        self.bounds = fragment_bounds(self.layout.numel, config.fragments)
        #: θ^(t), one tensor per fragment, the same on every worker
        self.global_fragments = [self.local[lo:hi].clone() for lo, hi in self.bounds]
        lr, momentum = outer_defaults(optimizer)
        #: the outer step's learning rate and Nesterov momentum: given, or derived from the inner optimizer
        self.outer_lr = lr if config.outer_lr is None else config.outer_lr
        self.outer_momentum = momentum if config.outer_momentum is None else config.outer_momentum
        self.outer_optimizer = torch.optim.SGD(
            [{"params": [g]} for g in self.global_fragments], lr=self.outer_lr,
            momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
        dtype = OUTER_DTYPES[config.outer_dtype]
        #: ``--compress``: None for the exact exchange
        self.compress = parse_compress(config.compress)
        #: one exchange per fragment, so each carries only its fragment's bytes
        self.exchanges = [
            self.transports.allreduce("shm", hi - lo, dtype, op="mean", tag=f"diloco.f{f}")
            if self.compress is None else
            self.transports.compressed_allreduce(hi - lo, self.compress, tag=f"diloco.f{f}")
            for f, (lo, hi) in enumerate(self.bounds)
        ]
        self.outer_steps = 0
        #: the exchange in flight (``overlap_steps`` > 0), applied after its step
        self.pending: Flight | None = None
        self.wait_timeout = float(getattr(ctx, "timeout", 120.0)) + 30.0

    def fragments_due(self, done: int) -> list[int]:
        """The fragments synchronised after ``done`` inner steps (n mod H = f·H/F)."""
        period, count = self.config.sync_every, self.config.fragments
        return [f for f in range(count) if done % period == f * period // count]

    def after_update(self) -> None:
        done = self.iteration + 1
        if self.pending is not None and self.pending.apply_at == done:
            flight, self.pending = self.pending, None
            with self.timer.phase("comm"):  # what the helper thread did not hide
                mean = flight.wait(self.wait_timeout)
            self.apply(flight.fragment, mean)
        for f in self.fragments_due(done):
            self.begin(f, done)
        super().after_update()

    def begin(self, f: int, done: int) -> None:
        """Algorithm 1's exchange for fragment ``f``: Δ_i = θ^(t-1) − θ_i into the
        exchange's slot (cast to its dtype), averaged over every worker; applied at once,
        or ``overlap_steps`` later from a helper thread."""
        lo, hi = self.bounds[f]
        local, global_ = self.local[lo:hi], self.global_fragments[f]
        exchange = self.exchanges[f]
        slot = exchange.input()
        with torch.no_grad():
            if self.staged:  # a GPU: the difference is taken there, and crosses once
                with self.timer.phase("copy_to_host"):
                    slot.copy_(global_ - local)
            elif slot.dtype == global_.dtype:
                torch.sub(global_, local, out=slot)
            else:
                slot.copy_(global_ - local)
        tau = self.config.overlap_steps
        if tau:
            self.pending = Flight(f, done + tau, exchange)
            return
        with self.timer.phase("comm"):
            mean = exchange()
        self.apply(f, mean)

    def apply(self, f: int, mean: torch.Tensor) -> None:
        """θ^(t) ← OuterOpt(θ^(t-1), Δ) (SGD, Nesterov momentum), then θ_i ← α θ_i +
        (1 − α) θ^(t) for fragment ``f`` (α = ``mixing``; 0: θ_i ← θ^(t))."""
        lo, hi = self.bounds[f]
        local, global_ = self.local[lo:hi], self.global_fragments[f]
        alpha = self.config.mixing
        with torch.no_grad():
            with self.timer.phase("copy_to_device" if self.staged else "outer_update"):
                global_.grad = mean.to(device=global_.device, dtype=global_.dtype, copy=True)
            with self.timer.phase("outer_update"):
                self.outer_optimizer.step()
                global_.grad = None
                if alpha:
                    local.mul_(alpha).add_(global_, alpha=1 - alpha)
                else:
                    local.copy_(global_)
        self.outer_steps += 1

    # -- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The iteration (the schedule position: which fragment is due when), θ^(t) and
        the outer momentum; every worker holds the same and saves its own. With
        ``--compress`` also each fragment's error feedback (its host leader's)."""
        pending = self.pending
        state = {"iteration": self.iteration, "outer_steps": self.outer_steps,
                 "global_weights": list(self.global_fragments),
                 "outer_optimizer": self.outer_optimizer.state_dict(),
                 "pending": None if pending is None else {
                     "fragment": pending.fragment, "apply_at": pending.apply_at,
                     "mean": pending.wait(self.wait_timeout)}}
        if self.compress is not None:  # after the wait: the exchange in flight has fed its error back
            state["compress"] = [exchange.state_dict() for exchange in self.exchanges]
        return state

    def quiesce(self) -> None:
        """Let the exchange in flight finish (its mean is applied at its step, after a
        resume too: it is part of the state)."""
        if self.pending is not None:
            self.pending.wait(self.wait_timeout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["global_weights"]
        if [t.numel() for t in saved] != [t.numel() for t in self.global_fragments]:
            raise ValueError(
                f"the checkpoint's global weights come in fragments of {[t.numel() for t in saved]} "
                f"elements, this run's in {[t.numel() for t in self.global_fragments]}: resume with "
                "the --fragments and the model the checkpoint was written with")
        with torch.no_grad():
            for mine, theirs in zip(self.global_fragments, saved, strict=True):
                mine.copy_(theirs)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._load_compress(state.get("compress"))
        self.outer_steps = int(state.get("outer_steps", 0))
        pending = state.get("pending")
        self.pending = None if pending is None else Flight(
            int(pending["fragment"]), int(pending["apply_at"]), mean=pending["mean"])

    def _load_compress(self, saved: list[dict[str, Any]] | None) -> None:
        if (saved is None) != (self.compress is None):
            raise ValueError(
                f"the checkpoint was written {'without' if saved is None else 'with'} --compress, this run "
                f"{'has --compress ' + self.compress.text() if self.compress else 'has none'}: resume with "
                "the --compress the checkpoint was written with (its error feedback is part of the state)")
        if saved is None:
            return
        if len(saved) != len(self.exchanges):
            raise ValueError(f"the checkpoint's error feedback comes in {len(saved)} fragments, this run's in "
                             f"{len(self.exchanges)}: resume with the --fragments the checkpoint was written with")
        for exchange, state in zip(self.exchanges, saved, strict=True):
            exchange.load_state_dict(state)

    def global_weights_now(self) -> torch.Tensor | None:
        """θ^(t), the outer model (the same on every worker; a worker's own weights have
        moved on since the last outer step), flat in ``layout`` order, on the CPU."""
        with torch.no_grad():
            return torch.cat([g.detach().to("cpu", self.layout.dtype) for g in self.global_fragments])

    def finish(self) -> None:
        """Wait for an exchange still in flight (its step never came: it is dropped), keep
        θ^(t) as the job's model on rank 0 (``model.pt``), then release the exchanges."""
        if self.pending is not None and self.pending.thread is not None:
            self.pending.wait(self.wait_timeout)
        if getattr(self.ctx, "rank", 0) == 0:
            self.final_global_weights = self.global_weights_now()
        for exchange in self.exchanges:
            exchange.close()
        self.exchanges = []
        super().finish()


class HostSyncDiLoCo(SlotGradients, DiLoCo):
    """The hybrid, ``diloco --inner host-sync``: the inner steps are synchronous SGD inside
    each host (gradients averaged in the host's shared memory, ssgd's zero-copy slots),
    the outer step DiLoCo's between hosts (Algorithm 1 with one "worker" per host)."""

    #: a worker killed on one host is replaced in place: the host's workers are replicas (the
    #: same inner update from the host's mean gradient, the same outer step), as under ssgd
    recovery = "replica"

    def __init__(self, config, ctx, model, optimizer, timer=None, *, transports=None) -> None:
        super().__init__(config, ctx, model, optimizer, timer, transports=transports)
        #: the host's gradient allreduce (SlotGradients' ``allreduce``)
        self.allreduce = self.transports.host_allreduce(
            self.layout.numel, self.layout.dtype, op="mean", tag="diloco.host")
        self.bind_slots()

    def finish(self) -> None:
        self.allreduce.close()
        super().finish()
