"""Property-based tests over the configuration space (hypothesis).

Every configuration either validates, and then its strategy object, straggler schedule, injector and data
module build without starting a worker (and the schedule's delays are finite), or it fails in
``load_config`` / Hydra composition with an error that names the setting and what is allowed.
"""
import math
import re
from dataclasses import asdict, fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_straggler.callbacks import StragglerInjector
from lightning_straggler.config import (ALGORITHM_SCHEMAS, ConfigError, DataConfig, ModelConfig, ProfilerConfig,
                                        StragglerConfig, TrainerConfig, load_config)
from lightning_straggler.data import ArrayDataModule
from lightning_straggler.policies.injection import RandomSchedule, added_delay_s
from lightning_straggler.train import build_strategy

GROUPS = {"straggler": StragglerConfig, "model": ModelConfig, "data": DataConfig, "trainer": TrainerConfig,
          "profiler": ProfilerConfig}
TOP_LEVEL = ("seed", "target_acc", "output_dir")
SETTINGS = sorted({f"{g}.{f.name}" for g, schema in GROUPS.items() for f in fields(schema)}
                  | {f"algorithm.{f.name}" for schema in ALGORITHM_SCHEMAS.values() for f in fields(schema)}
                  | set(TOP_LEVEL) | {"algorithm"})
ALLOWED_WORDS = ("must be", "one of", "settings of")
TRIED = {"dict": 0, "hydra": 0, "valid": 0}

numbers = st.one_of(
    st.integers(-3, 40), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([0, 1, -1, 2 ** 32, 2 ** 63]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 4.0, float("nan"),
                                                                   float("inf"), -float("inf"), -0.5]))
event = st.fixed_dictionaries({}, optional={"rank": numbers, "factor": numbers, "start_step": numbers,
                                            "end_step": st.one_of(st.none(), numbers), "bogus": numbers})
values = st.one_of(
    numbers, st.booleans(), st.none(), st.text(max_size=6),
    st.sampled_from(["ring", "dssync", "boa", "dpar", "awar", "butterfly", "random", "params", "grads", "updates",
                     "samples", "mlp", "cnn", "sgd", "adam", "mnist1d", "synthetic", "cpu", "none", "static",
                     "transient", "error", "skip"]),
    st.lists(numbers, max_size=6), st.lists(event, max_size=3), st.dictionaries(st.text(max_size=3), numbers, max_size=2))


@st.composite
def raw_configs(draw):
    """A config dict: a random algorithm and scenario, then 0..5 random overrides (unknown keys included)."""
    algorithm = draw(st.sampled_from(sorted(ALGORITHM_SCHEMAS)))
    raw = {"algorithm": {"name": algorithm}, "trainer": {"devices": draw(st.integers(1, 6))},
           "straggler": {"scenario": draw(st.sampled_from(["none", "static", "transient", "random", "trace"]))}}
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.integers(0, 9))
        if kind == 0:  # an unknown key somewhere
            group = draw(st.sampled_from(["algorithm", *GROUPS]))
            if isinstance(raw.setdefault(group, {}), dict):
                raw[group][draw(st.sampled_from(["nonsense", "lr_", "Devices", "x"]))] = draw(values)
        elif kind == 1:
            raw[draw(st.sampled_from(TOP_LEVEL))] = draw(values)
        elif kind == 2:  # the algorithm group itself replaced by something odd
            raw["algorithm"] = draw(st.one_of(values, st.just({"name": draw(values)})))
        else:
            schema = ALGORITHM_SCHEMAS[algorithm] if kind < 5 else draw(st.sampled_from(list(GROUPS.values())))
            group = "algorithm" if kind < 5 else next(g for g, s in GROUPS.items() if s is schema)
            key = draw(st.sampled_from([f.name for f in fields(schema) if f.name != "name"] or ["name"]))
            if isinstance(raw.get(group), dict):
                raw[group][key] = draw(values)
    return raw


