"""The package's import behaviour, each case in a fresh interpreter (no processes of Horovod)."""
from __future__ import annotations

import subprocess
import sys

import pytest

NAMES = ("ring", "dpar", "awar", "dssync", "boa", "adaptive")
ARGS = [sys.executable, "-W", "ignore", "-c"]


def _last_line(proc: subprocess.Popen, code: str) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{code}\n{err[-2000:]}"
    return out.strip().splitlines()[-1]


def _run(code: str) -> str:
    return _last_line(subprocess.Popen([*ARGS, code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), code)


def test_policies_and_the_simulator_import_without_torch_or_lightning():
    out = _run("import sys, lightning_straggler, lightning_straggler.policies.dpar, lightning_straggler.policies.awar, "
               "lightning_straggler.policies.boa, lightning_straggler.policies.boa_schedule, "
               "lightning_straggler.policies.adaptive, lightning_straggler.sim; "
               "print(sorted(m for m in ('torch', 'lightning', 'horovod') if m in sys.modules))")
    assert out == "[]"


IMPORT_ORDERS = [
    "import lightning_straggler; import lightning.pytorch",          # ours first, Lightning later
    "import lightning.pytorch; import lightning_straggler",          # Lightning first
    "import lightning_straggler; import lightning",                  # the top-level Lightning package
    "from lightning_straggler.strategies.dpar import DparStrategy",  # a strategy module alone
    "import lightning_straggler.launcher",                           # modules that load Lightning themselves
    "import lightning_straggler.comm",
]


def test_every_strategy_name_is_registered_whatever_the_import_order():
    """Each order in its own fresh interpreter; the interpreters run side by side (each imports Lightning)."""
    codes = [f"{order}; from lightning.pytorch.strategies import StrategyRegistry; "
             f"print([n for n in {NAMES!r} if n not in StrategyRegistry])" for order in IMPORT_ORDERS]
    procs = [subprocess.Popen([*ARGS, code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for code in codes]
    missing = {order: _last_line(p, code) for order, p, code in zip(IMPORT_ORDERS, procs, codes)}
    assert missing == {order: "[]" for order in IMPORT_ORDERS}


def test_strategy_classes_load_on_first_use():
    out = _run("import sys, lightning_straggler as L; before = 'lightning' in sys.modules; "
               "cls = L.DparStrategy; print(before, cls.strategy_name, 'lightning' in sys.modules)")
    assert out == "False dpar True"


def test_a_refused_command_line_loads_neither_torch_nor_lightning(tmp_path):
    """The command line validates before it imports the training stack: a wrong setting is refused in
    well under a second, not after Lightning's few seconds of imports."""
    out = _run("import sys, runpy\n"
               f"sys.argv = ['train', 'trainer.devices=0', 'output_dir={tmp_path}']\n"
               "try:\n"
               "    runpy.run_module('lightning_straggler.train', run_name='__main__')\n"
               "except SystemExit as e:\n"
               "    print(e.code, sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    assert out == "2 []"
