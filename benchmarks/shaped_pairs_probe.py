"""Bare Horovod on 4 shaped hosts (one worker each): two pairs at once on their process sets, one pair
alone, and the world, each a 4.3 MB float32 all-reduce started right after a one-value world all-reduce.

    .venv/bin/python -m benchmarks.shaped_pairs_probe [--rate-mbit 100] [--repeats 8] [--out DIR]

Waits with the project's sleeping wait (comm/horovod.py), as the strategies do. Per mode, every rank's
(start, end) wall times of each repeat after the first two (one machine: one clock), so whether the two
pairs overlapped can be read off. Writes OUT/results.json. A probe for README's "Over shaped links", not a
benchmark with seeds: no interval.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("pairs", "one_pair", "world", "pairs2")
FLOATS = 1_080_000  # 4.3 MB, the shaped benchmark's MLP gradients


def _worker(repeats: int) -> None:
    import horovod.torch as hvd
    import torch

    from lightning_straggler.comm.horovod import _wait

    torch.set_num_threads(1)
    ps01, ps23 = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])
    hvd.init(process_sets=[ps01, ps23])
    rank = hvd.rank()
    mine = ps01 if rank < 2 else ps23
    tensor = torch.ones(FLOATS)

    def allreduce(x, name, process_set=None):
        extra = {"process_set": process_set} if process_set is not None else {}
        return _wait(hvd, hvd.allreduce_async(x, op=hvd.Sum, name=name, **extra))

    times = {}
    for mode in MODES:
        rows = []
        for i in range(repeats):
            allreduce(torch.zeros(1), f"align.{mode}.{i}")
            start = time.time()
            if mode.startswith("pairs"):
                allreduce(tensor, f"{mode}.{i}", mine)
            elif mode == "one_pair" and rank < 2:
                allreduce(tensor, f"{mode}.{i}", ps01)
            elif mode == "world":
                allreduce(tensor, f"{mode}.{i}")
            rows.append((start, time.time()))
        times[mode] = rows[2:]  # the first two: warm-up
    print("RESULT " + json.dumps({"rank": rank, "times": times}), flush=True)
    hvd.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "_worker"])
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "shaped", time.strftime("%Y%m%d-pairs-probe")))
    args = parser.parse_args()
    if args.mode == "_worker":
        _worker(args.repeats)
        return 0
    from benchmarks.network import LinkShape, NamespacedHosts, launch_workers

    with NamespacedHosts(4, LinkShape(args.rate_mbit, 0.0)) as net:
        outs = launch_workers(net, 4, [sys.executable, "-m", "benchmarks.shaped_pairs_probe", "_worker", "--repeats",
                                       str(args.repeats)], tempfile.mkdtemp(), 600, extra_env={"OMP_NUM_THREADS": "1"})
    ranks = [json.loads([l for l in o.splitlines() if l.startswith("RESULT ")][-1][7:])["times"] for o in outs]
    summary = {}
    for mode in MODES:
        seconds = {r: [end - start for start, end in ranks[r][mode]] for r in range(4)}
        entry = {"median_s_per_rank": {r: statistics.median(v) for r, v in seconds.items()}}
        if mode.startswith("pairs"):  # pair {2,3}'s end minus pair {0,1}'s: ~0 overlapped, ~a transfer serialised
            entry["end_offset_s"] = [ranks[2][mode][i][1] - ranks[0][mode][i][1] for i in range(len(ranks[0][mode]))]
        summary[mode] = entry
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.shaped_pairs_probe " + " ".join(sys.argv[1:])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "rate_mbit": args.rate_mbit, "floats": FLOATS, "summary": summary,
                   "times_per_rank": ranks}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
