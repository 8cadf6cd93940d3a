"""A regression for ``shmtrain train --task regression``: scikit-learn's diabetes data set
(442 patients, 10 features, a disease-progression score; it ships with scikit-learn,
nothing is downloaded). Run from the repository's root::

    shmtrain train --task regression --data examples.regression:diabetes \\
        --model examples.regression:Net --workers 2 --batch-size 16 --epochs 20

The features and the target are standardised (mean 0, standard deviation 1), so the
held-out ``rmse`` is in standard deviations of the score: 1.0 is what predicting the mean
gets. Items are ``(x, y)`` with a scalar ``y``; the model's one output is compared with it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def diabetes() -> TensorDataset:
    """``(x, y)`` items: 10 standardised features, the standardised score."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)
    return TensorDataset((x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std())


class Net(nn.Module):
    """An MLP from the features to ``num_classes`` outputs (the target's size: 1)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
