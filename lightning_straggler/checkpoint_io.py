"""Checkpoint writing for the main job (imported when a job starts, so that a refused command line
never loads Lightning)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from lightning.pytorch.plugins.io import TorchCheckpointIO


def save_atomically(obj: Any, path) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file next to it, fsync and rename: a death
    mid-write never leaves a torn file at ``path`` (a local path)."""
    import torch

    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes next to the target and renames: Lightning's own save goes through a temporary file in the
    system temp directory, which is a copy, not a rename, when that is another filesystem."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        save_atomically(checkpoint, path)
