"""Configuration: the composed defaults validate, bad values fail before any worker starts."""
import pytest

from lightning_straggler.config import ConfigError, load_config


def test_default_config_composes_and_validates(compose):
    cfg = load_config(compose())
    assert cfg.algorithm.name == "ring"
    assert cfg.trainer.devices == 4
    assert cfg.straggler.scenario == "transient"
    assert cfg.straggler.events[0].rank == 3
    assert cfg.data.name == "mnist1d"


@pytest.mark.parametrize("group,option", [("straggler", s) for s in ("none", "static", "transient", "random")]
                         + [("model", "mlp"), ("model", "cnn"), ("data", "synthetic"), ("trainer", "quick")])
def test_every_shipped_option_validates(compose, group, option):
    overrides = [f"{group}={option}"]
    if option == "quick":
        overrides.append("straggler=none")
    load_config(compose(*overrides))


def test_transient_events_from_the_command_line(compose):
    cfg = load_config(compose("straggler=transient",
                              "straggler.events=[{rank:3,factor:4.0,start_step:40,end_step:160},{rank:1,factor:2.5,start_step:0}]"))
    sched = cfg.straggler.schedule()
    assert sched.factor(3, 40) == 4.0 and sched.factor(3, 160) == 1.0
    assert sched.factor(1, 10**6) == 2.5


def test_random_scenario_fully_from_the_command_line(compose):
    cfg = load_config(compose("straggler=random", "straggler.seed=3", "straggler.probability=0.5",
                              "straggler.factor_min=3", "straggler.factor_max=9", "straggler.window_steps=5"))
    d = cfg.straggler.schedule().describe()
    assert d["seed"] == 3 and d["probability"] == 0.5 and d["factor_range"] == [3.0, 9.0]


@pytest.mark.parametrize("overrides,setting", [
    (["algorithm.name=nope"], "algorithm.name"),
    (["straggler=random", "straggler.probability=1.5"], "straggler.probability"),
    (["straggler=random", "straggler.factor_min=0.5"], "straggler.factor_min"),
    (["straggler=random", "straggler.factor_max=1.5"], "straggler.factor_max"),
    (["straggler=random", "straggler.duration_min=0"], "straggler.duration_min"),
    (["straggler=static", "straggler.factors=[1,1,1,1,2]"], "straggler.factors"),
    (["straggler=static", "straggler.factors=[1,0.5]"], "straggler.factors[1]"),
    (["straggler.events=[{rank:4,factor:2.0}]"], "straggler.events[0].rank"),
    (["straggler.events=[{rank:1,factor:2.0,start_step:10,end_step:5}]"], "straggler.events[0].end_step"),
    (["straggler.device_ms_per_sample=-1"], "straggler.device_ms_per_sample"),
    (["trainer.devices=0"], "trainer.devices"),
    (["trainer.devices=100000"], "trainer.devices"),
    (["trainer.max_epochs=0"], "trainer.max_epochs"),
    (["model.lr=-0.1"], "model.lr"),
    (["model.optimizer=rmsprop"], "model.optimizer"),
    (["data.batch_size=0"], "data.batch_size"),
    (["target_acc=1.5"], "target_acc"),
    (["profiler.gather_every_n_steps=0"], "profiler.gather_every_n_steps"),
])
def test_bad_values_name_the_setting_and_the_allowed_range(compose, overrides, setting):
    with pytest.raises(ConfigError) as err:
        load_config(compose(*overrides))
    msg = str(err.value)
    assert setting in msg
    assert "must be" in msg or "one of" in msg


def test_wrong_types_and_unknown_keys_fail_at_composition(compose):
    # the group schemas make Hydra itself reject these, naming the key
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="trainer.devices"):
        compose("trainer.devices=four")
    with pytest.raises(ConfigCompositionException, match="nonsense"):
        compose("trainer.nonsense=1")
    with pytest.raises(ConfigError, match="nonsense"):  # forced in with +, caught by the schema merge
        load_config(compose("+trainer.nonsense=1"))


def test_load_config_checks_types_and_keys_without_hydra():
    with pytest.raises(ConfigError, match="devices"):
        load_config({"trainer": {"devices": "four"}})
    with pytest.raises(ConfigError, match="nonsense"):
        load_config({"model": {"nonsense": 1}})


def test_cli_rejects_bad_input_before_starting_workers(cli):
    res = cli("trainer.devices=0", "output_dir=/tmp/ls-bad-config")
    assert res.returncode != 0
    assert "trainer.devices must be in 1.." in res.stderr
    assert "starting" not in res.stdout + res.stderr  # the launcher never ran
    res = cli("algorithm=nope")
    assert res.returncode != 0
    assert "algorithm" in res.stderr and "ring" in res.stderr
