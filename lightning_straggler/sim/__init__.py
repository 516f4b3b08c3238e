"""A step-level discrete-event simulator of the project's algorithms at any scale.

One module per protocol (``ring``, ``dssync``, ``boa``, ``dpar``, ``awar``, and the baselines
``backup`` = synchronous SGD with backup workers and ``async_sgd``), over a :class:`Workload`
(per-worker compute times from the project's straggler schedules) and a :class:`Network`
(alpha-beta costs of the collectives). The decisions (exclusions, weights, groups, batch sizes) are
made by the same policy code the strategies call. Pure Python + numpy: importing it loads neither torch nor
Lightning.

    from lightning_straggler.sim import Workload, ETHERNET_25G, simulate
    w = Workload(world_size=64, batch_per_worker=64, per_sample_s=3e-3, steps=120, grad_bytes=102.4e6,
                 straggler={"scenario": "static", "factors": [1.0] * 63 + [10.0]})
    print(simulate("dpar", w, ETHERNET_25G).summary())
"""
from __future__ import annotations

from typing import Any, Callable

from lightning_straggler.sim.async_sgd import simulate_async
from lightning_straggler.sim.adaptive import simulate_adaptive
from lightning_straggler.sim.awar import simulate_awar
from lightning_straggler.sim.backup import simulate_backup
from lightning_straggler.sim.boa import simulate_boa
from lightning_straggler.sim.dpar import simulate_dpar
from lightning_straggler.sim.dssync import simulate_dssync
from lightning_straggler.sim.network import (
    ETHERNET_25G,
    FREE,
    INFINIBAND_200G,
    PRESETS,
    Network,
    from_bandwidth,
)
from lightning_straggler.sim.result import SimResult, ideal_throughput
from lightning_straggler.sim.ring import simulate_ring
from lightning_straggler.sim.workload import (
    MatrixSchedule,
    Workload,
    factor_matrix,
    schedule_from_config,
)

SIMULATORS: dict[str, Callable[..., SimResult]] = {
    "ring": simulate_ring,
    "dssync": simulate_dssync,
    "boa": simulate_boa,
    "dpar": simulate_dpar,
    "awar": simulate_awar,
    "adaptive": simulate_adaptive,
    "backup": simulate_backup,
    "async": simulate_async,
}


def simulate(algorithm: str, workload: Workload, network: Network, **params: Any) -> SimResult:
    """Simulate one run; ``params`` are the algorithm's settings (as in ``conf/algorithm/<name>.yaml``)."""
    if algorithm not in SIMULATORS:
        raise ValueError(f"algorithm must be one of {', '.join(SIMULATORS)} (got {algorithm!r})")
    return SIMULATORS[algorithm](workload, network, **params)


__all__ = [
    "ETHERNET_25G",
    "FREE",
    "INFINIBAND_200G",
    "MatrixSchedule",
    "PRESETS",
    "SIMULATORS",
    "Network",
    "SimResult",
    "Workload",
    "factor_matrix",
    "from_bandwidth",
    "ideal_throughput",
    "schedule_from_config",
    "simulate",
    "simulate_adaptive",
    "simulate_async",
    "simulate_awar",
    "simulate_backup",
    "simulate_boa",
    "simulate_dpar",
    "simulate_dssync",
    "simulate_ring",
]
