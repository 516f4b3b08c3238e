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
    ("horovod_cycle_time_ms", 0, "trainer.horovod_cycle_time_ms must be null (Horovod's own, 1 ms) or in [0.1, 1000]"),
    ("horovod_cycle_time_ms", 5000, "trainer.horovod_cycle_time_ms must be null (Horovod's own, 1 ms) or in [0.1, 1000]"),
    ("horovod_cycle_time_ms", float("nan"), "trainer.horovod_cycle_time_ms must be null"),
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


def test_horovod_cycle_time_reaches_the_strategy_and_the_workers_environment(compose):
    """trainer.horovod_cycle_time_ms: the strategy built from the config carries it, the environment the
    launcher gives each worker (and an srun task's) sets HOROVOD_CYCLE_TIME, and null leaves Horovod's own."""
    from lightning_straggler.cluster_env import TaskLayout, attach_env
    from lightning_straggler.launcher import horovod_worker_env
    from lightning_straggler.strategies import RingStrategy
    from lightning_straggler.train import build_strategy

    assert build_strategy(load_config(compose("trainer.horovod_cycle_time_ms=5"))).horovod_cycle_time_ms == 5.0
    assert build_strategy(load_config(compose())).horovod_cycle_time_ms is None
    assert build_strategy(load_config(compose("algorithm=ddp", "trainer.horovod_cycle_time_ms=5")))  # no Horovod there
    assert horovod_worker_env(0, 4, 1234, 300, 5.0)["HOROVOD_CYCLE_TIME"] == "5"
    assert horovod_worker_env(0, 4, 1234, 300, 0.5)["HOROVOD_CYCLE_TIME"] == "0.5"
    assert "HOROVOD_CYCLE_TIME" not in horovod_worker_env(0, 4, 1234, 300)
    layout = TaskLayout(rank=1, size=2, local_rank=0, local_size=1, cross_rank=1, cross_size=2, node_rank=1,
                        nodes=("a", "b"), tasks_per_node=(1, 1), job_id="7")
    assert attach_env(layout, "10.0.0.1", 1234, "lo", 120, 5.0)["HOROVOD_CYCLE_TIME"] == "5"
    with pytest.raises(ValueError, match=r"horovod_cycle_time_ms must be None or in \[0.1, 1000\] milliseconds"):
        RingStrategy(horovod_cycle_time_ms=0)
