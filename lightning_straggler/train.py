"""The main job: ``python -m lightning_straggler.train [overrides]`` (Hydra), or ``train(cfg)`` from code.

``train`` validates the whole configuration before any worker starts, builds a plain Trainer with a
lightning_straggler strategy, the profiler and the straggler injector, runs ``fit`` (which starts the
Horovod workers), and writes ``summary.json`` in the output directory.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Dict, Optional

# Importing the config module registers the group schemas with Hydra's ConfigStore.
from lightning_straggler.config import ConfigError, load_config

log = logging.getLogger("lightning_straggler")


def _output_dir(cfg) -> str:
    if cfg.output_dir:
        return os.path.abspath(cfg.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except Exception:  # not under @hydra.main
        return os.getcwd()


def build_strategy(cfg):
    from lightning_straggler.strategies import STRATEGIES

    cls, _ = STRATEGIES[cfg.algorithm.name]
    options = {k: v for k, v in asdict(cfg.algorithm).items() if k != "name"}
    return cls(**options) if options else cls()


def train(cfg: Any) -> Dict[str, Any]:
    """Run one training job; returns the summary (also written to ``<output_dir>/summary.json``)."""
    cfg = load_config(cfg)  # raises ConfigError before any worker starts
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    import lightning_straggler  # noqa: F401  (registers the strategies)
    from lightning_straggler.callbacks import StragglerInjector, WorkerProfiler
    from lightning_straggler.data import ArrayDataModule
    from lightning_straggler.models import Classifier
    from lightning_straggler.summary import build_summary, write_summary

    out = _output_dir(cfg)
    os.makedirs(out, exist_ok=True)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    data = ArrayDataModule(**asdict(cfg.data))
    data.prepare_data()  # generate MNIST-1D once here, not in every worker
    model = Classifier(name=cfg.model.name, in_features=data.in_features, classes=data.num_classes,
                       hidden=cfg.model.hidden, optimizer=cfg.model.optimizer, lr=cfg.model.lr,
                       momentum=cfg.model.momentum, weight_decay=cfg.model.weight_decay)
    profiler = WorkerProfiler(cfg.profiler.gather_every_n_steps, output_dir=out, plot=cfg.profiler.plot)
    injector = StragglerInjector(cfg.straggler.schedule(), cfg.straggler.device_ms_per_sample)
    strategy = build_strategy(cfg)
    t = cfg.trainer
    trainer = pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=strategy, max_epochs=t.max_epochs,
        max_steps=t.max_steps, val_check_interval=t.val_check_interval, log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar, gradient_clip_val=t.gradient_clip_val,
        callbacks=[profiler, injector], logger=CSVLogger(out, name="logs"), default_root_dir=out,
        enable_model_summary=False,
    )
    print(f"[lightning-straggler] algorithm={cfg.algorithm.name} workers={t.devices} "
          f"straggler={cfg.straggler.scenario} data={cfg.data.name} output={out}", flush=True)
    started = time.time()
    trainer.fit(model, datamodule=data)
    total = time.time() - started
    if not trainer.is_global_zero:
        return {}
    val_acc = trainer.callback_metrics.get("val_acc")
    from omegaconf import OmegaConf

    summary = build_summary(cfg.algorithm.name, t.devices, strategy.run_report, total, cfg.target_acc,
                            OmegaConf.to_container(OmegaConf.structured(cfg)),
                            None if val_acc is None else float(val_acc))
    path = write_summary(summary, out)
    ttt = summary["time_to_target_s"]
    acc = "n/a (no validation ran)" if summary["val_acc"] is None else f"{summary['val_acc']:.4f}"
    print(f"[lightning-straggler] val_acc={acc} "
          f"throughput={summary['throughput_samples_per_s']:.0f} samples/s "
          f"time_to_target({cfg.target_acc})={'not reached' if ttt is None else f'{ttt:.1f} s'}", flush=True)
    print(f"[lightning-straggler] summary: {path}", flush=True)
    if summary.get("timeline_png"):
        print(f"[lightning-straggler] timeline: {summary['timeline_png']}", flush=True)
    return summary


def _hydra_main() -> None:
    import hydra

    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

    @hydra.main(config_path=conf_dir, config_name="train", version_base="1.3")
    def main(cfg) -> Optional[float]:
        try:
            summary = train(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        return summary.get("val_acc") if summary else None

    main()


if __name__ == "__main__":
    _hydra_main()
