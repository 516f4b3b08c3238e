"""Throughput of the Lightning ``ring`` strategy against a plain Horovod loop written without Lightning.

    .venv/bin/python -m benchmarks.ring_vs_plain [--workers 4 8] [--steps 200] [--repeats 5] [--ddp] [--noise]
        [--emulate-ms-per-sample 0] [--data mnist1d|synthetic] [--order-seed 0] [--output-dir DIR] [--quick]
    .venv/bin/python -m benchmarks.ring_vs_plain --aggregate-only DIR

``--ddp`` adds Lightning's own ``DDPStrategy`` (``algorithm=ddp``, torch.distributed with Gloo, spawned)
through the same ``train()`` and overrides as the ring, timed the same way (its profiler's start and
final all-gather): ring / ddp against the 0.97 target of issue 14. ``--noise`` runs the ring twice per
round (``ring#2``): ring#2 / ring is the machine's own run-to-run noise.

Both sides train the same MLP (40 -> 256 -> 256 -> 10, SGD lr 0.05 momentum 0.9) on the same training
set, N Horovod workers (Gloo on loopback), batch 32 per worker, no stragglers, the same number of
optimizer steps. Every round runs each implementation once, in an order shuffled per (N, round) by
``random.Random("ring_vs_plain:<order_seed>:<N>:<round>")`` (recorded), and the ratios are paired per
round and reported with benchmarks/stats.py's rules: median and 95% bootstrap interval, win / loss /
no difference against 1.

Output: ``<out>/report.json`` (settings, every run's samples and seconds, the intervals), ``<out>/report.md``,
``<out>/command.txt`` and ``<out>/runs.jsonl`` (the Lightning runs' summary.json trimmed: per-rank compute,
communication and waiting per step); default ``<out>`` = ``benchmarks/results/ring_vs_plain/<stamp>`` (committed;
``--quick`` ones are git-ignored). ``--aggregate-only DIR`` recomputes report.md/json from DIR's runs.

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
Throughput = samples of all workers (steps x 32 x N) / rank 0's timed seconds; ring's comes from
``summary.json`` (``train_samples / wall_s``). Ratios are per round (ring / plain, ring / ddp of the
same round), then the median and interval over rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List

from benchmarks.report import write_report
from benchmarks.stats import fmt_interval, labelled, shuffled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "ring_vs_plain")
BATCH, SEED, DATA_SEED = 32, 0, 42
HIDDEN, LR, MOMENTUM = [256, 256], 0.05, 0.9
TARGET = 0.95  # the project's goal: ring reaches at least 95% of the plain loop's throughput
DDP_TARGET = 0.97  # issue 14: ring >= 0.97 x Lightning's own DDP, no stragglers


def dataset_size(steps: int, workers: int) -> int:
    """Generated samples so that each worker's shard of the 80% training split holds > steps batches
    (one epoch longer than the run, so the ring never reaches its epoch-end validation)."""
    need = (steps + 1) * BATCH * workers / 0.8
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

    per_rank = run_workers(_plain_worker, opts["workers"], (opts,), 900, "plain loop")
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
        f"trainer.devices={opts['workers']}", "trainer.accelerator=cpu", f"trainer.max_steps={opts['steps']}",
        "trainer.max_epochs=1", "trainer.val_check_interval=1.0",  # validate only at epoch end: never reached
        "trainer.enable_progress_bar=false", "profiler.plot=false", f"seed={SEED}", f"output_dir={out_dir}",
    ]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    summary = train(cfg)
    expected = opts["steps"] * BATCH * opts["workers"]
    if summary["train_samples"] != expected:
        raise RuntimeError(f"{algorithm} trained {summary['train_samples']} samples, expected {expected}")
    if summary["val_history"]:
        raise RuntimeError(f"validation ran inside the {algorithm}'s timed region; the comparison would be unfair")
    return {"samples": summary["train_samples"], "seconds": summary["wall_s"],
            "throughput": summary["throughput_samples_per_s"], "launch_s": summary["launch_s"],
            "summary": os.path.join(out_dir, "summary.json")}


# --- driver --------------------------------------------------------------------------------------
NOISE_LABEL = "ring#2"  # --noise: the ring's second run of a round


def aggregate(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per world size: median throughput per implementation, and the per-round paired ratios
    (ring / plain, ring / ddp, ring#2 / ring) with their interval and label (benchmarks/stats.py)."""
    out: Dict[str, Any] = {}
    for n in sorted({r["workers"] for r in runs}):
        rs = [r for r in runs if r["workers"] == n]
        by_round: Dict[int, Dict[str, float]] = {}
        for r in rs:
            by_round.setdefault(r["round"], {})[r["impl"]] = r["samples"] / r["seconds"]
        impls = sorted({r["impl"] for r in rs})

        def ratios(num: str, den: str) -> List[float]:
            return [t[num] / t[den] for _, t in sorted(by_round.items()) if num in t and den in t]

        cell: Dict[str, Any] = {"rounds": len(by_round), "throughput": {}, "ratios": {}}
        for impl in impls:
            v = [t[impl] for t in by_round.values() if impl in t]
            cell["throughput"][impl] = {"median": statistics.median(v), "n": len(v)}
        for num, den in (("ring", "plain"), ("ring", "ddp"), (NOISE_LABEL, "ring")):
            if num in impls and den in impls:
                cell["ratios"][f"{num}/{den}"] = {**labelled(ratios(num, den)), "per_round": ratios(num, den)}
        out[str(n)] = cell
    return out


