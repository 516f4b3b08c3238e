"""Run by test_attach: a user script started once per rank by an external launcher (like horovodrun)."""
import json
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_straggler  # noqa: F401
from lightning_straggler.data import ArrayDataModule
from lightning_straggler.models import Classifier

if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    model = Classifier("mlp", 40, 10, hidden=[16])
    data = ArrayDataModule("synthetic", num_samples=1000, seed=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ring", max_steps=5, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, train_dataloaders=DataLoader(data._dataset("x", "y"), batch_size=8))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "world": trainer.world_size,
                                  "launcher": type(trainer.strategy.launcher).__name__,
                                  "steps": trainer.strategy.steps_done, "params": flat[:20].tolist()}), flush=True)
    sys.exit(0)
