import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Property tests draw the same examples on every run (a new random draw that fails once in fifty runs is
# a flaky CI, not a finding); HYPOTHESIS_PROFILE=explore draws fresh ones when looking for bugs on purpose.
try:
    from hypothesis import settings as _hypothesis_settings

    # (named "ci" on purpose: it replaces hypothesis' own CI profile, which it would load on a CI machine;
    # no deadline: a busy 2-core machine makes per-example timings unreliable)
    _default_profile = _hypothesis_settings.get_profile("default")
    _hypothesis_settings.register_profile("ci", parent=_default_profile, derandomize=True, database=None,
                                          deadline=None)
    _hypothesis_settings.register_profile("explore", parent=_default_profile, deadline=None)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a test dependency; without it the property tests are not collected
    pass
CONF_DIR = os.path.join(ROOT, "conf")


@pytest.fixture
def compose():
    """Compose the Hydra config like the CLI does, with overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import lightning_straggler.config  # noqa: F401  registers the group schemas

    def _compose(*overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides))

    return _compose


@pytest.fixture
def cli():
    """Run ``python -m lightning_straggler.train`` in a subprocess; returns CompletedProcess."""
    import subprocess

    def _run(*args, cwd=None, timeout=600):
        return subprocess.run([sys.executable, "-m", "lightning_straggler.train", *args], cwd=cwd or ROOT,
                              capture_output=True, text=True, timeout=timeout)

    return _run
