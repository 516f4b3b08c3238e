"""Data sets generated locally: MNIST-1D (the ``mnist1d`` package, no download) and a synthetic
Gaussian mixture for pure-throughput runs. MNIST-1D is generated once per setting and cached as .npz."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "lightning-straggler", "data")


def mnist1d_arrays(num_samples: int, seed: int, cache_dir: Optional[str] = None) -> dict:
    """(x, y, x_test, y_test) of MNIST-1D with the package's default transforms, generated locally."""
    cache_dir = cache_dir or default_cache_dir()
    key = hashlib.sha1(json.dumps({"n": num_samples, "seed": seed, "v": 1}).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f"mnist1d-{num_samples}-{seed}-{key}.npz")
    if os.path.exists(path):
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    d = make_dataset(args)  # local generation; mnist1d's get_dataset() would download
    arrays = {"x": d["x"].astype(np.float32), "y": d["y"].astype(np.int64),
              "x_test": d["x_test"].astype(np.float32), "y_test": d["y_test"].astype(np.int64)}
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # atomic: concurrent workers never read half a file
    return arrays


TRAIN_FRACTION = 0.8  # of the generated samples; the rest is the validation set


def synthetic_arrays(num_samples: int, features: int, classes: int, seed: int) -> dict:
    """Gaussian clusters around random class centres; 80/20 split."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1.0, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=num_samples)
    x = (centres[y] + rng.normal(0, 1.0, size=(num_samples, features))).astype(np.float32)
    split = int(TRAIN_FRACTION * num_samples)
    return {"x": x[:split], "y": y[:split].astype(np.int64), "x_test": x[split:], "y_test": y[split:].astype(np.int64)}


class ArrayDataModule(pl.LightningDataModule):
    """Train/validation loaders over in-memory arrays. Lightning adds the DistributedSampler."""

    def __init__(self, name: str = "mnist1d", num_samples: int = 10000, batch_size: int = 32, seed: int = 42,
                 features: int = 40, classes: int = 10, cache_dir: Optional[str] = None,
                 shuffle: bool = True) -> None:
        super().__init__()
        if name not in ("mnist1d", "synthetic"):
            raise ValueError(f"data name must be one of mnist1d, synthetic (got {name!r})")
        self.name, self.num_samples, self.batch_size, self.seed = name, num_samples, batch_size, seed
        self.features, self.classes, self.cache_dir, self.shuffle = features, classes, cache_dir, shuffle
        self._arrays: Optional[dict] = None

    @property
    def in_features(self) -> int:
        return 40 if self.name == "mnist1d" else self.features

    @property
    def num_classes(self) -> int:
        return 10 if self.name == "mnist1d" else self.classes

    def prepare_data(self) -> None:
        if self.name == "mnist1d":
            mnist1d_arrays(self.num_samples, self.seed, self.cache_dir)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._arrays is None:
            if self.name == "mnist1d":
                self._arrays = mnist1d_arrays(self.num_samples, self.seed, self.cache_dir)
            else:
                self._arrays = synthetic_arrays(self.num_samples, self.features, self.classes, self.seed)

    def _dataset(self, x: str, y: str) -> TensorDataset:
        self.setup()
        return TensorDataset(torch.from_numpy(self._arrays[x]), torch.from_numpy(self._arrays[y]))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset("x", "y"), batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset("x_test", "y_test"), batch_size=256)
