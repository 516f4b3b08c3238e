"""The fault soak's plan and checks (benchmarks.soak --faults), in one process: no workers."""
import random
from types import SimpleNamespace

import pytest
import torch

from benchmarks import soak


def _run_dir(tmp_path, global_step):
    (tmp_path / "checkpoints").mkdir()
    torch.save({"global_step": global_step}, tmp_path / "checkpoints" / "last.ckpt")
    return str(tmp_path)


def _summary(dead, segment_steps):
    return {"restarts": [{"dead_original_ranks": dead}], "per_rank": {"0": {"steps": segment_steps}}}


ARGS = SimpleNamespace(steps=24, checkpoint_every=4)


def test_a_clean_restart_passes_and_records_where_it_went_on(tmp_path):
    fault = {"kind": "kill", "rank": 2, "step": 13}
    summary = _summary([2], segment_steps=12)  # went on from step 12: lost 1 step
    assert soak.check_fault_run(fault, summary, _run_dir(tmp_path, 24), ARGS, False, set()) == []
    assert summary["restarts"][0]["resumed_at_step"] == 12


@pytest.mark.parametrize("summary, final, left, temporaries, expected", [
    (_summary([2], 12), 20, False, set(), "final checkpoint at step 20 (expected 24)"),
    (_summary([1], 12), 24, False, set(), "restart without ranks [1] (struck: 2)"),
    ({"restarts": [], "per_rank": {"0": {"steps": 24}}}, 24, False, set(), "0 restarts (expected 1)"),
    (_summary([2], 20), 24, False, set(), "went on from step 4: lost 9 steps (at most 4)"),
    (_summary([2], 12), 24, True, set(), "processes of the job left running"),
    (_summary([2], 12), 24, False, {"/tmp/lightning-straggler-results-x.pt"}, "temporary files left"),
])
def test_each_failed_check_is_named(tmp_path, summary, final, left, temporaries, expected):
    fault = {"kind": "freeze", "rank": 2, "step": 13}
    problems = soak.check_fault_run(fault, summary, _run_dir(tmp_path, final), ARGS, left, temporaries)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_plan_alternates_kills_and_freezes_inside_the_run():
    rng = random.Random(0)
    faults = [soak.make_fault(rng, i, 4, 24)["fault"] for i in range(40)]
    assert [f["kind"] for f in faults[:4]] == ["kill", "freeze", "kill", "freeze"]
    assert all(0 <= f["rank"] < 4 and 2 <= f["step"] <= 22 for f in faults)
    assert len({f["rank"] for f in faults}) == 4  # every rank gets struck somewhere


def test_group_alive_sees_a_running_process_group_and_its_end():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert soak._group_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not soak._group_alive(child.pid)


def test_bad_options_are_named_before_any_run(capsys):
    for argv, setting in ((["--faults", "--ranks", "1"], "--ranks"), (["--steps", "4"], "--steps"),
                          (["--faults", "--checkpoint-every", "0"], "--checkpoint-every")):
        with pytest.raises(SystemExit):
            soak.main(argv)
        assert setting in capsys.readouterr().err
