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
import copy
import warnings
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightning_straggler.worker_start import end_early_fork_server, start_fork_server_early

if __name__ == "__main__":  # before the imports below: the fork server imports torch alongside them
    start_fork_server_early(sys.argv[1:])

from omegaconf import DictConfig

# Importing the config module registers the group schemas with Hydra's ConfigStore.
from lightning_straggler.config import ConfigError, load_config  # noqa: E402

log = logging.getLogger("lightning_straggler")


def _output_dir(cfg) -> str:
    if cfg.output_dir:
        return os.path.abspath(cfg.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except Exception:  # not under @hydra.main
        return os.getcwd()


def build_strategy(cfg, job_deadline: Optional[float] = None):
    if cfg.algorithm.name == "ddp":  # Lightning's own DDPStrategy, the baseline (not a Horovod strategy)
        from lightning_straggler.ddp_baseline import DDPBaselineStrategy as cls
    else:
        from lightning_straggler.strategies import STRATEGIES

        cls, _ = STRATEGIES[cfg.algorithm.name]
    options = {k: v for k, v in asdict(cfg.algorithm).items() if k != "name"}
    if cfg.trainer.horovod_cycle_time_ms is not None and cfg.algorithm.name != "ddp":  # (ddp has no Horovod)
        options["horovod_cycle_time_ms"] = cfg.trainer.horovod_cycle_time_ms
    if cfg.algorithm.name != "ddp":
        options["rank_states"] = cfg.trainer.rank_states
    strategy = cls(stall_timeout_s=cfg.trainer.stall_timeout_s, nonfinite=cfg.trainer.nonfinite, **options)
    # read by the launcher: the limit, and when it runs out (time.monotonic(); restarts included)
    strategy.job_timeout_s = cfg.trainer.job_timeout_s
    strategy.job_deadline = job_deadline if cfg.trainer.job_timeout_s else None
    return strategy


def launch_layout(cfg) -> Tuple[int, int]:
    """``(devices, num_nodes)`` for Lightning's Trainer: ``(trainer.devices, 1)`` (this project's launchers
    and the Horovod attach paths count every worker in ``devices``), or torchrun's per-node layout for
    ``ddp`` (cluster_env.torchrun_layout). Raises ConfigError when a torchrun launch disagrees."""
    from lightning_straggler.cluster_env import ClusterEnvError, torchrun_layout

    try:
        launched = torchrun_layout(cfg.algorithm.name, cfg.trainer.devices)
    except ClusterEnvError as e:
        raise ConfigError(str(e)) from None
    return (launched.devices, launched.num_nodes) if launched else (cfg.trainer.devices, 1)


def shrink_config(raw: Dict[str, Any], survivors: List[int]) -> Dict[str, Any]:
    """The configuration for a restart on ``survivors`` (old ranks, renumbered 0..n-1 in order): fewer
    devices, and the emulated stragglers of the surviving workers only."""
    raw = copy.deepcopy(raw)
    new_rank = {old: new for new, old in enumerate(survivors)}
    raw.setdefault("trainer", {})["devices"] = len(survivors)
    straggler = raw.get("straggler") or {}
    if straggler.get("factors"):
        factors = straggler["factors"]
        straggler["factors"] = [factors[r] for r in survivors if r < len(factors)] or [1.0]
    if straggler.get("events"):
        kept = [dict(e, rank=new_rank[e.get("rank", 0)]) for e in straggler["events"] if e.get("rank", 0) in new_rank]
        straggler["events"] = kept
        if not kept:
            straggler["scenario"] = "none"
    algorithm = raw.get("algorithm")
    if isinstance(algorithm, dict) and algorithm.get("initial_batch_sizes"):  # boa: per-worker list
        algorithm["initial_batch_sizes"] = None
    return raw


def train(cfg: Any, callbacks: Sequence[Any] = ()) -> Dict[str, Any]:
    """Run one training job; returns the summary (also written to ``<output_dir>/summary.json``).

    ``callbacks`` are added to the Trainer's. With ``trainer.restart_on_failure`` > 0, a job whose worker died goes on from
    ``<output_dir>/checkpoints/last.ckpt`` without the dead workers, up to that many times."""
    from lightning_straggler.errors import WorkerFailure

    checked = load_config(cfg)  # raises ConfigError before any worker starts
    launch_layout(checked)  # the same for a launch that disagrees with it (torchrun)
    from omegaconf import OmegaConf

    if not isinstance(cfg, (dict, DictConfig)):
        cfg = OmegaConf.structured(cfg)
    raw = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)  # as given: restarts re-derive defaults
    raw.pop("hydra", None)
    raw.setdefault("trainer", {})["devices"] = checked.trainer.devices
    allowed = checked.trainer.restart_on_failure
    restarts: List[Dict[str, Any]] = []
    survivors = list(range(checked.trainer.devices))  # original ranks of the workers now running
    ckpt_path: Optional[str] = None
    deadline = time.monotonic() + checked.trainer.job_timeout_s
    while True:
        try:
            return _train_once(checked, ckpt_path, restarts, callbacks, deadline)
        except WorkerFailure as failure:
            keep = [i for i in range(len(survivors)) if i not in failure.dead_ranks]
            if len(restarts) >= allowed or not failure.dead_ranks or not keep:
                if restarts:
                    raise WorkerFailure(f"{failure} (after {len(restarts)} restart(s))", failure.kind, failure.rank,
                                        failure.reason, failure.dead_ranks) from failure
                raise
            last = os.path.join(_output_dir(checked), "checkpoints", "last.ckpt")
            ckpt_path = last if os.path.exists(last) else None
            try:
                raw = shrink_config(raw, keep)
                raw["trainer"]["restart_on_failure"] = allowed - len(restarts) - 1  # the ones left
                checked = load_config(raw)
            except ConfigError as e:
                raise WorkerFailure(f"{failure}; cannot restart on {len(keep)} workers: {e}", failure.kind,
                                    failure.rank, failure.reason, failure.dead_ranks) from failure
            restarts.append({"dead_rank": failure.rank, "dead_ranks": failure.dead_ranks,
                             "dead_original_ranks": [survivors[i] for i in failure.dead_ranks],
                             "reason": failure.reason, "from_checkpoint": ckpt_path, "new_world_size": len(keep)})
            survivors = [survivors[i] for i in keep]
            print(f"[lightning-straggler] restart {len(restarts)}/{allowed}: worker rank "
                  f"{failure.rank} {failure.reason}; going on with {len(keep)} workers from "
                  f"{ckpt_path or 'the start (no checkpoint yet)'}", file=sys.stderr, flush=True)


