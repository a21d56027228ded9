"""A model class the outer loop was not built for, as a stranger would bring one: a small
CNN with two BatchNorm2d (running statistics and an integer ``num_batches_tracked``), a
LayerNorm, one block applied twice, a pair of tied Linear layers, and a frozen random
projection drawn from whatever seed the process has. Its task: which quarter of an 8x8
image holds a brighter band (four classes), with noise, so the loss falls over rounds
without reaching zero.

Import as ``tests.training.stranger``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

CLASSES = 4


class StrangerNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.norm = nn.LayerNorm(width * 4)
        self.block = nn.Linear(width * 4, width * 4)  # applied twice
        self.up = nn.Linear(width * 4, width * 4)
        self.down = nn.Linear(width * 4, width * 4)
        self.down.weight = self.up.weight  # tied: one tensor, two names
        self.proj = nn.Linear(width * 4, 16, bias=False)
        self.proj.weight.requires_grad_(False)  # a frozen random projection
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)
        x = self.norm(x)
        for _ in range(2):
            x = x + torch.tanh(self.block(x))
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(self.proj(x))


def images(seed: int, n: int, noise: float = 1.2) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy 8x8 images and their classes (float32 images, int64 labels)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, size=n)
    x = rng.normal(0.0, noise, size=(n, 1, 8, 8)).astype(np.float32)
    for c in range(CLASSES):
        x[labels == c, 0, 2 * c : 2 * c + 2, :] += 1.0
    return torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def eval_loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The held-out loss in eval mode (the running statistics), without changing the
    model's mode for its caller."""
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = float(loss_fn(model, data))
    model.train(was)
    return loss


def state_lists(model: nn.Module) -> dict[str, Any]:
    """The whole ``state_dict()`` as JSON-able lists (every name, aliases included)."""
    return {n: t.detach().cpu().numpy().tolist() for n, t in model.state_dict().items()}
