"""In-process checks of Lightning features the strategies accept or refuse (no workers started)."""
from types import SimpleNamespace

import pytest
from lightning.pytorch.trainer.states import TrainerFn

from lightning_straggler import BoaStrategy


class NoCollectives:
    """Any use of the collectives is a failure: the check must come first."""

    initialized = True

    def __getattr__(self, name):
        raise AssertionError(f"collective {name!r} called before the configuration check")


def test_boa_refuses_gradient_accumulation_at_set_up_before_any_collective():
    strategy = BoaStrategy(comm=NoCollectives())
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"boa does not support accumulate_grad_batches=2"):
        strategy.setup(trainer)
