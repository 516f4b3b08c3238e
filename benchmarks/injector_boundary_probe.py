"""The straggler injector's added sleep in a dpar run whose slow rank waits at boundaries (4 real Horovod
workers, rank 3 at 8x, 2 ms of device time per sample, 10-step windows, 64 steps).

    .venv/bin/python -m benchmarks.injector_boundary_probe [--out FILE]

Run with PYTHONPATH at an older checkout to compare versions (README: what the injector measures as
compute). Writes FILE (JSON): the commit, every rank's slowdown_s (sleep beyond device time), device_s, and
the run's outside-rank holds. One run, no seeds: a check of one effect, not a benchmark."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import lightning_straggler
    from lightning_straggler import DparStrategy
    from lightning_straggler.callbacks import StragglerInjector
    from lightning_straggler.policies.injection import StaticSchedule
    from tests.test_ring_multiprocess import fit, make_model

    injector = StragglerInjector(StaticSchedule([1.0, 1.0, 1.0, 8.0]), device_ms_per_sample=2.0)
    strategy = DparStrategy(window_steps=10, react_steps=0, slow_ratio=3.0, strikeout_ratio=1000.0)
    fit(make_model(), strategy, 4, 8, 64, callbacks=[injector])
    code = os.path.dirname(os.path.dirname(os.path.abspath(lightning_straggler.__file__)))
    commit = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"commit": commit, "outside_rank_holds": strategy.run_report["outside_rank_holds"],
              "per_rank_seconds": strategy.run_report["emulated"]["per_rank_seconds"]}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
