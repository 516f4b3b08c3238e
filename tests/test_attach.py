"""Under an external launcher that sets Horovod's rank variables, the strategy attaches instead of spawning."""
import json
import os
import subprocess
import sys

import pytest

from lightning_straggler.launcher import _Rendezvous, horovod_worker_env

pytestmark = pytest.mark.multiprocess
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "attached_fit.py")


def test_attaches_to_externally_started_workers():
    size = 2
    rendezvous = _Rendezvous(size)
    try:
        procs = []
        for rank in range(size):
            env = {**os.environ, **horovod_worker_env(rank, size, rendezvous.port, 120), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, SCRIPT], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        rendezvous.stop()
    results = []
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
        line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world"] == 2 and r["steps"] == 5 for r in results)
    assert all(r["launcher"] == "NoneType" for r in results)  # nothing was spawned
    assert results[0]["params"] == pytest.approx(results[1]["params"], abs=1e-7)  # synchronised
