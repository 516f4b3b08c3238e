"""Small classifiers for MNIST-1D (40-sample signals, 10 classes): an MLP and a 1-D CNN."""
from __future__ import annotations

from typing import Sequence

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_straggler.metrics import horovod_sync_kwargs


def build_network(name: str, in_features: int, classes: int, hidden: Sequence[int]) -> nn.Module:
    if name == "mlp":
        layers, width = [], in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, classes))
    if name == "cnn":
        channels = list(hidden) or [32]
        layers, c_in = [], 1
        for c in channels:
            layers += [nn.Conv1d(c_in, c, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2)]
            c_in = c
        return nn.Sequential(nn.Unflatten(1, (1, in_features)), *layers, nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                             nn.Linear(c_in, classes))
    raise ValueError(f"model name must be one of mlp, cnn (got {name!r})")


class Classifier(pl.LightningModule):
    """A plain LightningModule: nothing in it knows about Horovod or stragglers."""

    def __init__(self, name: str = "mlp", in_features: int = 40, classes: int = 10,
                 hidden: Sequence[int] = (256, 256), optimizer: str = "sgd", lr: float = 0.05,
                 momentum: float = 0.9, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_network(name, in_features, classes, hidden)
        self.loss = nn.CrossEntropyLoss()
        self.val_acc = MulticlassAccuracy(num_classes=classes, average="micro", **horovod_sync_kwargs())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", self.loss(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        h = self.hparams
        if h.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