def _names_a_setting(message: str, raw=None) -> bool:
    """The message names a setting and what is allowed; given the example's ``raw`` dict, it names one the
    example set (``group.key``, a top-level setting or a group replaced whole), or a setting another one
    it set requires, naming that one too (``straggler.factors ... for scenario=static``)."""
    if not any(w in message for w in ALLOWED_WORDS):
        return False
    named = {s for s in SETTINGS if re.search(rf"(?<![\w.]){re.escape(s)}(?!\w)", message)}
    if raw is None:
        return bool(named)
    # what the example set: group.key, top-level settings, groups replaced by a non-dict value; the three
    # settings every example sets (the algorithm's name, devices, scenario) count only when named in full
    always = {"algorithm.name", "trainer.devices", "straggler.scenario"}
    touched = ({f"{g}.{k}" for g, v in raw.items() if isinstance(v, dict) for k in v}
               | {g for g, v in raw.items() if not isinstance(v, dict) or g in TOP_LEVEL})
    if not (isinstance(raw.get("algorithm"), dict) and "name" in raw["algorithm"]):
        touched.add("algorithm")  # the group replaced by one without a name
    requires = any(re.search(rf"(?<![\w.]){re.escape(t.split('.')[-1])}=", message) for t in touched - always if "." in t)
    requires |= any(re.search(rf"(?<![\w.]){re.escape(t)}=", message) for t in touched & always)
    requires |= "scenario=" in message and "straggler.scenario" in touched  # the scenario needs its factors/events
    unknown = any(re.search(rf"(?<![\w.]){re.escape(t)}(?!\w)", message) for t in touched if "." in t)  # an unknown key
    return bool(named & touched) or unknown or (bool(named) and requires)


def _builds(cfg) -> None:
    """Everything a run builds before starting workers; nothing may fail for a validated config."""
    build_strategy(cfg)
    schedule = cfg.straggler.schedule()
    StragglerInjector(schedule, cfg.straggler.device_ms_per_sample)
    ArrayDataModule(**asdict(cfg.data))
    if isinstance(schedule, RandomSchedule):
        schedule.events_until(cfg.trainer.devices, 200)
    for rank in range(cfg.trainer.devices):
        for step in (0, 1, 17, 10 ** 4):
            factor = schedule.factor(rank, step)
            assert math.isfinite(factor) and factor >= 1.0, (rank, step, factor)
            delay = added_delay_s(factor, 0.01, cfg.straggler.device_ms_per_sample, cfg.data.batch_size)
            assert math.isfinite(delay) and delay >= 0, delay  # time.sleep(inf) would raise mid-run


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw_configs())
def test_every_config_validates_and_builds_or_names_the_setting(raw):
    TRIED["dict"] += 1
    try:
        cfg = load_config(raw)
    except ConfigError as e:
        assert _names_a_setting(str(e), raw), (raw, str(e))
        return
    TRIED["valid"] += 1
    _builds(cfg)


@st.composite
def overrides(draw):
    algorithm = draw(st.sampled_from(sorted(ALGORITHM_SCHEMAS)))
    out = [f"algorithm={algorithm}", f"straggler={draw(st.sampled_from(['none', 'static', 'transient', 'random', 'trace']))}",
           f"trainer={draw(st.sampled_from(['default', 'quick']))}"]
    groups = {**GROUPS, "algorithm": ALGORITHM_SCHEMAS[algorithm]}
    # ring and ddp have no settings besides their name: nothing to override in that group
    groups = {g: schema for g, schema in groups.items() if any(f.name != "name" for f in fields(schema))}
    for _ in range(draw(st.integers(1, 3))):
        group = draw(st.sampled_from(sorted(groups)))
        key = draw(st.sampled_from([f.name for f in fields(groups[group]) if f.name != "name"]))
        value = draw(st.one_of(
            st.integers(-5, 50).map(str), st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e9", "true", "null", "abc",
                                                           "[1,2]", "[1.0,1.0,2.0,4.0,8.0]", "[]", "0.5", "2.5"])))
        out.append(f"{group}.{key}={value}")
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(overrides())
def test_command_line_overrides_compose_validate_and_build_or_name_the_setting(compose, override_list):
    from hydra.errors import ConfigCompositionException

    TRIED["hydra"] += 1
    try:
        composed = compose(*override_list)
    except ConfigCompositionException as e:
        message = f"{e} {e.__cause__}"
        assert any(o.split("=")[0] in message for o in override_list[3:]), message
        return
    try:
        cfg = load_config(composed)
    except ConfigError as e:
        assert _names_a_setting(str(e)), str(e)
        return
    TRIED["valid"] += 1
    _builds(cfg)


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print(f"\nconfigs tried: {TRIED['dict']} as dicts, {TRIED['hydra']} as command-line overrides; "
          f"{TRIED['valid']} validated and built")
