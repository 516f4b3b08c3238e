import fcntl
import os
import sys

import pytest

# Horovod's background thread coordinates with the other ranks every HOROVOD_CYCLE_TIME ms (default 1) even
# when no tensor is pending: four idle workers then keep 0.44 of a core busy (0.11 at 5 ms; benchmarks/horovod_idle_cpu.py), and the
# suite's many multi-rank jobs (two at a time under pytest -n 2) slow each other down. Tests check results,
# not latency; 5 ms cuts that idle cost about four-fold. Workers, fork servers and subprocesses inherit it.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")

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


# Files whose tests take longest (pytest --durations, serial run of 2026-12-04), started first: pytest-xdist
# hands whole files to whichever worker is free, so long files started last would leave one worker alone at the
# end. Only the order changes, and only across files.
SLOWEST_FILES_FIRST = ("test_slurm.py", "test_matrix.py", "test_compat_multiprocess.py",
                       "test_reliability_multiprocess.py", "test_partial_group_multiprocess.py",
                       "test_shaped_network.py", "test_inprocess_strategies.py", "test_dpar_multiprocess.py",
                       "test_resume_multiprocess.py", "test_ring_multiprocess.py", "test_package.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept


@pytest.fixture(autouse=True)
def _exclusive_under_xdist(request, tmp_path_factory):
    """Under pytest-xdist a test marked ``exclusive`` (it bounds a duration) runs alone: a readers-writer
    lock over files that every worker of the run sees. Other tests hold it shared; an exclusive one first
    takes the turnstile, so the other worker starts nothing new, then waits for its running test to end."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared_dir = tmp_path_factory.getbasetemp().parent  # <run's basetemp>/popen-gwN: the parent is the run's
    exclusive = request.node.get_closest_marker("exclusive") is not None
    with open(shared_dir / "ls-turnstile.lock", "a") as turnstile, open(shared_dir / "ls-tests.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
