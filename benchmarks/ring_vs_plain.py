"""Throughput of the Lightning ``ring`` strategy against a plain Horovod loop written without Lightning.

    .venv/bin/python -m benchmarks.ring_vs_plain [--steps 200] [--repeats 3] [--emulate-ms-per-sample 0]
                                                 [--data mnist1d|synthetic] [--quick] [--ddp]

``--ddp`` adds a third row per round: Lightning's own ``DDPStrategy`` (``algorithm=ddp``, torch.distributed
with Gloo, spawned) through the same ``train()`` and overrides as the ring, timed the same way (its
profiler's start and final all-gather), and reports ring / ddp against the 0.97 target of issue 14.

Both sides train the same MLP (40 -> 256 -> 256 -> 10, SGD lr 0.05 momentum 0.9) on the same training
set, 4 Horovod workers (Gloo on loopback), batch 32 per worker, no stragglers, the same number of
optimizer steps. Runs alternate plain, ring, plain, ring, ... so slow drift of the machine hits both.

What is timed (the same on both sides, on rank 0, wall clock):
  start: training begins after set-up — workers started, Horovod initialised, initial parameters broadcast
         (ring: ``WorkerProfiler.on_train_start``, after Lightning's sanity validation; plain: after the
         broadcast and one named all-reduce that lines the ranks up);
  end:   after the last optimizer step and one collective over all ranks (ring: the profiler's final
         all-gather in ``on_train_end``; plain: one named all-reduce), so both include waiting for the
         slowest rank.
  Inside: creating the data-loader iterator, every step (data loading, forward, backward, the optional
  emulated device sleep, the gradient all-reduce, the update) and, for ring, everything Lightning and
  the package add per step (hooks, logging, the profiler's all-gather every 25 steps).
  Outside: process start-up, data generation, validation. Validation never runs inside the ring's timed
  region: the data set is sized so that one epoch holds more than ``--steps`` batches per worker, and
  the ring validates only at epoch end (checked: the summary's val_history must be empty).
Throughput = samples of all workers (steps x 32 x 4) / rank 0's timed seconds; ring's comes from
``summary.json`` (``train_samples / wall_s``). The ratio is median(ring) / median(plain).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKERS, BATCH, SEED, DATA_SEED = 4, 32, 0, 42
HIDDEN, LR, MOMENTUM = [256, 256], 0.05, 0.9
TARGET = 0.95  # the project's goal: ring reaches at least 95% of the plain loop's throughput
DDP_TARGET = 0.97  # issue 14: ring >= 0.97 x Lightning's own DDP, no stragglers


def dataset_size(steps: int) -> int:
    """Generated samples so that each worker's shard of the 80% training split holds > steps batches
    (one epoch longer than the run, so the ring never reaches its epoch-end validation)."""
    need = (steps + 1) * BATCH * WORKERS / 0.8
    return max(10000, int(math.ceil(need / 1000.0)) * 1000)  # round up: a few cached MNIST-1D sizes


def load_arrays(data: str, num_samples: int) -> dict:
    from lightning_straggler.data import mnist1d_arrays, synthetic_arrays

    # The same calls (and seeds) ArrayDataModule makes, so both sides see identical samples.
    if data == "mnist1d":
        return mnist1d_arrays(num_samples, DATA_SEED)
    return synthetic_arrays(num_samples, 40, 10, DATA_SEED)


# --- plain Horovod loop (no Lightning) -----------------------------------------------------------
def _plain_worker(rank: int, size: int, port: int, opts: Dict[str, Any], results) -> None:
    from lightning_straggler.launcher import horovod_worker_env

    os.environ.update(horovod_worker_env(rank, size, port, 300))
    import horovod.torch as hvd
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_straggler.models import build_network

    hvd.init()
    try:
        # One thread per worker share of the cores, as HorovodStrategy.setup_environment does.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        arrays = load_arrays(opts["data"], opts["num_samples"])
        # DistributedSampler-style shard (rank::size); a DataLoader like Lightning's so per-batch
        # collation costs the same on both sides.
        shard = TensorDataset(torch.from_numpy(arrays["x"][rank::size]), torch.from_numpy(arrays["y"][rank::size]))
        loader = DataLoader(shard, batch_size=BATCH, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(SEED + rank))
        assert len(loader) > opts["steps"], "data set too small for one epoch of --steps batches"
        torch.manual_seed(SEED)
        net = build_network("mlp", 40, 10, HIDDEN)
        optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        loss_fn = nn.CrossEntropyLoss()
        for name, tensor in net.state_dict().items():  # every rank starts from rank 0's weights
            hvd.broadcast_(tensor, root_rank=0, name=f"init.{name}")
        hvd.allreduce(torch.zeros(1), name="start")  # line the ranks up before the clock starts
        sleep_s = opts["emulate_ms_per_sample"] * BATCH / 1000.0
        params = list(net.parameters())

        started = time.perf_counter()
        steps = 0
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(net(x), y).backward()
            if sleep_s > 0:
                time.sleep(sleep_s)  # emulated device time, where the ring's StragglerInjector sleeps
            # One fused average of all gradients; a fixed name, as hvd.DistributedOptimizer uses.
            hvd.grouped_allreduce_([p.grad for p in params], op=hvd.Average, name="grads")
            optimizer.step()
            steps += 1
            if steps == opts["steps"]:
                break
        hvd.allreduce(torch.zeros(1), name="end")  # wait for the slowest rank, like the profiler's gather
        seconds = time.perf_counter() - started
        results.put((rank, (steps * BATCH, seconds)))
    finally:
        hvd.shutdown()


def run_plain(opts: Dict[str, Any]) -> Dict[str, Any]:
    from benchmarks.local_workers import run_workers

    per_rank = run_workers(_plain_worker, WORKERS, (opts,), 900, "plain loop")
    samples = sum(s for s, _ in per_rank.values())
    seconds = per_rank[0][1]
    return {"samples": samples, "seconds": seconds, "throughput": samples / seconds,
            "per_rank_seconds": {str(r): per_rank[r][1] for r in sorted(per_rank)}}


# --- Lightning ring strategy through the package's train() ---------------------------------------
def run_ring(opts: Dict[str, Any], out_dir: str, algorithm: str = "ring") -> Dict[str, Any]:
    from hydra import compose, initialize_config_dir

    from lightning_straggler.train import train

    overrides = [
        f"algorithm={algorithm}", "straggler=none", "model=mlp", f"data={opts['data']}",
        # conf/straggler/none.yaml emulates 1 ms/sample; use the same value as the plain loop
        f"straggler.device_ms_per_sample={opts['emulate_ms_per_sample']}",
        f"model.hidden=[{','.join(map(str, HIDDEN))}]", "model.optimizer=sgd", f"model.lr={LR}",
        f"model.momentum={MOMENTUM}",
        f"data.num_samples={opts['num_samples']}", f"data.batch_size={BATCH}", f"data.seed={DATA_SEED}",
        f"trainer.devices={WORKERS}", "trainer.accelerator=cpu", f"trainer.max_steps={opts['steps']}",
        "trainer.max_epochs=1", "trainer.val_check_interval=1.0",  # validate only at epoch end: never reached
        "trainer.enable_progress_bar=false", "profiler.plot=false", f"seed={SEED}", f"output_dir={out_dir}",
    ]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    summary = train(cfg)
    expected = opts["steps"] * BATCH * WORKERS
    if summary["train_samples"] != expected:
        raise RuntimeError(f"{algorithm} trained {summary['train_samples']} samples, expected {expected}")
    if summary["val_history"]:
        raise RuntimeError(f"validation ran inside the {algorithm}'s timed region; the comparison would be unfair")
    return {"samples": summary["train_samples"], "seconds": summary["wall_s"],
            "throughput": summary["throughput_samples_per_s"], "launch_s": summary["launch_s"],
            "summary": os.path.join(out_dir, "summary.json")}


# --- driver --------------------------------------------------------------------------------------
def markdown_table(runs: List[Dict[str, Any]], med: Dict[str, float], ratio: float) -> str:
    ddp = "ddp" in med
    lines = ["| round | plain samples/s | ring samples/s | ring / plain |" + (" ddp samples/s | ring / ddp |" if ddp else ""),
             "|---|---:|---:|---:|" + ("---:|---:|" if ddp else "")]
    for r in sorted({run["round"] for run in runs}):
        t = {run["impl"]: run["throughput"] for run in runs if run["round"] == r}
        lines.append(f"| {r} | {t['plain']:.0f} | {t['ring']:.0f} | {t['ring'] / t['plain']:.3f} |"
                     + (f" {t['ddp']:.0f} | {t['ring'] / t['ddp']:.3f} |" if ddp else ""))
    lines.append(f"| **median** | **{med['plain']:.0f}** | **{med['ring']:.0f}** | **{ratio:.3f}** |"
                 + (f" **{med['ddp']:.0f}** | **{med['ring'] / med['ddp']:.3f}** |" if ddp else ""))
    return "\n".join(lines)


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (both sides)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (plain, ring)")
    ap.add_argument("--emulate-ms-per-sample", type=float, default=0.0,
                    help="emulated device time: sleep this many ms per sample after backward (both sides)")
    ap.add_argument("--data", choices=("mnist1d", "synthetic"), default="mnist1d")
    ap.add_argument("--quick", action="store_true", help="smoke test: 30 steps, 1 round")
    ap.add_argument("--ddp", action="store_true",
                    help="also run Lightning's own DDPStrategy (algorithm=ddp) each round; report ring / ddp")
    ap.add_argument("--output", default=os.path.join(RESULTS, "ring_vs_plain.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 30, 1
    if args.steps < 1 or args.repeats < 1 or args.emulate_ms_per_sample < 0:
        ap.error("--steps and --repeats must be >= 1, --emulate-ms-per-sample >= 0")
    if "OMP_NUM_THREADS" in os.environ:
        # The ring keeps OMP_NUM_THREADS when set, the plain loop sets cores // workers: make them agree.
        print(f"note: ignoring OMP_NUM_THREADS={os.environ.pop('OMP_NUM_THREADS')} so both sides use "
              f"cores // workers threads", flush=True)

    opts = {"steps": args.steps, "emulate_ms_per_sample": args.emulate_ms_per_sample, "data": args.data,
            "num_samples": dataset_size(args.steps)}
    load_arrays(args.data, opts["num_samples"])  # generate and cache MNIST-1D once, before any timing

    impls = ("plain", "ring", "ddp") if args.ddp else ("plain", "ring")
    runs: List[Dict[str, Any]] = []
    for r in range(1, args.repeats + 1):
        for impl in impls:  # alternate, so drift of the machine affects all alike
            print(f"[ring_vs_plain] round {r}/{args.repeats}: {impl} ({args.steps} steps)", flush=True)
            res = run_plain(opts) if impl == "plain" else run_ring(
                opts, os.path.join(RESULTS, f"{impl}_runs", f"round{r}"), algorithm=impl)
            runs.append({"round": r, "impl": impl, **res})
            print(f"[ring_vs_plain] {impl}: {res['throughput']:.0f} samples/s "
                  f"({res['samples']} samples in {res['seconds']:.2f} s)", flush=True)

    med = {impl: statistics.median(x["throughput"] for x in runs if x["impl"] == impl) for impl in impls}
    ratio = med["ring"] / med["plain"]
    import horovod
    import lightning
    import torch

    report = {
        "what_is_timed": __doc__[__doc__.index("What is timed"):__doc__.index("Throughput =")].strip(),
        "throughput_definition": "samples of all workers / rank 0's timed seconds; ratio = median(ring) / median(plain)",
        "settings": {"workers": WORKERS, "batch_per_worker": BATCH, "steps": args.steps, "repeats": args.repeats,
                     "model": f"mlp 40-{'-'.join(map(str, HIDDEN))}-10", "optimizer": f"SGD lr={LR} momentum={MOMENTUM}",
                     "data": args.data, "data_num_samples": opts["num_samples"], "straggler": "none",
                     "emulated_device_ms_per_sample": args.emulate_ms_per_sample,
                     "emulated": ("none: real CPU compute only" if args.emulate_ms_per_sample == 0 else
                                  "sleep of emulate_ms_per_sample x 32 after backward, every step, both sides"),
                     "torch_threads_per_worker": max(1, (os.cpu_count() or 1) // WORKERS), "quick": args.quick},
        "environment": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                        "lightning": lightning.__version__, "horovod": horovod.__version__},
        "runs": runs,
        "median_throughput": med,
        "ratio_ring_over_plain": ratio,
        "target_ratio": TARGET,
        "meets_target": ratio >= TARGET,
    }
    if args.ddp:
        report.update(ratio_ring_over_ddp=med["ring"] / med["ddp"], ddp_target_ratio=DDP_TARGET,
                      meets_ddp_target=med["ring"] / med["ddp"] >= DDP_TARGET)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nring vs plain Horovod: {WORKERS} workers, batch {BATCH}, {args.steps} steps, {args.data}, "
          f"emulated device time {args.emulate_ms_per_sample} ms/sample\n")
    print(markdown_table(runs, med, ratio))
    print(f"\nring / plain = {ratio:.3f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'}); "
          f"results: {args.output}", flush=True)
    if args.ddp:
        print(f"ring / ddp = {report['ratio_ring_over_ddp']:.3f} (target >= {DDP_TARGET}: "
              f"{'met' if report['meets_ddp_target'] else 'NOT met'})", flush=True)
    return report


if __name__ == "__main__":
    main()
