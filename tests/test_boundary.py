"""The one boundary rule of dpar and awar (policies/boundary.py), on closed cases, and the simulator's
windows built from it."""
from __future__ import annotations

from lightning_straggler.policies.boundary import is_boundary


def test_window_ends_epoch_ends_run_end_validation_and_checkpoints_are_boundaries():
    assert [p for p in range(45) if is_boundary(p, 20, last_of_epoch=False)] == [19, 39]
    assert is_boundary(6, 20, last_of_epoch=True)
    assert is_boundary(29, 20, last_of_epoch=False, total_steps=30) and not is_boundary(28, 20, last_of_epoch=False,
                                                                                        total_steps=30)
    assert not is_boundary(28, 20, last_of_epoch=False, total_steps=0)  # 0 = no step limit
    assert is_boundary(4, 20, last_of_epoch=False, validation_follows=True)
    assert is_boundary(14, 20, last_of_epoch=False, checkpoint_every=[0, 15])
    assert not is_boundary(13, 20, last_of_epoch=False, checkpoint_every=[0, 15])


def test_the_simulators_windows_end_where_the_rule_says():
    from lightning_straggler.sim import Workload

    w = Workload(world_size=4, batch_per_worker=8, per_sample_s=1e-3, steps=50, grad_bytes=1e3, steps_per_epoch=25,
                 val_every_steps=10)
    got = [p for p in range(50) if is_boundary(p, 20, last_of_epoch=w.last_of_epoch(p), total_steps=w.steps,
                                                validation_follows=w.validation_follows(p))]
    # windows of 20 (19, 39), validation every 10 steps of an epoch (9, 19; 34, 44), epoch ends (24, 49)
    assert got == [9, 19, 24, 34, 39, 44, 49]
    assert [p for p in range(50) if w.is_sync_point(p)] == [9, 19, 24, 34, 44, 49]
