"""``dpar`` against ``ring`` with no, a transient and a permanent straggler, side by side in one invocation.

    .venv/bin/python -m benchmarks.dpar_vs_ring [--quick] [--seeds N] [--epochs E] [--target-acc A]

Setting: 4 Horovod workers (Gloo on loopback), MLP 40-256-256-10 on MNIST-1D (10000 samples, 80% train),
SGD lr 0.05 momentum 0.9, batch 32 per worker -> 62 steps per epoch, 3 epochs (186 steps; --quick: 1
epoch, 1 seed), validation twice per epoch. Device time is EMULATED: every rank sleeps factor x 2 ms
per sample after backward (straggler.device_ms_per_sample=2.0), plus (factor - 1) x its real compute.
dpar uses conf/algorithm/dpar.yaml unchanged (window 20 steps, slow_ratio 1.5, strikeout 5.0 x 3 windows,
readmit 1.2 x 2 windows, data_penalty 0.5). Scenarios:

  (a) none:      no straggler (straggler=none);
  (b) transient: rank 3 is 4x slow from step total/3 to 2 total/3 (end exclusive; its own step count);
  (c) static:    rank 3 is 10x slow for the whole run (straggler=static, factors [1, 1, 1, 10]).

Runs alternate ring, dpar for every (scenario, seed), so drift of the machine hits both alike.

Figures per run come from summary.json: throughput = ``throughput_samples_per_s`` (train_samples / wall_s,
validation included; train_samples counts only samples whose gradients reached the model, so an
excluded rank's discarded local steps and passed-over batches do not count), time to target = first
validation at or above the target accuracy (``time_to_target_s``), final accuracy = last validation
(``val_acc``), dpar transitions = ``events`` of kind ``transition``.
Per scenario (median over seeds): throughput ratio dpar / ring; time to target dpar / ring and the
speed-up ring / dpar; accuracy difference in points against the STRAGGLER-FREE ring of scenario (a).
Targets (from the issue): (a) dpar throughput >= 0.97 x ring; (b), (c) dpar throughput >= 1.5 x ring,
time-to-target speed-up (ring / dpar) >= 1.5, and |dpar final acc - straggler-free ring acc| <= 1 point.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKERS, BATCH, DEVICE_MS, NUM_SAMPLES = 4, 32, 2.0, 10000
STEPS_PER_EPOCH = (int(0.8 * NUM_SAMPLES) // WORKERS) // BATCH  # drop_last=True: 62
EPOCHS, QUICK_EPOCHS, TARGET_ACC, QUICK_TARGET_ACC = 3, 1, 0.45, 0.30
SCENARIOS = ("none", "transient", "static")
SCENARIO_LABEL = {"none": "(a) none", "transient": "(b) transient 4x", "static": "(c) static 10x"}
TARGETS = {"none_throughput_ratio_min": 0.97, "straggler_throughput_ratio_min": 1.5,
           "straggler_ttt_speedup_min": 1.5, "straggler_acc_points_max": 1.0}


def straggler_overrides(scenario: str, total_steps: int) -> List[str]:
    if scenario == "none":
        return ["straggler=none"]
    if scenario == "transient":
        start, end = total_steps // 3, (2 * total_steps) // 3
        return ["straggler=transient", f"straggler.events=[{{rank:3,factor:4.0,start_step:{start},end_step:{end}}}]"]
    if scenario == "static":
        return ["straggler=static", "straggler.factors=[1.0,1.0,1.0,10.0]"]
    raise ValueError(scenario)


def describe_scenario(scenario: str, total_steps: int) -> str:
    if scenario == "none":
        return "no straggler"
    if scenario == "transient":
        return f"rank 3 x4.0 for steps {total_steps // 3}..{(2 * total_steps) // 3 - 1} of {total_steps}"
    return "rank 3 x10.0 for the whole run (factors [1, 1, 1, 10])"


def run_one(algo: str, scenario: str, seed: int, epochs: int, target_acc: float, out: str) -> Dict[str, Any]:
    import lightning_straggler.config  # noqa: F401  (registers the group schemas before composing)
    from hydra import compose, initialize_config_dir

    from lightning_straggler.train import train

    total = epochs * STEPS_PER_EPOCH
    overrides = [f"algorithm={algo}"] + straggler_overrides(scenario, total) + [
        f"straggler.device_ms_per_sample={DEVICE_MS}", "model=mlp", "data=mnist1d", f"data.num_samples={NUM_SAMPLES}",
        f"data.batch_size={BATCH}", f"trainer.devices={WORKERS}", "trainer.accelerator=cpu",
        f"trainer.max_epochs={epochs}", "trainer.max_steps=-1", "trainer.val_check_interval=0.5",
        "trainer.enable_progress_bar=false", "profiler.plot=false", f"seed={seed}", f"target_acc={target_acc}",
        f"output_dir={out}",
    ]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    s = train(cfg)
    ranks = {int(k): v for k, v in s["per_rank"].items()}
    transitions = [{k: e.get(k) for k in ("step", "rank", "from_state", "to_state", "ratio", "keep_cost",
                                          "exclude_cost", "reason", "discarded_local_steps") if k in e}
                   for e in s["events"] if e.get("kind") == "transition"]
    counted = sum(int(r["samples"]) for r in ranks.values())
    return {
        "algo": algo, "scenario": scenario, "seed": seed, "epochs": epochs, "total_steps": total,
        "throughput": s["throughput_samples_per_s"], "time_to_target_s": s["time_to_target_s"],
        "val_acc": s["val_acc"], "wall_s": s["wall_s"], "launch_s": s["launch_s"],
        "train_samples": s["train_samples"],
        # per-rank samples the profiler recorded minus train_samples: excluded ranks' discarded local steps
        "discarded_samples": counted - s["train_samples"],
        "rank_steps": [ranks[r]["steps"] for r in sorted(ranks)],
        "rank_samples": [ranks[r]["samples"] for r in sorted(ranks)],
        "rank_compute_p50_ms": [1e3 * ranks[r]["compute_s"]["p50"] for r in sorted(ranks)],
        "val_history": [(round(v["elapsed_s"], 2), v["step"], round(v["val_acc"], 4)) for v in s["val_history"]],
        "transitions": transitions,
        "other_events": sorted({e.get("kind") for e in s["events"] if e.get("kind") != "transition"}),
        "emulated": s.get("emulated"),
        "summary": os.path.join(out, "summary.json"),
    }


def med(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def transitions_text(ts: List[Dict[str, Any]]) -> str:
    if not ts:
        return "none"
    return "; ".join(f"r{t['rank']} {t['from_state']}->{t['to_state']} @{t['step']} (x{t['ratio']:.2f})" for t in ts)


def aggregate(runs: List[Dict[str, Any]], scenario: str, seeds: int) -> Dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    base = [r for r in ok if r["scenario"] == "none" and r["algo"] == "ring"]
    base_acc = med(r["val_acc"] for r in base)
    row: Dict[str, Any] = {"scenario": scenario, "straggler_free_ring_val_acc": base_acc}
    for algo in ("ring", "dpar"):
        rs = [r for r in ok if r["scenario"] == scenario and r["algo"] == algo]
        row[algo] = {"runs": len(rs), "throughput": med(r["throughput"] for r in rs),
                     "time_to_target_s": med(r["time_to_target_s"] for r in rs),
                     "reached_target": f"{sum(r['time_to_target_s'] is not None for r in rs)}/{len(rs)}",
                     "val_acc": med(r["val_acc"] for r in rs), "wall_s": med(r["wall_s"] for r in rs)}
    g, d = row["ring"], row["dpar"]
    row["throughput_ratio_dpar_over_ring"] = (d["throughput"] / g["throughput"]
                                              if d["throughput"] and g["throughput"] else None)
    row["ttt_ratio_dpar_over_ring"] = (d["time_to_target_s"] / g["time_to_target_s"]
                                       if d["time_to_target_s"] and g["time_to_target_s"] else None)
    row["ttt_speedup_ring_over_dpar"] = (g["time_to_target_s"] / d["time_to_target_s"]
                                         if d["time_to_target_s"] and g["time_to_target_s"] else None)
    row["dpar_acc_diff_points_vs_straggler_free_ring"] = (100 * (d["val_acc"] - base_acc)
                                                          if d["val_acc"] is not None and base_acc is not None else None)
    row["ring_acc_diff_points_vs_straggler_free_ring"] = (100 * (g["val_acc"] - base_acc)
                                                          if g["val_acc"] is not None and base_acc is not None else None)
    complete = g["runs"] == seeds and d["runs"] == seeds
    tr = row["throughput_ratio_dpar_over_ring"]
    if scenario == "none":
        row["meets"] = {"throughput_within_3pct": bool(complete and tr is not None
                                                       and tr >= TARGETS["none_throughput_ratio_min"])}
    else:
        sp, ad = row["ttt_speedup_ring_over_dpar"], row["dpar_acc_diff_points_vs_straggler_free_ring"]
        # dpar reaching the target when ring does not would be an unbounded speed-up: count it as met
        reached_only_dpar = d["time_to_target_s"] is not None and g["time_to_target_s"] is None
        row["meets"] = {
            "throughput_1_5x": bool(complete and tr is not None and tr >= TARGETS["straggler_throughput_ratio_min"]),
            "time_to_target_1_5x": bool(complete and ((sp is not None and sp >= TARGETS["straggler_ttt_speedup_min"])
                                                      or reached_only_dpar)),
            "acc_within_1_point": bool(complete and ad is not None and abs(ad) <= TARGETS["straggler_acc_points_max"]),
        }
    row["dpar_transitions_per_seed"] = [transitions_text(r["transitions"]) for r in ok
                                        if r["scenario"] == scenario and r["algo"] == "dpar"]
    return row


def runs_table(runs: List[Dict[str, Any]], target_acc: float) -> str:
    out = [f"| scenario | seed | algo | samples/s | time to {target_acc} (s) | final val acc | wall (s) | train samples "
           "| discarded | steps per rank | dpar transitions (rank from->to @step (ratio)) |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in runs:
        if "error" in r:
            out.append(f"| {SCENARIO_LABEL[r['scenario']]} | {r['seed']} | {r['algo']} | FAILED: {r['error'][:80]} "
                       "| | | | | | | |")
            continue
        tt = f"{len(r['transitions'])}: {transitions_text(r['transitions'])}" if r["algo"] == "dpar" else "-"
        out.append(f"| {SCENARIO_LABEL[r['scenario']]} | {r['seed']} | {r['algo']} | {r['throughput']:.0f} "
                   f"| {fmt(r['time_to_target_s'])} | {fmt(r['val_acc'], '.4f')} | {r['wall_s']:.1f} | {r['train_samples']} "
                   f"| {r['discarded_samples']} | {r['rank_steps']} | {tt} |")
    return "\n".join(out)


def scenario_table(rows: List[Dict[str, Any]], target_acc: float) -> str:
    out = [f"| scenario | ring samples/s | dpar samples/s | dpar/ring throughput | ring time to {target_acc} (s) "
           f"| dpar time to {target_acc} (s) | dpar/ring time | ring/dpar speed-up | ring acc | dpar acc "
           "| dpar - straggler-free ring (pts) | targets |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g, d = r["ring"], r["dpar"]
        met = ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in r["meets"].items())
        out.append(f"| {SCENARIO_LABEL[r['scenario']]} | {fmt(g['throughput'], '.0f')} | {fmt(d['throughput'], '.0f')} "
                   f"| **{fmt(r['throughput_ratio_dpar_over_ring'], '.3f')}** | {fmt(g['time_to_target_s'])} ({g['reached_target']}) "
                   f"| {fmt(d['time_to_target_s'])} ({d['reached_target']}) | {fmt(r['ttt_ratio_dpar_over_ring'], '.3f')} "
                   f"| **{fmt(r['ttt_speedup_ring_over_dpar'], '.2f')}** | {fmt(g['val_acc'], '.4f')} | {fmt(d['val_acc'], '.4f')} "
                   f"| **{fmt(r['dpar_acc_diff_points_vs_straggler_free_ring'], '+.2f')}** | {met} |")
    return "\n".join(out)


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: {QUICK_EPOCHS} epoch, 1 seed, target accuracy {QUICK_TARGET_ACC}")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per scenario (default 1)")
    ap.add_argument("--epochs", type=int, default=None, help=f"epochs per run (default {EPOCHS}; quick {QUICK_EPOCHS})")
    ap.add_argument("--target-acc", type=float, default=None,
                    help=f"target validation accuracy (default {TARGET_ACC}; quick {QUICK_TARGET_ACC})")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--output", default=None,
                    help="JSON report (default benchmarks/results/dpar_vs_ring.json; quick: dpar_vs_ring_quick.json)")
    args = ap.parse_args(argv)
    if args.output is None:
        args.output = os.path.join(RESULTS, "dpar_vs_ring_quick.json" if args.quick else "dpar_vs_ring.json")
    seeds = args.seeds or 1
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else EPOCHS)
    target_acc = args.target_acc if args.target_acc is not None else (QUICK_TARGET_ACC if args.quick else TARGET_ACC)
    if seeds < 1 or epochs < 1 or not 0 < target_acc <= 1:
        ap.error("--seeds and --epochs must be >= 1, --target-acc in (0, 1]")
    scenarios = [s for s in SCENARIOS if s in args.scenarios]
    if "none" not in scenarios:
        scenarios.insert(0, "none")  # the straggler-free ring is the accuracy reference
    total = epochs * STEPS_PER_EPOCH
    run_root = os.path.join(RESULTS, "dpar", time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else ""))
    print(f"[dpar_vs_ring] {WORKERS} workers, MNIST-1D {NUM_SAMPLES}, batch {BATCH}/worker, {epochs} epoch(s) = "
          f"{total} steps, target acc {target_acc}, {seeds} seed(s); device time EMULATED "
          f"({DEVICE_MS} ms/sample x factor, sleep after backward); runs under {run_root}", flush=True)
    started = time.time()

    runs: List[Dict[str, Any]] = []
    for scenario in scenarios:
        for seed in range(seeds):
            for algo in ("ring", "dpar"):  # alternate
                out = os.path.join(run_root, f"{scenario}_seed{seed}_{algo}")
                t0 = time.time()
                try:
                    r = run_one(algo, scenario, seed, epochs, target_acc, out)
                except Exception as e:  # record and go on: the report says which run failed and how
                    traceback.print_exc()
                    r = {"algo": algo, "scenario": scenario, "seed": seed, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc(), "output_dir": out}
                    print(f"[dpar_vs_ring] {SCENARIO_LABEL[scenario]} seed={seed} {algo}: FAILED after "
                          f"{time.time() - t0:.0f} s: {r['error']}", flush=True)
                    runs.append(r)
                    continue
                runs.append(r)
                extra = (f", {len(r['transitions'])} transitions: {transitions_text(r['transitions'])}, "
                         f"discarded {r['discarded_samples']} samples" if algo == "dpar" else "")
                print(f"[dpar_vs_ring] {SCENARIO_LABEL[scenario]} seed={seed} {algo:4s}: {r['throughput']:.0f} samples/s, "
                      f"time to {target_acc} {fmt(r['time_to_target_s'])} s, val_acc {fmt(r['val_acc'], '.4f')}, "
                      f"wall {r['wall_s']:.1f} s + launch {r['launch_s']:.1f} s, steps/rank {r['rank_steps']}{extra}  "
                      f"[{time.time() - started:.0f} s elapsed, load avg {os.getloadavg()[0]:.1f}]", flush=True)

    rows = [aggregate(runs, s, seeds) for s in scenarios]
    report = {
        "what": __doc__.strip(),
        "emulated": f"device time EMULATED: every rank sleeps factor x {DEVICE_MS} ms per sample after backward, "
                    "plus (factor - 1) x its real compute of the batch; factor 1 unless the scenario says otherwise",
        "scenarios": {s: describe_scenario(s, total) for s in scenarios},
        "aggregation": "median over seeds (time to target: over seeds that reached it, count shown); ratios of "
                       "those medians; acc diff = 100 x (dpar val_acc - straggler-free ring val_acc)",
        "targets": TARGETS, "target_acc": target_acc, "workers": WORKERS, "batch_per_worker": BATCH,
        "epochs": epochs, "steps_per_epoch": STEPS_PER_EPOCH, "total_steps": total, "seeds": seeds,
        "quick": args.quick, "total_runtime_s": time.time() - started, "run_root": run_root,
        "rows": rows, "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2, default=str)

    print(f"\n## dpar vs ring: {WORKERS} workers, MNIST-1D, MLP 40-256-256-10, batch {BATCH}/worker, {epochs} epoch(s) "
          f"({total} steps), device time EMULATED ({DEVICE_MS} ms/sample x slowdown factor); median of {seeds} seed(s)\n")
    for s in scenarios:
        print(f"- {SCENARIO_LABEL[s]}: {describe_scenario(s, total)}")
    print("\n### Runs\n")
    print(runs_table(runs, target_acc))
    print("\n### Per scenario\n")
    print(scenario_table(rows, target_acc))
    print()
    for r in rows:
        for k, v in r["meets"].items():
            print(f"- {SCENARIO_LABEL[r['scenario']]}: {k}: {'met' if v else 'NOT met'}")
    if any("error" in r for r in runs):
        print("\nSome runs FAILED; see 'error' / 'traceback' in the JSON.")
    print(f"\nResults: {args.output}; runs under {run_root}; total {time.time() - started:.0f} s", flush=True)
    return report


if __name__ == "__main__":
    main()
