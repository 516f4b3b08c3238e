"""Bare Horovod on 4 (or 8) shaped hosts (one worker each): the pairs of a step at once on their process
sets, one pair alone, and the world, each a 4.3 MB float32 all-reduce started right after a one-value world
all-reduce.

    .venv/bin/python -m benchmarks.shaped_pairs_probe [--rate-mbit 100] [--repeats 8] [--hosts 4]
        [--sets step|butterfly] [--cycle-time-ms MS] [--out DIR]

``--sets step`` (default) registers only the pairs {0,1}, {2,3}, ... that run; ``butterfly`` registers
every pair of dssync's butterfly schedule in its partition order (dssync-aligned's sets: each rank also
belongs to idle ones) and repeat i runs partition i mod log2(hosts). ``--cycle-time-ms`` sets
HOROVOD_CYCLE_TIME (default: Horovod's own, 1 ms).

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


def _partitions(hosts: int, sets: str):
    """The step's pairs per partition: [[(a, b), ...], ...]."""
    if sets == "step":
        return [[(a, a + 1) for a in range(0, hosts, 2)]]
    distances = [1 << k for k in range(hosts.bit_length() - 1)]
    return [[(a, a ^ d) for a in range(hosts) if a < a ^ d] for d in distances]


def _direct_groups(hvd, partitions, hosts):
    """torch.distributed Gloo groups for the pairs (a TCPStore on rank 0's Horovod rendezvous address, its
    port chosen by the OS and broadcast through Horovod): connections of their own, no Horovod cycle."""
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("HOROVOD_GLOO_IFACE", "lo"))
    addr, rank, timeout = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], hvd.rank(), datetime.timedelta(seconds=60)
    store = dist.TCPStore(addr, 0, hosts, True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
    port = hvd.broadcast_object(store.port if store is not None else None, root_rank=0, name="store.port")
    if store is None:
        store = dist.TCPStore(addr, port, hosts, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=hosts, timeout=timeout)
    return {pair: dist.new_group(list(pair)) for part in partitions for pair in part}


def _worker(repeats: int, hosts: int, sets: str, align_set: str, settle_s: float, aligns: int, direct: bool) -> None:
    import horovod.torch as hvd
    import torch

    from lightning_straggler.comm.horovod import _wait

    torch.set_num_threads(1)
    partitions = _partitions(hosts, sets)
    process_sets = {pair: hvd.ProcessSet(list(pair)) for part in partitions for pair in part}
    # "last": the one-value alignment on a set of all ranks registered after the pairs, so it completes at
    # the end of a background cycle (after every pair's turn) instead of at its start (the world's turn)
    align_on = hvd.ProcessSet(list(range(hosts))) if align_set == "last" else None
    hvd.init(process_sets=list(process_sets.values()) + ([align_on] if align_on is not None else []))
    rank = hvd.rank()
    tensor = torch.ones(FLOATS)
    direct_groups = _direct_groups(hvd, partitions, hosts) if direct else {}

    def mine(i):
        return next(process_sets[pair] for pair in partitions[i % len(partitions)] if rank in pair)

    def first_pair(i):
        return process_sets[partitions[i % len(partitions)][0]]

    def allreduce(x, name, process_set=None):
        extra = {"process_set": process_set} if process_set is not None else {}
        return _wait(hvd, hvd.allreduce_async(x, op=hvd.Sum, name=name, **extra))

    times = {}
    for mode in MODES + (("direct",) if direct else ()):
        rows = []
        for i in range(repeats):
            for a in range(aligns):
                allreduce(torch.zeros(1), f"align{a}.{mode}.{i}", align_on)
            if settle_s:
                time.sleep(settle_s)
            start = time.time()
            if mode == "direct":
                import torch.distributed as dist

                pair = next(p for p in partitions[i % len(partitions)] if rank in p)
                dist.all_reduce(tensor, group=direct_groups[pair])
            elif mode.startswith("pairs"):
                allreduce(tensor, f"{mode}.{i}", mine(i))
            elif mode == "one_pair" and first_pair(i).included():
                allreduce(tensor, f"{mode}.{i}", first_pair(i))
            elif mode == "world":
                allreduce(tensor, f"{mode}.{i}")
            rows.append((start, time.time()))
        times[mode] = rows[2:]  # the first two: warm-up
    allreduce(torch.zeros(1), "done")  # a rank that shut down while others still transfer would abort them
    print("RESULT " + json.dumps({"rank": rank, "times": times}), flush=True)
    hvd.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "_worker"])
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=4, choices=[4, 8])
    parser.add_argument("--sets", default="step", choices=["step", "butterfly"])
    parser.add_argument("--cycle-time-ms", type=float, default=None)
    parser.add_argument("--align-set", default="world", choices=["world", "last"])
    parser.add_argument("--settle-ms", type=float, default=0.0)
    parser.add_argument("--aligns", type=int, default=1)
    parser.add_argument("--direct", action="store_true", help="also the pairs on torch.distributed Gloo groups")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "shaped", time.strftime("%Y%m%d-pairs-probe")))
    args = parser.parse_args()
    if args.mode == "_worker":
        _worker(args.repeats, args.hosts, args.sets, args.align_set, args.settle_ms / 1000, args.aligns,
                args.direct)
        return 0
    from benchmarks.network import LinkShape, NamespacedHosts, launch_workers

    env = {"OMP_NUM_THREADS": "1"}
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(args.cycle_time_ms)
    with NamespacedHosts(args.hosts, LinkShape(args.rate_mbit, 0.0)) as net:
        outs = launch_workers(net, args.hosts, [sys.executable, "-m", "benchmarks.shaped_pairs_probe", "_worker",
                                                "--repeats", str(args.repeats), "--hosts", str(args.hosts), "--sets",
                                                args.sets, "--align-set", args.align_set, "--settle-ms",
                                                str(args.settle_ms), "--aligns", str(args.aligns)]
                                                + (["--direct"] if args.direct else []), tempfile.mkdtemp(), 600, extra_env=env)
    ranks = [json.loads([l for l in o.splitlines() if l.startswith("RESULT ")][-1][7:])["times"] for o in outs]
    summary = {}
    for mode in MODES + (("direct",) if args.direct else ()):
        seconds = {r: [end - start for start, end in ranks[r][mode]] for r in range(args.hosts)}
        entry = {"median_s_per_rank": {r: statistics.median(v) for r, v in seconds.items()}}
        if mode.startswith("pairs") or mode == "direct":  # pair {2,3}'s end minus pair {0,1}'s: ~0 overlapped, ~a transfer serialised
            entry["end_offset_s"] = [ranks[2][mode][i][1] - ranks[0][mode][i][1] for i in range(len(ranks[0][mode]))]
            # the last rank's end minus the first's: ~0 when every pair overlapped
            entry["end_spread_s"] = [max(ranks[r][mode][i][1] for r in range(args.hosts))
                                     - min(ranks[r][mode][i][1] for r in range(args.hosts))
                                     for i in range(len(ranks[0][mode]))]
        summary[mode] = entry
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.shaped_pairs_probe " + " ".join(sys.argv[1:])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "rate_mbit": args.rate_mbit, "hosts": args.hosts, "sets": args.sets,
                   "align_set": args.align_set,                   "cycle_time_ms": args.cycle_time_ms, "floats": FLOATS, "summary": summary,
                   "times_per_rank": ranks}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
