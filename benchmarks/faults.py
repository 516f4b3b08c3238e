"""One training job with a fault on purpose: a worker killed (SIGKILL) or frozen (SIGSTOP) at a step.

    .venv/bin/python -m benchmarks.faults --fault kill|freeze --rank R --step S [hydra overrides ...]

Used by ``python -m benchmarks.soak --faults``. The fault strikes rank ``R`` of the job's first launch
right after its optimizer step ``S`` (a restarted, smaller job is left alone), from a callback in the
worker itself: a kill is what an OOM killer or a lost node does, a freeze what a hung data loader, a
debugger or a stuck device kernel does (alive, never reaching the next collective). Exit codes and the
``error:`` line are the main job's (``python -m lightning_straggler.train``).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from lightning.pytorch import Callback

KINDS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


class FaultAt(Callback):
    """Sends ``kind``'s signal to its own process on ``rank`` after optimizer step ``step`` (1-based), only
    while the job has ``world`` workers (importable: the workers unpickle it)."""

    def __init__(self, kind: str, rank: int, step: int, world: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)} (got {kind!r})")
        self.kind, self.rank, self.step, self.world = kind, rank, step, world

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.world_size == self.world and trainer.global_rank == self.rank:
            print(f"[faults] rank {self.rank}: {self.kind} after step {self.step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), KINDS[self.kind])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", required=True, choices=sorted(KINDS))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--step", type=int, required=True, help="optimizer step (1-based) after which it strikes")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the main job")
    args = parser.parse_args(argv)

    from hydra import compose, initialize_config_dir

    import lightning_straggler.config  # noqa: F401  (registers the config schemas)
    from lightning_straggler.config import ConfigError, load_config
    from lightning_straggler.launcher import WorkerFailure
    from lightning_straggler.train import train

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=args.overrides)
    try:
        world = load_config(cfg).trainer.devices
        if not 0 <= args.rank < world:
            raise ConfigError(f"--rank must be a worker rank in 0..{world - 1} (got {args.rank})")
        train(cfg, callbacks=[FaultAt(args.fault, args.rank, args.step, world)])
    except (ConfigError, WorkerFailure) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    # the importable module's copy: the workers unpickle FaultAt as benchmarks.faults.FaultAt, not __main__'s
    from benchmarks.faults import main as _main

    sys.exit(_main())
