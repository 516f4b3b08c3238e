"""Writing a side-by-side benchmark's result directory: report.json, report.md and command.txt."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict


def write_report(report: Dict[str, Any], out: str, markdown: Callable[[Dict[str, Any]], str]) -> None:
    """``<out>/report.json`` (everything, the per-run records included), ``report.md`` (``markdown(report)``)
    and ``command.txt`` (``report["command"]``, the invocation that measured it)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report))
    with open(os.path.join(out, "command.txt"), "w") as f:
        f.write(report["command"] + "\n")
