"""The scale projection's grid (benchmarks.scale_projection) at a small size, in one process: every
scenario and algorithm gets a cell, the scenarios are what the docstring says, and the simulated
strategies rank as their designs promise on the cases they are for."""
from __future__ import annotations

import math

from benchmarks import scale_projection as sp
from benchmarks.matrix import speed_mix


def test_mix_transient_is_the_static_mix_plus_one_fast_worker_10x_for_the_middle_third():
    events = sp.scenario("mix-transient", 16, 160)["events"]
    permanent = {e["rank"]: e["factor"] for e in events if e["end_step"] is None}
    assert permanent == {r: f for r, f in enumerate(speed_mix(16)) if f != 1.0}
    [collapse] = [e for e in events if e["end_step"] is not None]
    assert collapse == {"rank": 0, "factor": 10.0, "start_step": 53, "end_step": 106}
    assert speed_mix(16)[0] == 1.0  # a fast worker


def test_small_grid_has_every_cell_and_adaptive_leads_where_it_should():
    cells = sp.run_grid([8], 60, ["resnet50"], sp.SCENARIOS)
    sp.ratio_to_ring(cells)
    seen = {(c["scenario"], c["network"], c["algorithm"]) for c in cells}
    assert seen == {(s, n.name, a) for s in sp.SCENARIOS for n in sp.NETWORKS for a in sp.ALGORITHMS}
    assert all(math.isfinite(c["efficiency"]) and c["efficiency"] > 0 for c in cells)
    at = {(c["scenario"], c["network"], c["algorithm"]): c for c in cells}
    synchronous = [a for a in sp.ALGORITHMS if a not in ("adaptive", "async")]  # async: stale gradients
    for net in sp.NETWORKS:
        # random slowdowns and a speed mix with a collapse: adaptive re-plans within steps of each change, the
        # window-based schemes a window late, ring and backup workers wait for the slow ones
        for scenario in ("random", "mix-transient"):
            others = {a: at[(scenario, net.name, a)]["throughput_samples_per_s"] for a in synchronous}
            assert set(others) >= {"ring", "boa", "dpar", "awar", "backup"}
            adaptive = at[(scenario, net.name, "adaptive")]["throughput_samples_per_s"]
            assert adaptive > 1.3 * max(others.values()), (scenario, net.name, adaptive, others)
        assert at[("none", net.name, "ring")]["vs_ring"] == 1.0
    text = sp.markdown(cells, [8], 60)
    assert "mix-transient" in text and "adaptive" in text