def _train_once(cfg, ckpt_path: Optional[str], restarts: List[Dict[str, Any]], callbacks: Sequence[Any],
                job_deadline: Optional[float] = None) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import lightning_straggler  # noqa: F401  (registers the strategies)
    from lightning_straggler.callbacks import StragglerInjector, WorkerProfiler
    from lightning_straggler.checkpoint_io import AtomicCheckpointIO
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
    strategy = build_strategy(cfg, job_deadline)
    t = cfg.trainer
    # checkpoints/last.ckpt at every epoch end (and every checkpoint_every_n_steps steps): what a restart
    # goes on from; written by rank 0, atomically
    checkpoints = ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), save_last=True,
                                  every_n_train_steps=t.checkpoint_every_n_steps or None,
                                  enable_version_counter=False)
    devices, num_nodes = launch_layout(cfg)
    trainer = pl.Trainer(
        accelerator=t.accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, max_epochs=t.max_epochs,
        max_steps=t.max_steps, val_check_interval=t.val_check_interval, log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar, gradient_clip_val=t.gradient_clip_val,
        callbacks=[profiler, injector, checkpoints, *callbacks], logger=CSVLogger(out, name="logs"),
        default_root_dir=out, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
    )
    print(f"[lightning-straggler] algorithm={cfg.algorithm.name} workers={t.devices} "
          f"straggler={cfg.straggler.scenario} data={cfg.data.name} output={out}", flush=True)
    started = time.time()
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    total = time.time() - started
    if not trainer.is_global_zero:
        return {}
    val_acc = trainer.callback_metrics.get("val_acc")
    from omegaconf import OmegaConf

    summary = build_summary(cfg.algorithm.name, trainer.world_size, strategy.run_report, total, cfg.target_acc,
                            OmegaConf.to_container(OmegaConf.structured(cfg)),
                            None if val_acc is None else float(val_acc))
    summary["restarts"] = restarts
    path = write_summary(summary, out)
    ttt = summary["time_to_target_s"]
    acc = "n/a (no validation ran)" if summary["val_acc"] is None else f"{summary['val_acc']:.4f}"
    print(f"[lightning-straggler] val_acc={acc} "
          f"throughput={summary['throughput_samples_per_s']:.0f} samples/s "
          f"time_to_target({cfg.target_acc})={'not reached' if ttt is None else f'{ttt:.1f} s'}", flush=True)
    print(f"[lightning-straggler] summary: {path}", flush=True)
    if summary.get("timeline_png"):
        print(f"[lightning-straggler] timeline: {summary['timeline_png']}", flush=True)
    if cfg.advise:  # the advisor's verdict on this run (python -m lightning_straggler.advise OUT for the table)
        from lightning_straggler.advise import AdviseError, advise, recommendation_line

        try:
            print(f"[lightning-straggler] advise: {recommendation_line(advise(out))} "
                  f"(table: python -m lightning_straggler.advise {out})", flush=True)
        except AdviseError as e:
            print(f"[lightning-straggler] advise: {e}", flush=True)
    return summary


class SweepJobError(RuntimeError):
    """A sweep point run by submitit failed; the message names the job's log files."""


def _submitit_logs() -> Optional[str]:
    """``stdout, stderr`` paths of this submitit job's task, or ``None`` outside submitit."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    try:
        import submitit

        paths = submitit.JobEnvironment().paths
        return f"{paths.stdout}, {paths.stderr}"
    except Exception:  # not a submitit job after all, or an older submitit
        return None


def _hydra_main() -> None:
    import hydra

    from lightning_straggler.errors import WorkerFailure

    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

    # our submitit_slurm.yaml is checked against the plugin's schema of the same name, as intended
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_slurm' is validated against ConfigStore")

    @hydra.main(config_path=conf_dir, config_name="train", version_base="1.3")
    def main(cfg) -> Optional[float]:
        try:
            summary = train(cfg)
        except (ConfigError, WorkerFailure) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            logs = _submitit_logs()
            if logs:  # a SLURM job: the sweep's launching process re-raises this, logs named
                raise SweepJobError(f"{e}\n-- submitit logs of this job: {logs}") from None
            sys.exit(2 if isinstance(e, ConfigError) else 1)
        return summary.get("val_acc") if summary else None

    try:
        main()
    except SystemExit as e:
        if e.code:  # refused or failed: the early fork server must not keep a reader of the output waiting
            end_early_fork_server()
        raise


if __name__ == "__main__":
    # Run the importable module's copy, not this __main__ one: submitit (hydra/launcher=submitit_slurm)
    # pickles the task function, and classes of __main__ would travel by value, which the workers'
    # spawn pickling then cannot find again.
    from lightning_straggler.train import _hydra_main as _main

    _main()
