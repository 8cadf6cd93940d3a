"""The ``--task`` and ``--task-args`` options of :class:`shmtrain.runtime.config.TrainConfig`
(section ``model and data``), settled into the task's typed Config (``task_config``)."""

from __future__ import annotations

from dataclasses import dataclass

from shmtrain.models.user import is_user_spec
from shmtrain.runtime.options import option
from shmtrain.runtime.tasks import registry
from shmtrain.runtime.tasks.base import Task
from shmtrain.runtime.tasks.lookup import build_config, build_task


def task_names() -> list[str]:
    return sorted(registry())


@dataclass(kw_only=True)
class TaskOptions:
    """What the run learns (a mixin of :class:`~shmtrain.runtime.config.TrainConfig`, see
    its ``JobOptions``)."""

    __slots__ = ()

    task: str = option("classification", "what the run learns, its loss and held-out metrics (docs/tasks.md): "
                       "a built-in task, or module:callable, your own Task or loss function (model, batch) -> loss",
                       "data", names=task_names)
    task_args: str = option("", "options of --task, as k=v separated by ';' (Python literals), e.g. "
                            "--task-args 'label_smoothing=0.1'", "data", metavar="K=V;...")

    def _check_task(self, data: str) -> Task:
        """The task (its typed Config is ``task.config``); a task that reads only ``module:callable`` data with
        another ``--data`` is refused, naming the fix."""
        config = build_config(self.task, self.task_args)
        task: Task = build_task(self.task, self.task_args, config, data)
        if not task.takes_builtin_data and not is_user_spec(data):
            raise ValueError(f"--task {self.task} with --data {data}: the built-in data kinds (digits, synthetic, "
                             "a folder of images) hold (image, class) items for --task classification; give "
                             "--data module:callable returning your Dataset (docs/tasks.md)")
        return task
