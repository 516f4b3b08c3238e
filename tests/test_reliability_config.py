"""Reliability settings are checked before any worker starts; pure pieces of the watchdog."""
import pytest

from lightning_straggler.config import ConfigError, load_config
from lightning_straggler.watchdog import CollectiveBoard
from lightning_straggler.train import shrink_config


@pytest.mark.parametrize("setting, value, words", [
    ("stall_timeout_s", 1, "trainer.stall_timeout_s must be in [2, 86400] seconds"),
    ("stall_timeout_s", 100000, "trainer.stall_timeout_s must be in [2, 86400] seconds"),
    ("job_timeout_s", 5, "trainer.job_timeout_s must be 0 (no limit) or >= 10 seconds"),
    ("checkpoint_every_n_steps", -1, "trainer.checkpoint_every_n_steps must be >= 0"),
    ("restart_on_failure", 4, "trainer.restart_on_failure must be in 0..3"),
    ("restart_on_failure", -1, "trainer.restart_on_failure must be in 0..3"),
])
def test_bad_values_name_the_setting_and_the_range(setting, value, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config({"trainer": {"devices": 4, setting: value}})


def test_defaults_in_the_yaml_are_valid(compose):
    cfg = load_config(compose())
    assert cfg.trainer.stall_timeout_s == 300 and cfg.trainer.restart_on_failure == 0


def test_board_names_every_rank_and_its_collective():
    board = CollectiveBoard(3)
    board.enter(0, "grads.all")
    board.enter(2, "stall_probe.all")
    board.leave(1)
    assert board.stalled(10.0) is None
    report = board.stalled(10.0, now=board._since[0] + 11)
    assert "rank 0 waits in 'grads.all'" in report and "rank 2 waits in 'stall_probe.all'" in report
    assert "rank 1 is not in a collective" in report


def test_shrink_config_keeps_the_survivors_stragglers():
    raw = {"trainer": {"devices": 4}, "straggler": {"scenario": "transient", "events": [
        {"rank": 3, "factor": 4.0, "start_step": 0, "end_step": 9}, {"rank": 2, "factor": 2.0, "start_step": 0}]}}
    shrunk = shrink_config(raw, [0, 1, 3])
    assert shrunk["trainer"]["devices"] == 3
    assert shrunk["straggler"]["events"] == [{"rank": 2, "factor": 4.0, "start_step": 0, "end_step": 9}]
    static = shrink_config({"straggler": {"scenario": "static", "factors": [1, 2, 3, 4]}}, [0, 2])
    assert static["straggler"]["factors"] == [1, 3]
