"""A Lightning strategy that trains with any shmtrain method: ``DDPStrategy`` with
:class:`shmtrain.DataParallel` where DDP's wrapper was.

Everything Lightning's DDP strategy does around the model stays its own: the launchers
(its subprocess launcher or torchrun, both tested; ``spawn``/``fork`` untested), the default process group
(``process_group_backend``: gloo unless given, ``"shm"`` too), the distributed sampler,
``self.log(..., sync_dist=True)``, barriers and broadcasts. What changes is the model's
wrapper: ``setup`` builds the optimizer first and hands model and optimizer to
``DataParallel(module, optimizer, method, **options)``, so a synchronous method (ssgd and
its variants, gpi, cpu_acc, ps_grad) averages the gradients in backward and Lightning's
clip, hooks and ``optimizer.step`` see the job's mean exactly as under DDP, and an
asynchronous one (seasgd, easgd, downpour, hsgd, diloco, ps_weight) runs its exchange and
update in ``optimizer.step``. Lightning's closure (training step, zero_grad, backward) is
run first and the DataParallel's step after it (:meth:`ShmtrainStrategy.optimizer_step`).

The options are the method's typed ``Config`` fields, those of ``shmtrain train
--strategy METHOD`` (``update_interval=4``, ``compress="topk:0.01"``, ...), validated when
the strategy is made, with the CLI's messages. Checkpoints hold the method's state
(``iteration``, W_g, ...) under ``"shmtrain"``, and the asynchronous methods' other ranks
their own state beside the file (:mod:`shmtrain.lightning.shards`); shmtrain's per-phase
times reach Lightning's loggers as ``shmtrain/<phase>`` (:mod:`shmtrain.lightning.phases`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from shmtrain import strategies
from shmtrain.lightning.phases import PhaseLog
from shmtrain.lightning.shards import load_shard, remove_shard, save_shard
from shmtrain.parallel.data_parallel import DataParallel, make_config
from shmtrain.timing import PhaseTimer

#: the key of a checkpoint that holds shmtrain's state
KEY = "shmtrain"


class ShmtrainStrategy(DDPStrategy):
    """Train a LightningModule with shmtrain method ``method`` (module docstring).

    Args:
        method: a shmtrain strategy name (``ssgd``, ``seasgd``, ``easgd``, ``downpour``,
            ``hsgd``, ``diloco``, ``gpi``, ``cpu_acc``, ``ps_grad``, ``ps_weight``).
        grad_clip: clip the global gradient norm inside the method's step
            (DataParallel's ``grad_clip``; Lightning's ``gradient_clip_val`` works too
            for the synchronous methods, on the averaged gradients).
        process_group_backend: the default process group's backend (``"gloo"``; or
            ``"shm"``), which Lightning's logging, barriers and broadcasts use.
        timeout: the default process group's timeout.
        start_method: Lightning's ``"popen"`` (its subprocess launcher), ``"spawn"``,
            ``"fork"``.
        **options: the method's options, as the keywords of ``shmtrain train
            --strategy METHOD`` (e.g. ``update_interval=4``).
    """

    strategy_name = "shmtrain"

    def __init__(
        self,
        method: str = "ssgd",
        *,
        grad_clip: float | None = None,
        process_group_backend: str | None = "gloo",
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **options: Any,
    ) -> None:
        strategies.get(method)  # an unknown name, or an option it does not take, fails here
        self.method = method
        self.config = make_config(method, options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.grad_clip = grad_clip
        self.timer = PhaseTimer()
        self.phases = PhaseLog(self.timer)
        self.data_parallel: DataParallel | None = None
        self._checkpoint_path: str | None = None
        #: after ``fit``, on the rank that held it: the module's state with the job's global
        #: weights W_g (the asynchronous methods; ``DataParallel.global_state_dict``)
        self.global_state: dict[str, torch.Tensor] | None = None
        #: after ``fit``: the iterations the method ran (restored with a checkpoint)
        self.iteration = 0

    # -- set-up ---------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.check_precision()
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers: "
                                 f"ShmtrainStrategy({self.method!r}) steps one (each worker's own, wrapped by "
                                 "shmtrain.DataParallel); return one optimizer, or use DDPStrategy")
            self._publish_env()
            self.data_parallel = DataParallel(self.model, self.optimizers[0], self.method, config=self.config,
                                              timer=self.timer, grad_clip=self.grad_clip)
            steps = trainer.estimated_stepping_batches
            if isinstance(steps, int) or (isinstance(steps, float) and steps != float("inf")):
                self.data_parallel.target_iterations = int(steps)  # TERM aligns the ends around it
            self.model = self.data_parallel
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def check_precision(self) -> None:
        """Refuse a precision plugin that steps through a GradScaler (the method steps the optimizer)."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"precision={self.precision_plugin.precision!r} steps through a GradScaler, which "
                             f"ShmtrainStrategy({self.method!r}) cannot: use precision='32-true' or 'bf16-mixed'")

    def _publish_env(self) -> None:
        """Lightning's facts about this rank, where shmtrain's context reads them (the same
        variables torchrun sets; Lightning's own launcher sets only some)."""
        os.environ.update(RANK=str(self.global_rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(self.local_rank), LOCAL_WORLD_SIZE=str(self.num_processes),
                          GROUP_RANK=str(self.node_rank))
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        if timeout is not None and "SHMTRAIN_TIMEOUT" not in os.environ:
            os.environ["SHMTRAIN_TIMEOUT"] = str(min(timeout, 600.0))

    def configure_ddp(self) -> None:  # the wrapper is DataParallel, made in setup
        pass

    # -- the step ---------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.timer.phase("forward"):
            return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # a synchronous method's exchange runs at the end of backward (its comm phase inside this one)
        with self.timer.phase("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's closure (training step, zero_grad, backward, its clip and hooks), then
        the method's step: DataParallel's ``optimizer.step()`` takes no closure."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        step = inner.step  # DataParallel's

        def closure_then_step(closure: Callable[[], Any] | None = None, **_: Any) -> Any:
            loss = closure() if closure is not None else None
            step()
            return loss

        inner.step = closure_then_step
        try:
            out = pl.strategies.Strategy.optimizer_step(self, optimizer, closure, model, **kwargs)
        finally:
            inner.step = step
        trainer = self.lightning_module.trainer
        self.phases.close_iteration(trainer)
        if self.data_parallel is not None and self.data_parallel.should_stop():
            trainer.should_stop = True
        return out

    # validation, test and prediction call the module itself: no method's work before them
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # -- checkpoints ------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # after DataParallel took rank 0's weights: each rank then loads its own
        return True

    def _ranks_apart(self) -> bool:
        """Whether the ranks' weights and optimizers differ (the asynchronous methods)."""
        dp = self.data_parallel
        return dp is not None and not type(dp.strategy).synchronous and self.world_size > 1

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.data_parallel is not None:
            self.data_parallel.strategy.quiesce()  # the exchanges in flight are drained first
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        dp = self.data_parallel
        if dp is not None:
            state = dp.strategy.state_dict()
            if self._ranks_apart() and self.global_rank > 0:
                save_shard(filepath, self.global_rank, {"model": checkpoint["state_dict"],
                                                        "optimizer": checkpoint["optimizer_states"],
                                                        "strategy": state})
            checkpoint[KEY] = {"method": self.method, "world": self.world_size, "ranks_apart": self._ranks_apart(),
                               "strategy": state}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.global_rank > 0:
            remove_shard(filepath, self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._checkpoint_path = os.fspath(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _saved(self, checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
        saved = checkpoint.get(KEY)
        if saved is None or self.data_parallel is None:
            return None
        if saved["method"] != self.method or saved["world"] != self.world_size:
            raise ValueError(f"the checkpoint {self._checkpoint_path} was written by ShmtrainStrategy"
                             f"({saved['method']!r}) with {saved['world']} workers; this run is "
                             f"{self.method!r} with {self.world_size}: resume with the same method and workers")
        if saved["ranks_apart"] and self.global_rank > 0:
            assert self._checkpoint_path is not None
            return load_shard(self._checkpoint_path, self.global_rank)
        return None

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        shard = self._saved(checkpoint)
        with torch.no_grad():
            super().load_model_state_dict(checkpoint if shard is None else {"state_dict": shard["model"]},
                                          strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        shard = self._saved(checkpoint)
        super().load_optimizer_state_dict(checkpoint if shard is None else {"optimizer_states": shard["optimizer"]})
        saved = checkpoint.get(KEY)
        if saved is not None and self.data_parallel is not None:
            # collective: every rank (the shared weights' owner writes them, then a barrier)
            self.data_parallel.strategy.load_state_dict(saved["strategy"] if shard is None else shard["strategy"])

    # -- the end ----------------------------------------------------------------------
    def teardown(self) -> None:
        dp = self.data_parallel
        if dp is not None:
            self.data_parallel = None
            self.model = self.lightning_module
            self.iteration = dp.iteration
            dp.close()
            self.global_state = dp.global_state_dict()
        super().teardown()
