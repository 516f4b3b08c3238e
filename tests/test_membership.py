"""The dpar and awar membership objects (policies) that the strategies and the simulator share (no processes)."""
from __future__ import annotations

import pytest

from lightning_straggler.policies.awar import NORMAL, STRAGGLER, AwarMembership, AwarThresholds, merge_window
from lightning_straggler.policies.dpar import ACTIVE, SLOW, STRUCK_OUT, DparMembership, DparThresholds


def test_dpar_membership_excludes_readmits_and_strikes_out():
    m = DparMembership(4, DparThresholds(slow_ratio=1.5, readmit_ratio=1.2, readmit_windows=2, strikeout_ratio=5.0,
                                         strikeout_windows=2))
    assert m.group() == (0, 1, 2, 3) and not m.merges((0, 1, 2, 3), m.group())
    d = m.decide([1.0, 1.0, 1.0, 4.0])  # 4x: keeping it costs 4 active x 3 s, excluding 1 x 1.5
    assert m.group() == (0, 1, 2) and m.states == [ACTIVE, ACTIVE, ACTIVE, SLOW]
    assert m.computes_outside_group(3)  # a SLOW rank keeps stepping alone
    assert not m.merges((0, 1, 2, 3), m.group())  # it leaves holding the group's model: nothing to broadcast
    assert m.merges((0, 1, 2), m.group(), model_read=True)  # out, and a validation/checkpoint/end follows
    assert not m.merges((0, 1, 2), m.group(), model_read=False)  # out, a mere window end: its copy is not read
    event = m.transition_event(d.transitions[0], d.group_time)
    assert event == {"rank": 3, "from_state": ACTIVE, "to_state": SLOW, "ratio": 4.0, "keep_cost": 12.0,
                     "exclude_cost": 1.5, "reason": d.transitions[0].reason, "group_time": 1.0}
    m.decide([1.0, 1.0, 1.0, 1.1])
    assert m.group() == (0, 1, 2)  # hysteresis: one fast window is not enough
    m.decide([1.0, 1.0, 1.0, 1.1])
    assert m.group() == (0, 1, 2, 3)
    assert m.merges((0, 1, 2), m.group(), model_read=False)  # the re-admitted rank takes the group's model
    for _ in range(2):
        m.decide([1.0, 1.0, 1.0, 10.0])
    m.decide([1.0, 1.0, 1.0, 10.0])
    assert m.states[3] == STRUCK_OUT and not m.computes_outside_group(3)


def test_dpar_membership_floor_and_restore():
    with pytest.raises(ValueError, match="min_active"):
        DparMembership(4, DparThresholds(min_active=5))
    stock = DparMembership(8, DparThresholds(min_active=2), join_fixed=False)
    assert (stock.configured_floor, stock.thresholds.min_active) == (2, 7)
    m = DparMembership(8, DparThresholds(min_active=2))
    assert m.thresholds.min_active == 2
    m.decide([1.0] * 6 + [4.0, 4.0])
    assert m.group() == tuple(range(6))
    copy = DparMembership(8, DparThresholds(min_active=2))
    copy.restore(m.to_dict())
    assert copy.states == m.states and copy.memory == m.memory
    with pytest.raises(ValueError, match="8 ranks cannot be restored on 4"):
        DparMembership(4, DparThresholds()).restore(m.to_dict())


def test_awar_membership_classifies_merges_and_weights():
    m = AwarMembership(4, AwarThresholds(slow_ratio=1.5, recover_ratio=1.2))
    assert m.group() == (0, 1, 2, 3) and not m.merges(m.group())
    changes = m.classify([1.0, 1.0, 1.0, 3.0])
    assert [c["rank"] for c in changes] == [3] and m.states == [NORMAL, NORMAL, NORMAL, STRAGGLER]
    old = m.group()
    assert old == (0, 1, 2) and m.merges(old)
    # the group took 20 steps, the straggler 5 of its own: weights by updates, then by samples
    assert m.merge_weights([20, 20, 20, 5], [640, 640, 640, 160]) == pytest.approx([20 / 65] * 3 + [5 / 65])
    by_samples = AwarMembership(4, AwarThresholds(), weighting="samples")
    assert by_samples.merge_weights([20, 20, 20, 5], [100, 100, 100, 700]) == pytest.approx([0.1, 0.1, 0.1, 0.7])
    m.classify([1.0, 1.0, 1.0, 1.1])
    assert m.group() == (0, 1, 2, 3)


def test_awar_membership_floor_keeps_the_least_slow():
    m = AwarMembership(4, AwarThresholds(min_group=3))
    m.classify([1.0, 1.0, 3.0, 2.0])
    assert m.group() == (0, 1, 3)  # only one may leave: the slowest
    stock = AwarMembership(8, AwarThresholds(min_group=2), join_fixed=False)
    assert (stock.configured_floor, stock.thresholds.min_group) == (2, 7)
    with pytest.raises(ValueError, match="weighting"):
        AwarMembership(4, AwarThresholds(), weighting="loss")
    assert merge_window(20) == 20 and merge_window(0) > 10**9  # 0: merges only at sync points


def test_the_simulator_uses_the_same_membership_objects():
    from lightning_straggler.sim.awar import AwarPolicy
    from lightning_straggler.sim.dpar import DparPolicy

    dpar = DparPolicy(4)
    assert isinstance(dpar.membership, DparMembership)
    dpar.on_boundary([(r, t, 32, 20, 0) for r, t in enumerate([1.0, 1.0, 1.0, 4.0])], (0, 1, 2, 3), 19)
    assert dpar.group() == (0, 1, 2)
    assert dpar.events[0]["kind"] == "transition" and dpar.events[0]["keep_cost"] == 12.0
    awar = AwarPolicy(4)
    assert isinstance(awar.membership, AwarMembership)
    awar.on_boundary([(r, t, 32, 20, 0) for r, t in enumerate([1.0, 1.0, 1.0, 3.0])], (0, 1, 2, 3), 19)
    assert awar.group() == (0, 1, 2) and awar.events[0]["kind"] == "classification"


def test_awar_membership_restores_only_its_own_world():
    m = AwarMembership(4, AwarThresholds())
    m.restore([NORMAL, STRAGGLER, NORMAL, NORMAL])
    assert m.group() == (0, 2, 3)
    with pytest.raises(ValueError, match="cannot be restored on 4 ranks"):
        m.restore([NORMAL] * 3)
