"""Plain TCP between shaped hosts, no Horovod, no Gloo: the pairs of dssync's butterfly exchanging 4.3 MB each
way at once, as a control for ``benchmarks.shaped_pairs_probe`` (do concurrent pairs on separate hosts slow
each other down on these links, or is it the communication library?).

    .venv/bin/python -m benchmarks.shaped_tcp_pairs_probe [--hosts 8] [--rate-mbit 100] [--repeats 24] [--out DIR]

One worker per namespaced host (benchmarks/network.py); one TCP connection per butterfly partner, opened
once; repeat i starts at a shared wall-clock time (one machine: one clock) and runs partition i mod log2(hosts):
every worker sends its 4.3 MB to its partner on a thread while it receives the partner's. Writes
OUT/results.json (every worker's (start, end) per repeat and a summary). A probe: no seeds, no interval.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBYTES = 4_320_000  # the shaped benchmark's MLP: 1.08 M float32
PORT = 29650
GAP_S = 1.2  # between repeat starts: longer than a slow exchange


def _partner_distances(hosts: int) -> list:
    return [1 << k for k in range(hosts.bit_length() - 1)]


def _worker(rank: int, hosts: int, addrs: list, start_at: float, repeats: int) -> None:
    distances = _partner_distances(hosts)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((addrs[rank], PORT))
    server.listen(len(distances))
    conns = {}
    for d in distances:  # the lower rank connects
        peer = rank ^ d
        if rank < peer:
            deadline = time.monotonic() + 30
            while True:
                try:
                    conn = socket.create_connection((addrs[peer], PORT), timeout=30)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            conn.sendall(rank.to_bytes(4, "little"))
            conns[peer] = conn
    server.settimeout(30)
    while len(conns) < len(distances):
        conn, _ = server.accept()
        conns[int.from_bytes(conn.recv(4), "little")] = conn
    payload = b"x" * NBYTES
    rows = []
    for i in range(repeats):
        conn = conns[rank ^ distances[i % len(distances)]]
        while time.time() < start_at + i * GAP_S:
            time.sleep(0.001)
        start = time.time()
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        got = 0
        while got < NBYTES:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise ConnectionError(f"rank {rank}: partner closed after {got} bytes")
            got += len(chunk)
        sender.join()
        rows.append((start, time.time()))
    print("RESULT " + json.dumps(rows), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "_worker"])
    parser.add_argument("--hosts", type=int, default=8, choices=[2, 4, 8])
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--addrs")
    parser.add_argument("--start-at", type=float)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "shaped",
                                                      time.strftime("%Y%m%d-tcp-pairs-probe")))
    args = parser.parse_args()
    if args.mode == "_worker":
        _worker(args.rank, args.hosts, args.addrs.split(","), args.start_at, args.repeats)
        return 0
    from benchmarks.network import LinkShape, NamespacedHosts

    with NamespacedHosts(args.hosts, LinkShape(args.rate_mbit, 0.0)) as net:
        addrs = [net.address(h) for h in range(args.hosts)]
        start_at = time.time() + 3
        procs = [net.popen(h, [sys.executable, "-m", "benchmarks.shaped_tcp_pairs_probe", "_worker", "--rank", str(h),
                               "--hosts", str(args.hosts), "--addrs", ",".join(addrs), "--start-at", str(start_at),
                               "--repeats", str(args.repeats)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
                 for h in range(args.hosts)]
        timeout = 3 + args.repeats * GAP_S + 60
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    times = [json.loads([line for line in o.splitlines() if line.startswith("RESULT ")][-1][7:]) for o in outs]
    seconds = [[end - start for start, end in times[r]] for r in range(args.hosts)]
    spread = [max(times[r][i][1] for r in range(args.hosts)) - min(times[r][i][1] for r in range(args.hosts))
              for i in range(args.repeats)]
    summary = {"median_s": statistics.median(s for row in seconds for s in row),
               "max_s": max(s for row in seconds for s in row),
               "end_spread_s": spread, "repeats_over_0_3_s_spread": sum(1 for x in spread if x > 0.3)}
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.shaped_tcp_pairs_probe " + " ".join(sys.argv[1:])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "hosts": args.hosts, "rate_mbit": args.rate_mbit, "bytes": NBYTES,
                   "summary": summary, "times_per_rank": times}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
