"""The two strategies that communicate nothing: ``nocomm`` (every worker alone on its
shard, the floor the step benchmark compares every strategy against) and ``single`` (one
process: the reference every synchronous strategy must equal).

This module is also the template for a new strategy (docs/strategies.md). A strategy is
one module of ``strategies/``, listed in ``strategies/__init__.py``, holding one class:

- ``name`` (what ``--strategy`` takes) and ``@register``, which refuses a duplicate name;
- ``Config``: a ``@dataclass(kw_only=True, slots=True)`` subclass of
  :class:`~shmtrain.strategies.base.StrategyConfig` whose fields are the strategy's own
  options (``shmtrain train`` makes a flag of each; validate in ``__post_init__`` with a
  ``ValueError`` naming the option, the value, the rule and the fix). ``NoComm`` has none;
- the hooks it needs, of ``zero_grad -> before_forward -> forward -> backward
  (on_gradient_ready per parameter) -> after_backward -> apply_update -> after_update``,
  then ``finish``; the base class does a plain optimizer step, so ``NoComm`` overrides none;
- every exchange from ``self.transports`` (:class:`~shmtrain.fabric.transports.Transports`:
  ``allreduce``, ``bucket_reducer``, ``buffer_service``, ``star``, ``subgroup``, ...),
  and the host's services too (``segment``, ``channel``, ``control``, ``barrier``): never
  a fabric object built by the strategy, never ``ctx.host`` (``tests/strategies/test_seams.py``
  checks both), so it runs on in-process peers through a fake ``Transports`` in a test
  (``tests/strategies/test_fake_transports.py``);
- ``state_dict``/``load_state_dict`` for what it adds to the model's and optimizer's
  state (counters, buffers it owns), so checkpoints and resume are exact;
- class attributes that tell the runtime what it allows (``world``, ``devices``,
  ``synchronous``, ``tolerates_peer_loss``, ``optimizers``, ...: see
  :class:`~shmtrain.strategies.base.Strategy`).
"""

from __future__ import annotations

from shmtrain.strategies.base import Strategy, register


@register
class NoComm(Strategy):
    """No communication at all: every worker trains alone on its shard (the floor that
    the step benchmark compares every strategy against)."""

    name = "nocomm"


@register
class Single(NoComm):
    """One process, plain SGD: the reference every synchronous strategy must equal."""

    name = "single"
    world = "one"
