"""algorithm=ddp: Lightning's own DDPStrategy as the baseline of the main job and of benchmarks.matrix.

In-process: the config group validates and bad values name the setting; the matrix plans ddp cells and
computes their ratios to ring. Real runs (2 workers, a few steps): ``python -m lightning_straggler.train
algorithm=ddp`` writes a complete summary.json; post-local SGD (model_averaging_period) lets the workers'
parameters drift apart between averages."""
from __future__ import annotations

import json
import os

import pytest
from hydra.errors import ConfigCompositionException
from lightning.pytorch import Callback

from lightning_straggler.config import ConfigError, load_config
from lightning_straggler.summary import SUMMARY_KEYS


# --- configuration ------------------------------------------------------------------------------
def test_ddp_option_composes_and_validates(compose):
    cfg = load_config(compose("algorithm=ddp", "straggler=none"))
    assert cfg.algorithm.name == "ddp"
    assert cfg.algorithm.model_averaging_period == 0 and cfg.algorithm.warmup_steps == 0
    cfg = load_config(compose("algorithm=ddp", "straggler=none", "algorithm.model_averaging_period=4",
                              "algorithm.warmup_steps=8"))
    assert (cfg.algorithm.model_averaging_period, cfg.algorithm.warmup_steps) == (4, 8)


@pytest.mark.parametrize("override,setting", [
    ("algorithm.model_averaging_period=-1", "algorithm.model_averaging_period"),
    ("algorithm.warmup_steps=-2", "algorithm.warmup_steps"),
    ("algorithm.warmup_steps=5", "algorithm.warmup_steps"),  # a warm-up without post-local SGD
    ("trainer.restart_on_failure=1", "trainer.restart_on_failure"),  # restarts: Horovod strategies only
])
def test_bad_ddp_values_name_the_setting(compose, override, setting):
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        load_config(compose("algorithm=ddp", "straggler=none", override))


def test_unknown_or_mistyped_ddp_keys_fail(compose):
    with pytest.raises(ConfigCompositionException, match="model_averaging_period"):
        compose("algorithm=ddp", "algorithm.model_averaging_period=often")
    with pytest.raises(ConfigError, match="nonsense"):
        load_config({"algorithm": {"name": "ddp", "nonsense": 1}})


# --- benchmarks.matrix ------------------------------------------------------------------------
def test_matrix_plans_ddp_next_to_ring():
    from benchmarks import matrix as m

    a = m.parse_args(["--algorithms", "ddp", "--scenarios", "none", "transient4x", "--world-sizes", "4",
                      "--seeds", "1", "--steps", "20"])
    assert a.algorithms == ["ring", "ddp"]  # ring is always the reference
    plan = m.Plan(a)
    plan.build()
    ddp = [c for c in plan.cells if c["algorithm"] == "ddp"]
    assert len(ddp) == 2 and all("algorithm=ddp" in c["overrides"] for c in ddp)
    assert {c["scenario"] for c in ddp} == {"none", "transient4x"}
    # the same overrides as ring's run of the cell, but the algorithm
    ring = {c["scenario"]: c for c in plan.cells if c["algorithm"] == "ring"}
    for c in ddp:
        assert [o for o in c["overrides"] if not o.startswith("algorithm=")] == \
            [o for o in ring[c["scenario"]]["overrides"] if not o.startswith("algorithm=")]
    assert "ddp" not in m.parse_args([]).algorithms  # opt-in: the default grid is unchanged
    assert m.parse_run_name("ddp_none_N4_seed0")["algorithm"] == "ddp"


def test_matrix_aggregates_ddp_ratios_to_ring():
    from benchmarks import matrix as m

    def summary(algo, thr, ttt):
        per_rank = {str(r): {"steps": 10, "samples": 320, "comm_s": {"total": 0.2, "mean": 0.02},
                             "wait_s": {"total": 0.0}, "compute_s": {"total": 1.0}} for r in range(2)}
        return {"algorithm": algo, "world_size": 2, "throughput_samples_per_s": thr, "time_to_target_s": ttt,
                "val_acc": 0.5, "wall_s": 1.0, "launch_s": 5.0, "train_samples": 640, "per_rank": per_rank,
                "val_history": [], "timeline_png": None, "config": {"data": {"batch_size": 32}}}

    runs = [{"algorithm": a, "scenario": "none", "world_size": 2, "seed": 0, "summary": summary(a, thr, ttt)}
            for a, thr, ttt in (("ring", 600.0, 2.0), ("ddp", 500.0, 2.5))]
    agg = m.aggregate(runs, {}, {})
    cells = {c["algorithm"]: c for c in agg["cells"]}
    assert [c["algorithm"] for c in agg["cells"]] == ["ring", "ddp"]
    assert cells["ddp"]["throughput_ratio_to_ring"]["median"] == pytest.approx(500 / 600)
    assert cells["ddp"]["ttt_ratio_to_ring"]["median"] == pytest.approx(1.25)


