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


def write_rescore(stem: str, data: Any, markdown: str) -> None:
    """``<stem>.json``, ``<stem>.md``, and the table on stdout: a re-scoring of a committed grid
    (time_to_target, versus_best) or a small probe's result (process_set_cost, join_wait_cpu)."""
    import json
    import sys

    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    sys.stdout.write(markdown)
