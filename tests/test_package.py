"""The package's import behaviour, each case in a fresh interpreter (no processes of Horovod)."""
from __future__ import annotations

import subprocess
import sys

import pytest

NAMES = ("ring", "dpar", "awar", "dssync", "boa")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_policies_and_the_simulator_import_without_torch_or_lightning():
    out = _run("import sys, lightning_straggler, lightning_straggler.policies.dpar, lightning_straggler.policies.awar, "
               "lightning_straggler.policies.boa, lightning_straggler.policies.boa_schedule, lightning_straggler.sim; "
               "print(sorted(m for m in ('torch', 'lightning', 'horovod') if m in sys.modules))")
    assert out == "[]"


@pytest.mark.parametrize("order", [
    "import lightning_straggler; import lightning.pytorch",          # ours first, Lightning later
    "import lightning.pytorch; import lightning_straggler",          # Lightning first
    "import lightning_straggler; import lightning",                  # the top-level Lightning package
    "from lightning_straggler.strategies.dpar import DparStrategy",  # a strategy module alone
    "import lightning_straggler.launcher",                           # modules that load Lightning themselves
    "import lightning_straggler.comm",
])
def test_every_strategy_name_is_registered_whatever_the_import_order(order):
    out = _run(f"{order}; from lightning.pytorch.strategies import StrategyRegistry; "
               f"print([n for n in {NAMES!r} if n not in StrategyRegistry])")
    assert out == "[]"


def test_strategy_classes_load_on_first_use():
    out = _run("import sys, lightning_straggler as L; before = 'lightning' in sys.modules; "
               "cls = L.DparStrategy; print(before, cls.strategy_name, 'lightning' in sys.modules)")
    assert out == "False dpar True"