# --- the real thing, tiny ----------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_ddp_two_workers_write_a_complete_summary(cli, tmp_path):
    steps, batch = 6, 32
    out = tmp_path / "ddp"
    r = cli("algorithm=ddp", "trainer=quick", "trainer.devices=2", f"trainer.max_steps={steps}",
            "trainer.val_check_interval=3", "data.num_samples=2000", f"data.batch_size={batch}",
            "straggler=static", "straggler.factors=[1.0,2.0]", "straggler.device_ms_per_sample=1.0",
            "profiler.gather_every_n_steps=4", "profiler.plot=false", f"output_dir={out}", timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    missing = [k for k in SUMMARY_KEYS if k not in s]
    assert not missing, missing
    assert s["algorithm"] == "ddp" and s["world_size"] == 2
    assert s["train_samples"] == 2 * steps * batch
    assert s["throughput_samples_per_s"] == pytest.approx(s["train_samples"] / s["wall_s"])
    assert s["val_acc"] is not None and len(s["val_history"]) == 2
    assert sorted(s["per_rank"]) == ["0", "1"]
    for rank in ("0", "1"):
        p = s["per_rank"][rank]
        assert p["steps"] == steps and p["samples"] == steps * batch
        assert {"compute_s", "comm_s", "wait_s"} <= set(p)
    # the injector ran on both ranks, in DDP's gradient hook: rank 1 emulates a device twice as slow
    seconds = s["emulated"]["per_rank_seconds"]
    assert seconds["0"]["device_s"] == pytest.approx(steps * batch * 1.0e-3)
    assert seconds["1"]["device_s"] == pytest.approx(2 * steps * batch * 1.0e-3)
    assert "first gradient bucket" in s["emulated"]["device_time"]
    # the slow rank's compute is the longer one; the fast rank waits for it in the all-reduce
    assert s["per_rank"]["1"]["compute_s"]["p50"] > s["per_rank"]["0"]["compute_s"]["p50"]
    assert s["per_rank"]["0"]["wait_s"]["total"] > s["per_rank"]["1"]["wait_s"]["total"]
    assert "compute_s" in s["profiling"]["profiling"] and s["profiling"]["gradient_buckets_per_step"] == 1
    assert s["restarts"] == [] and s["timeline_png"] is None
    assert os.path.exists(out / "checkpoints" / "last.ckpt")



class ParamsAgree(Callback):
    """After every step, whether all ranks hold the same parameters; rank 0 writes the list to ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.agree = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch
        import torch.distributed as dist

        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        every = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        self.agree.append(all(torch.equal(every[0], x) for x in every[1:]))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.agree, f)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_post_local_sgd_workers_drift_apart_and_are_averaged_every_period(compose, tmp_path):
    """model_averaging_period=3, warmup_steps=2: the first 2 steps all-reduce gradients (parameters equal),
    then workers step alone (parameters differ) and are averaged every 3rd step (equal again)."""
    from lightning_straggler.train import train

    path = str(tmp_path / "agree.json")
    cfg = compose("algorithm=ddp", "algorithm.model_averaging_period=3", "algorithm.warmup_steps=2",
                  "trainer=quick", "trainer.devices=2", "trainer.max_steps=9", "trainer.val_check_interval=9",
                  "data.num_samples=2000", "straggler=none", "profiler.plot=false", f"output_dir={tmp_path / 'run'}")
    summary = train(cfg, callbacks=[ParamsAgree(path)])
    assert summary["algorithm"] == "ddp" and summary["train_samples"] == 2 * 9 * 32
    agree = json.loads(open(path).read())
    print("parameters equal after each step:", agree)
    # steps 0, 1: warm-up, plain DDP; from step 2 the averager runs at steps 2, 5, 8 (every 3rd from the
    # warm-up's end) and the workers' own local steps in between leave them apart
    assert agree == [True, True, True, False, False, True, False, False, True]


class RaiseOnRank(Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"planted failure on rank {self.rank}")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_raising_ddp_worker_ends_the_job_naming_its_rank(compose, tmp_path):
    from lightning_straggler.launcher import WorkerFailure
    from lightning_straggler.train import train

    cfg = compose("algorithm=ddp", "trainer=quick", "trainer.devices=2", "trainer.max_steps=6",
                  "data.num_samples=2000", "straggler=none", "profiler.plot=false", f"output_dir={tmp_path}")
    with pytest.raises(WorkerFailure) as e:
        train(cfg, callbacks=[RaiseOnRank(1, 2)])
    assert e.value.kind == "raised" and e.value.rank == 1
    assert "planted failure on rank 1" in str(e.value)
