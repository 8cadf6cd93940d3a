"""What a run learns: loss and metrics over batches of any structure, one class per task.

``classification`` (the default), ``regression`` and ``language-model`` are registered
here; ``--task module:callable`` names one's own (docs/tasks.md).
"""

from shmtrain.runtime.tasks import (
    classification,  # noqa: F401  (registers)
    language_model,  # noqa: F401  (registers)
    regression,  # noqa: F401  (registers)
)
from shmtrain.runtime.tasks.base import Task, TaskConfig, build_task, register, registry, task_of

__all__ = ["Task", "TaskConfig", "build_task", "register", "registry", "task_of"]
