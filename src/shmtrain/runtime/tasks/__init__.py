"""What a run learns: loss and metrics over batches of any structure, one class per task.

``classification`` (the default), ``regression`` and ``language-model`` are registered
here; ``--task module:callable`` names one's own, a Task or a plain loss function
(``lookup.py``, ``loss_function.py``; docs/tasks.md).
"""

from shmtrain.runtime.tasks import (
    classification,  # noqa: F401  (registers)
    language_model,  # noqa: F401  (registers)
    regression,  # noqa: F401  (registers)
)
from shmtrain.runtime.tasks.base import Task, TaskConfig, register, registry
from shmtrain.runtime.tasks.lookup import build_task, task_of

__all__ = ["Task", "TaskConfig", "build_task", "register", "registry", "task_of"]
