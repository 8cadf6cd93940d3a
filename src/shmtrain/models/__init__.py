"""The model registry: small built-ins and torchvision's classic networks."""

from shmtrain.models import realign  # noqa: F401  (registers folded_mlp)
from shmtrain.models.registry import build_model, model_names, register_model

__all__ = ["build_model", "model_names", "register_model"]