def per_step_breakdown(out: str) -> Dict[str, Any]:
    """From ``<out>/runs.jsonl``: per world size and Lightning implementation, the median over its runs of
    the per-rank mean compute, communication and waiting per step (ms), as the profiler splits a step
    (``lightning_straggler.profiling``; for ddp the split is at its first gradient bucket, see ddp_baseline)."""
    path = os.path.join(out, "runs.jsonl")
    if not os.path.exists(path):
        return {}
    acc: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            name = rec["path"].split("/")[1]  # <impl>_N<n>_round<r>
            impl, n = name.rsplit("_N", 1)[0].replace("ring_2", NOISE_LABEL), name.rsplit("_N", 1)[1].split("_")[0]
            ranks = rec["summary"]["per_rank"].values()
            cell = acc.setdefault(n, {}).setdefault(impl, {"compute": [], "comm": [], "wait": []})
            for key in ("compute", "comm", "wait"):
                cell[key].append(1e3 * statistics.mean(r[f"{key}_s"]["mean"] for r in ranks))
    return {n: {impl: {k: round(statistics.median(v), 2) for k, v in parts.items()} for impl, parts in sorted(by.items())}
            for n, by in sorted(acc.items(), key=lambda kv: int(kv[0]))}


def markdown(report: Dict[str, Any]) -> str:
    st = report["settings"]
    lines = ["# ring vs a plain Horovod loop" + (" and Lightning's DDP" if "ddp" in st["implementations"] else ""), "",
             f"Command: `{report['command']}`", "",
             f"{st['steps']} steps, batch {BATCH} per worker, {st['data']}, emulated device time "
             f"{st['emulated_device_ms_per_sample']} ms/sample, {st['repeats']} rounds, order shuffled per round "
             f"(order seed {st['order_seed']}); machine: {report['environment']['cpu_count']} cores. Ratios: per round, "
             "median [95% bootstrap interval] and label (win: lower end > 1; loss: upper end < 1).", "",
             "| workers | " + " | ".join(f"{i} samples/s" for i in st["implementations"]) + " | ratio | median [95% CI] label |",
             "|---|" + "---:|" * len(st["implementations"]) + "---|---|"]
    for n, cell in report["aggregate"].items():
        tp = " | ".join(f"{cell['throughput'][i]['median']:.0f}" if i in cell["throughput"] else "-"
                        for i in st["implementations"])
        for name, ci in cell["ratios"].items():
            lines.append(f"| {n} | {tp} | {name} | {fmt_interval(ci, '.3f')} |")
    if report.get("per_step"):
        lines += ["", "Where a Lightning run's step goes (ms per step, per-rank mean, median over rounds; runs.jsonl):", "",
                  "| workers | implementation | compute | communication | waiting |", "|---|---|---:|---:|---:|"]
        for n, by in report["per_step"].items():
            for impl, v in by.items():
                lines.append(f"| {n} | {impl} | {v['compute']:.2f} | {v['comm']:.2f} | {v['wait']:.2f} |")
    lines += ["", "Per run (round, order position, samples / seconds):", "",
              "| workers | round | position | implementation | samples/s | seconds |", "|---|---|---|---|---:|---:|"]
    for r in report["runs"]:
        lines.append(f"| {r['workers']} | {r['round']} | {r['position']} | {r['impl']} | {r['samples'] / r['seconds']:.0f} "
                     f"| {r['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def write_trimmed_summaries(out: str) -> str:
    """``<out>/runs.jsonl``: the ring and ddp runs' summary.json, trimmed as the matrix trims them (per-rank
    compute / communication / waiting per step: where the time goes), so they ship without runs/."""
    import glob

    from benchmarks.matrix import trim_summary

    path = os.path.join(out, "runs.jsonl")
    with open(path, "w") as f:
        for p in sorted(glob.glob(os.path.join(out, "runs", "*", "summary.json"))):
            with open(p) as g:
                rec = {"path": os.path.relpath(p, out), "summary": trim_summary(json.load(g))}
            f.write(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
    return path


def write(report: Dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    if os.path.isdir(os.path.join(out, "runs")):
        write_trimmed_summaries(out)
    write_report(report, out, markdown)


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8], help="world sizes (default 4 8)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (every implementation)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; each runs every implementation once (default 5)")
    ap.add_argument("--emulate-ms-per-sample", type=float, default=0.0,
                    help="emulated device time: sleep this many ms per sample after backward (both sides)")
    ap.add_argument("--data", choices=("mnist1d", "synthetic"), default="mnist1d")
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 workers, 30 steps, 1 round")
    ap.add_argument("--ddp", action="store_true",
                    help="also run Lightning's own DDPStrategy (algorithm=ddp) each round; report ring / ddp")
    ap.add_argument("--noise", action="store_true", help="run the ring twice per round: ring#2 / ring is the noise")
    ap.add_argument("--order-seed", type=int, default=0, help="seed of the per-round run order (default 0)")
    ap.add_argument("--output-dir", default=None, help="default benchmarks/results/ring_vs_plain/<stamp>[-quick]")
    ap.add_argument("--aggregate-only", metavar="DIR", default=None,
                    help="recompute DIR/report.{json,md} from the runs recorded in DIR/report.json; runs nothing")
    args = ap.parse_args(argv)
    if args.aggregate_only:
        with open(os.path.join(args.aggregate_only, "report.json")) as f:
            report = json.load(f)
        report["aggregate"] = aggregate(report["runs"])
        report["per_step"] = per_step_breakdown(args.aggregate_only)
        write(report, args.aggregate_only)
        print(markdown(report))
        return report
    if args.quick:
        args.workers, args.steps, args.repeats = [4], 30, 1
    if args.steps < 1 or args.repeats < 1 or args.emulate_ms_per_sample < 0:
        ap.error(f"--steps and --repeats must be >= 1 and --emulate-ms-per-sample >= 0 (got {args.steps}, "
                 f"{args.repeats}, {args.emulate_ms_per_sample})")
    if any(n < 2 or n > 64 for n in args.workers):
        ap.error(f"--workers must each be in [2, 64], got {args.workers}")
    if "OMP_NUM_THREADS" in os.environ:
        # The ring keeps OMP_NUM_THREADS when set, the plain loop sets cores // workers: make them agree.
        print(f"note: ignoring OMP_NUM_THREADS={os.environ.pop('OMP_NUM_THREADS')} so both sides use "
              f"cores // workers threads", flush=True)
    out = args.output_dir or os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else ""))
    command = "python -m benchmarks.ring_vs_plain " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    impls = ["plain", "ring"] + (["ddp"] if args.ddp else []) + ([NOISE_LABEL] if args.noise else [])
    num_samples = dataset_size(args.steps, max(args.workers))
    load_arrays(args.data, num_samples)  # generate and cache MNIST-1D once, before any timing

    runs: List[Dict[str, Any]] = []
    for n in args.workers:
        opts = {"steps": args.steps, "emulate_ms_per_sample": args.emulate_ms_per_sample, "data": args.data,
                "num_samples": num_samples, "workers": n}
        for r in range(1, args.repeats + 1):
            order = shuffled(impls, f"ring_vs_plain:{args.order_seed}:{n}:{r}")
            for pos, impl in enumerate(order):
                print(f"[ring_vs_plain] N={n} round {r}/{args.repeats} ({pos + 1}/{len(order)}): {impl} "
                      f"({args.steps} steps)", flush=True)
                algorithm = "ring" if impl == NOISE_LABEL else impl
                res = run_plain(opts) if impl == "plain" else run_ring(
                    opts, os.path.join(out, "runs", f"{impl.replace('#', '_')}_N{n}_round{r}"), algorithm=algorithm)
                res.pop("summary", None)  # the run directory is not committed; samples and seconds are the record
                runs.append({"workers": n, "round": r, "position": pos, "impl": impl, **res})
                print(f"[ring_vs_plain] {impl}: {res['throughput']:.0f} samples/s "
                      f"({res['samples']} samples in {res['seconds']:.2f} s)", flush=True)

    import horovod
    import lightning
    import torch

    report = {
        "command": command,
        "what_is_timed": __doc__[__doc__.index("What is timed"):__doc__.index("Throughput =")].strip(),
        "throughput_definition": "samples of all workers / rank 0's timed seconds; ratios per round, then median and "
                                 "95% bootstrap interval over rounds (benchmarks/stats.py)",
        "settings": {"workers": args.workers, "implementations": impls, "batch_per_worker": BATCH, "steps": args.steps,
                     "repeats": args.repeats, "order_seed": args.order_seed,
                     "model": f"mlp 40-{'-'.join(map(str, HIDDEN))}-10", "optimizer": f"SGD lr={LR} momentum={MOMENTUM}",
                     "data": args.data, "data_num_samples": num_samples, "straggler": "none",
                     "emulated_device_ms_per_sample": args.emulate_ms_per_sample,
                     "torch_threads_per_worker": {str(n): max(1, (os.cpu_count() or 1) // n) for n in args.workers},
                     "quick": args.quick, "targets": {"ring/plain": TARGET, "ring/ddp": DDP_TARGET}},
        "environment": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                        "lightning": lightning.__version__, "horovod": horovod.__version__},
        "runs": runs,
    }
    report["aggregate"] = aggregate(runs)
    write(report, out)  # writes runs.jsonl first
    report["per_step"] = per_step_breakdown(out)
    write(report, out)
    print(markdown(report))
    for n, cell in report["aggregate"].items():
        for name, target in (("ring/plain", TARGET), ("ring/ddp", DDP_TARGET)):
            if name in cell["ratios"]:
                med = cell["ratios"][name]["median"]
                print(f"N={n}: {name} = {med:.3f} (target >= {target}: {'met' if med >= target else 'NOT met'})")
    print(f"results: {out}", flush=True)
    return report


if __name__ == "__main__":
    main()
