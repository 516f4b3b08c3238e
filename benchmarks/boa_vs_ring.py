"""``boa`` against ``ring`` on a static mix of worker speeds, side by side in one invocation.

    .venv/bin/python -m benchmarks.boa_vs_ring [--quick] [--workers 4 8] [--seeds N]

Setting: MLP 40-256-256-10 on MNIST-1D, SGD lr 0.05 momentum 0.9, device time EMULATED
(straggler.device_ms_per_sample=2.0) with static slowdown factors 1.0 / 1.667 / 3.333 per rank, i.e.
relative throughput 1.0 / 0.6 / 0.3 (GTX 1080 / 1060 / Quadro M2000): a rank with factor f sleeps
f x 2 ms per sample after backward, plus (f - 1) x its real compute. Same global batch on both sides:
ring 32 per worker, boa global_batch = 32 x N (boa re-plans every 10 steps). Run length: 4 epochs at
4 workers and the same number of optimizer steps at other N; validation twice per epoch. Runs
alternate ring, boa for every (workers, seed), so drift of the machine hits both.

Throughput = summary.json ``throughput_samples_per_s`` (train_samples / wall_s, validation included).

IDEAL throughput (per ring run, then median over seeds): the sum of the workers' own sample rates,
less communication: ideal = G / (G / sum_i rate_i + t_comm), with G the global batch,
rate_i = per_rank samples_i / compute_s.total_i of the RING run (compute = batch start until the
gradients are ready, emulated device time included) and t_comm = min over ranks of per_rank
comm_s.mean of the ring run (all-reduce transfer time per step, waiting excluded). The ring run is
used rather than separate 1-worker jobs because it measures every rank under the same emulation AND
the same CPU sharing (N processes on the machine's cores) as the runs compared, and costs no extra
launches. boa's efficiency = boa throughput / ideal.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BATCH, DEVICE_MS, TARGET_ACC, EPOCHS_AT_4 = 32, 2.0, 0.45, 4
FAST, MID, SLOW = 1.0, 1.667, 3.333  # relative throughput 1.0 / 0.6 / 0.3
TARGETS = {"ratio": 1.23, "acc_points": 1.0, "efficiency": 0.9}


def speed_mix(n: int) -> List[float]:
    """Slowdown factor per rank: 4 -> [1, 1, 1.667, 3.333]; 8 -> [1, 1, 1, 1.667 x3, 3.333 x2]."""
    slow = max(1, n // 4)
    mid = max(1, (n - slow) // 2)
    return [FAST] * (n - slow - mid) + [MID] * mid + [SLOW] * slow


def run_one(algo: str, n: int, seed: int, epochs: int, out: str) -> Dict[str, Any]:
    import lightning_straggler.config  # noqa: F401  (registers the group schemas before composing)
    from hydra import compose, initialize_config_dir

    from lightning_straggler.train import train

    algo_args = ["algorithm=ring"] if algo == "ring" else ["algorithm=boa", f"algorithm.global_batch={BATCH * n}"]
    overrides = algo_args + [
        "straggler=static", f"straggler.factors=[{','.join(map(str, speed_mix(n)))}]",
        f"straggler.device_ms_per_sample={DEVICE_MS}", "model=mlp", "data=mnist1d", f"data.batch_size={BATCH}",
        f"trainer.devices={n}", "trainer.accelerator=cpu", f"trainer.max_epochs={epochs}", "trainer.max_steps=-1",
        "trainer.val_check_interval=0.5", "trainer.enable_progress_bar=false", "profiler.plot=false",
        f"seed={seed}", f"target_acc={TARGET_ACC}", f"output_dir={out}",
    ]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    s = train(cfg)
    ranks = [s["per_rank"][k] for k in sorted(s["per_rank"], key=int)]
    rates = [r["samples"] / r["compute_s"]["total"] for r in ranks]
    t_comm = min(r["comm_s"]["mean"] for r in ranks)
    G = BATCH * n
    rebalances = [e for e in s["events"] if e.get("kind") == "rebalance"]
    allocs = [e for e in s["events"] if e.get("kind") == "allocation"]
    r0 = ranks[0]
    return {
        "algo": algo, "workers": n, "seed": seed, "throughput": s["throughput_samples_per_s"],
        "val_acc": s["val_acc"], "time_to_target_s": s["time_to_target_s"], "wall_s": s["wall_s"],
        "launch_s": s["launch_s"], "train_samples": s["train_samples"], "steps": r0["steps"],
        # share of wall_s inside timed steps on rank 0 (the rest: validation, Lightning between steps)
        "in_step_share": (r0["compute_s"]["total"] + r0["comm_s"]["total"] + r0["wait_s"]["total"]) / s["wall_s"],
        "rank_rates": rates, "rank_samples": [r["samples"] for r in ranks], "t_comm_s": t_comm,
        "ideal": G / (G / sum(rates) + t_comm),
        "initial_allocation": allocs[0]["batch_sizes"] if allocs else None,
        "rebalances": len(rebalances),
        "rebalance_steps": [e["from_step"] for e in rebalances],
        "final_allocation": rebalances[-1]["batch_sizes"] if rebalances else None,
        "final_models": rebalances[-1].get("models") if rebalances else None,
        "summary": os.path.join(out, "summary.json"), "load_avg_1min_after": os.getloadavg()[0],
    }


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(runs: List[Dict[str, Any]], n: int) -> Dict[str, Any]:
    ring = [r for r in runs if r["workers"] == n and r["algo"] == "ring"]
    boa = [r for r in runs if r["workers"] == n and r["algo"] == "boa"]
    row: Dict[str, Any] = {"workers": n, "mix": speed_mix(n), "global_batch": BATCH * n}
    for name, rs in (("ring", ring), ("boa", boa)):
        row[name] = {k: med(r[k] for r in rs) for k in ("throughput", "val_acc", "time_to_target_s", "wall_s", "in_step_share")}
        row[name]["reached_target"] = f"{sum(r['time_to_target_s'] is not None for r in rs)}/{len(rs)}"
    row["ratio_boa_over_ring"] = row["boa"]["throughput"] / row["ring"]["throughput"]
    row["acc_diff_points"] = 100 * (row["boa"]["val_acc"] - row["ring"]["val_acc"])
    row["ideal"] = med(r["ideal"] for r in ring)
    row["ideal_rates_per_rank"] = [med(r["rank_rates"][i] for r in ring) for i in range(n)]
    row["ideal_t_comm_ms"] = 1e3 * med(r["t_comm_s"] for r in ring)
    row["ideal_from_boa_runs"] = med(r["ideal"] for r in boa)  # cross-check: same formula on boa's own runs
    row["efficiency"] = row["boa"]["throughput"] / row["ideal"]
    row["boa_final_allocation"] = [r["final_allocation"] for r in boa]  # one per seed
    row["boa_rebalances"] = [r["rebalances"] for r in boa]
    row["meets"] = {"ratio": row["ratio_boa_over_ring"] >= TARGETS["ratio"],
                    "acc_points": abs(row["acc_diff_points"]) <= TARGETS["acc_points"],
                    "efficiency": row["efficiency"] >= TARGETS["efficiency"]}
    return row


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| N | mix (slowdown per rank) | ring samples/s | boa samples/s | boa/ring | ideal samples/s | boa efficiency "
           f"| ring time to {TARGET_ACC} (s) | boa time to {TARGET_ACC} (s) | ring val acc | boa val acc | acc diff (pts) "
           "| boa final allocation |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g, b = r["ring"], r["boa"]
        out.append(f"| {r['workers']} | {r['mix']} | {g['throughput']:.0f} | {b['throughput']:.0f} | **{r['ratio_boa_over_ring']:.3f}** "
                   f"| {r['ideal']:.0f} | **{r['efficiency']:.3f}** | {fmt(g['time_to_target_s'])} ({g['reached_target']}) "
                   f"| {fmt(b['time_to_target_s'])} ({b['reached_target']}) | {g['val_acc']:.4f} | {b['val_acc']:.4f} "
                   f"| **{r['acc_diff_points']:+.2f}** | {' / '.join(map(str, r['boa_final_allocation']))} |")
    return "\n".join(out)


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 4 workers, 1 seed, 2 epochs at 4 workers")
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default 4 8; quick: 4)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 2; quick: 1)")
    ap.add_argument("--output", default=os.path.join(RESULTS, "boa_vs_ring.json"))
    args = ap.parse_args(argv)
    workers = args.workers or ([4] if args.quick else [4, 8])
    seeds = args.seeds or (1 if args.quick else 2)
    epochs4 = 2 if args.quick else EPOCHS_AT_4
    if min(workers) < 2 or seeds < 1:
        ap.error("--workers must be >= 2, --seeds >= 1")
    run_root = os.path.join(RESULTS, "boa", time.strftime("%Y%m%d-%H%M%S"))
    started = time.time()

    runs: List[Dict[str, Any]] = []
    for n in workers:
        epochs = max(1, round(epochs4 * n / 4))  # same number of optimizer steps at every N
        for seed in range(seeds):
            for algo in ("ring", "boa"):  # alternate
                r = run_one(algo, n, seed, epochs, os.path.join(run_root, f"N{n}_seed{seed}_{algo}"))
                runs.append(r)
                extra = (f", {r['rebalances']} rebalances, final allocation {r['final_allocation']}" if algo == "boa"
                         else f", ideal {r['ideal']:.0f} samples/s")
                print(f"[boa_vs_ring] N={n} seed={seed} {algo:4s} ({epochs} epochs, {r['steps']} steps): "
                      f"{r['throughput']:.0f} samples/s, val_acc {fmt(r['val_acc'], '.4f')}, time to {TARGET_ACC} "
                      f"{fmt(r['time_to_target_s'])} s, wall {r['wall_s']:.1f} s + launch {r['launch_s']:.1f} s{extra}"
                      f"  [{time.time() - started:.0f} s elapsed, "
                      f"load avg {os.getloadavg()[0]:.1f}]", flush=True)

    rows = [aggregate(runs, n) for n in workers]
    report = {
        "what": __doc__.strip(),
        "emulated": f"device time EMULATED: sleep of factor x {DEVICE_MS} ms per sample after backward, plus "
                    "(factor - 1) x the rank's real compute; factors per rank in rows[].mix",
        "ideal_definition": "G / (G / sum_i rate_i + t_comm); rate_i = samples_i / compute_s.total_i and t_comm = "
                            "min over ranks of comm_s.mean, both from the ring run; median over seeds",
        "aggregation": "median over seeds (time to target: over the seeds that reached it, count shown); ratio = boa / ring of those medians; acc diff = 100 x (boa - ring)",
        "targets": TARGETS, "target_acc": TARGET_ACC, "batch_per_worker": BATCH, "epochs_at_4_workers": epochs4,
        "workers": workers, "seeds": seeds, "quick": args.quick, "total_runtime_s": time.time() - started,
        "rows": rows, "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)

    print(f"\n## boa vs ring: MNIST-1D, MLP 40-256-256-10, batch 32/worker (boa: same global batch), static speed mix "
          f"1.0 / 0.6 / 0.3 (slowdown {FAST} / {MID} / {SLOW}), device time EMULATED ({DEVICE_MS} ms/sample); "
          f"median of {seeds} seed(s)\n")
    print(table(rows))
    for r in rows:
        m = r["meets"]
        print(f"- N={r['workers']}: boa/ring {r['ratio_boa_over_ring']:.3f} (target >= {TARGETS['ratio']}: "
              f"{'met' if m['ratio'] else 'NOT met'}); acc diff {r['acc_diff_points']:+.2f} pts (target within "
              f"{TARGETS['acc_points']}: {'met' if m['acc_points'] else 'NOT met'}); efficiency {r['efficiency']:.3f} "
              f"(target >= {TARGETS['efficiency']}: {'met' if m['efficiency'] else 'NOT met'}); ideal {r['ideal']:.0f} = "
              f"sum of rates {sum(r['ideal_rates_per_rank']):.0f} samples/s less t_comm {r['ideal_t_comm_ms']:.2f} ms/step "
              f"(same formula on boa's runs: {fmt(r['ideal_from_boa_runs'], '.0f')}); boa rebalances per seed "
              f"{r['boa_rebalances']}; wall share inside steps ring {r['ring']['in_step_share']:.2f} / boa "
              f"{r['boa']['in_step_share']:.2f}")
    print(f"\nResults: {args.output}; runs under {run_root}; total {time.time() - started:.0f} s", flush=True)
    return report


if __name__ == "__main__":
    main()
