"""Configuration: the composed defaults validate, bad values fail before any worker starts."""
import os

import pytest

from lightning_straggler.config import ConfigError, load_config


def test_default_config_composes_and_validates(compose):
    cfg = load_config(compose())
    assert cfg.algorithm.name == "ring"
    assert cfg.trainer.devices == 4
    assert cfg.straggler.scenario == "transient"
    assert cfg.straggler.events[0].rank == 3
    assert cfg.data.name == "mnist1d"


@pytest.mark.parametrize("group,option", [("straggler", s) for s in ("none", "static", "transient", "random", "trace")]
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
    (["algorithm=dssync", "algorithm.exchange=ring"], "algorithm.exchange"),
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


# --- one source of defaults: the schemas in config.py -------------------------------------------
def _constructor_defaults(cls):
    import inspect

    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", ["dpar", "awar", "boa", "dssync", "adaptive"])
def test_strategy_constructor_defaults_are_the_config_schema_defaults(name):
    from dataclasses import fields

    from lightning_straggler.config import ALGORITHM_SCHEMAS
    from lightning_straggler.strategies import STRATEGIES

    cls = STRATEGIES[name][0]
    defaults = _constructor_defaults(cls)
    schema = ALGORITHM_SCHEMAS[name]
    shared = [f for f in fields(schema) if f.name in defaults]
    assert len(shared) == len(fields(schema)) - 1  # every setting but the name is a constructor argument
    for f in shared:
        assert defaults[f.name] == f.default, f"{cls.__name__}({f.name}=...) default differs from {schema.__name__}"


def test_simulator_defaults_are_the_config_schema_defaults():
    from lightning_straggler.config import AdaptiveConfig, AwarConfig, BoaConfig, DparConfig
    from lightning_straggler.sim.adaptive import simulate_adaptive
    from lightning_straggler.sim.awar import simulate_awar
    from lightning_straggler.sim.boa import simulate_boa
    from lightning_straggler.sim.dpar import simulate_dpar

    for fn, schema in ((simulate_awar, AwarConfig), (simulate_dpar, DparConfig), (simulate_boa, BoaConfig),
                       (simulate_adaptive, AdaptiveConfig)):
        import inspect

        for name, p in inspect.signature(fn).parameters.items():
            if hasattr(schema, name) and p.default is not inspect.Parameter.empty:
                assert p.default == getattr(schema, name), f"{fn.__name__}({name}=...) differs from {schema.__name__}"


def test_train_yaml_target_acc_is_the_schema_default(compose):
    from lightning_straggler.config import TrainConfig

    assert load_config(compose()).target_acc == TrainConfig.target_acc


def _awar_min_group_true():
    from lightning_straggler.policies.awar import AwarThresholds

    AwarThresholds(min_group=True).validate(4)  # a bool is not a group size


def _boa_cap_below_floor():
    from lightning_straggler.strategies import BoaStrategy

    BoaStrategy(min_local_batch=8, max_local_batch=4)


def _awar_period_true():
    from lightning_straggler.strategies import AwarStrategy

    AwarStrategy(period_steps=True)


@pytest.mark.parametrize("make, setting", [(_awar_min_group_true, "min_group"), (_boa_cap_below_floor, "max_local_batch"),
                                           (_awar_period_true, "period_steps")])
def test_strategy_constructors_reject_what_the_schema_rejects(make, setting):
    with pytest.raises(ValueError, match=setting):
        make()


@pytest.mark.parametrize("value, accepted", [(1.9, False), (2, True), (86400, True), (86401, False), ("10", False)])
def test_strategies_take_the_trainer_schema_range_for_stall_timeout(value, accepted):
    """One range for trainer.stall_timeout_s and the constructors' stall_timeout_s (Horovod and ddp)."""
    from lightning_straggler.config import STALL_TIMEOUT_RANGE, TrainerConfig, ConfigError
    from lightning_straggler.ddp_baseline import DDPBaselineStrategy
    from lightning_straggler.strategies import RingStrategy

    assert STALL_TIMEOUT_RANGE == (2.0, 86400.0)
    for make in (RingStrategy, DDPBaselineStrategy):
        if accepted:
            assert make(stall_timeout_s=value).stall_timeout_s == value
        else:
            with pytest.raises(ValueError, match=r"stall_timeout_s must be in \[2, 86400\] seconds"):
                make(stall_timeout_s=value)
    if not isinstance(value, str):
        cfg = TrainerConfig(stall_timeout_s=value)
        if accepted:
            cfg.validate()
        else:
            with pytest.raises(ConfigError, match="trainer.stall_timeout_s"):
                cfg.validate()


def test_strategies_default_to_the_trainer_schema():
    from lightning_straggler.config import TrainerConfig
    from lightning_straggler.ddp_baseline import DDPBaselineStrategy
    from lightning_straggler.strategies import RingStrategy

    for make in (RingStrategy, DDPBaselineStrategy):
        strategy = make()
        assert (strategy.stall_timeout_s, strategy.nonfinite) == (TrainerConfig.stall_timeout_s, TrainerConfig.nonfinite)


def _schema_defaults(cls):
    from dataclasses import MISSING, fields

    return {f.name: (f.default if f.default is not MISSING else f.default_factory()) for f in fields(cls)
            if f.default is not MISSING or f.default_factory is not MISSING}


@pytest.mark.parametrize("path", ["algorithm/ring.yaml", "algorithm/ddp.yaml", "algorithm/dpar.yaml", "algorithm/awar.yaml",
                                  "algorithm/dssync.yaml", "algorithm/boa.yaml", "trainer/default.yaml", "model/mlp.yaml",
                                  "data/mnist1d.yaml"])
def test_default_yaml_files_restate_the_schema_defaults_exactly(path):
    """The yaml files a user reads are the schema's defaults with comments, never different values: one
    source (the dataclass), documented in the file the user edits. (Scenario files, trainer/quick.yaml,
    model/cnn.yaml and data/synthetic.yaml are variants: they override on purpose.)"""
    import yaml

    from lightning_straggler.config import ALGORITHM_SCHEMAS, GROUP_SCHEMAS

    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "conf", path)) as f:
        values = yaml.safe_load(f)
    values.pop("defaults", None)
    group = path.split("/")[0]
    schema = ALGORITHM_SCHEMAS[values["name"]] if group == "algorithm" else GROUP_SCHEMAS[group]
    defaults = _schema_defaults(schema)
    assert values, path
    for key, value in values.items():
        assert key in defaults, f"{path}: {key} is not a {schema.__name__} setting"
        assert value == defaults[key], f"{path}: {key}={value!r} but {schema.__name__} says {defaults[key]!r}"


def test_partial_group_config_defaults_are_the_policies_thresholds():
    from dataclasses import fields

    from lightning_straggler.config import AwarConfig, DparConfig
    from lightning_straggler.policies.awar import AwarThresholds
    from lightning_straggler.policies.dpar import DparThresholds

    for policy, schema in ((DparThresholds, DparConfig), (AwarThresholds, AwarConfig)):
        for f in fields(policy):
            assert getattr(schema, f.name) == f.default, f"{schema.__name__}.{f.name} differs from {policy.__name__}"
