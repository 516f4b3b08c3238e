"""A non-finite loss on one rank does not silently poison the others (real Horovod workers, 4 ranks)."""
import lightning.pytorch as pl
import pytest

import lightning_straggler  # noqa: F401  registers the strategies
from lightning_straggler import DSSyncStrategy, RingStrategy
from lightning_straggler.models import Classifier
from tests.test_ring_multiprocess import fit

pytestmark = pytest.mark.multiprocess


class NanOnRank(Classifier):
    """Multiplies the loss by NaN on one rank at one optimizer step (so its gradients are NaN too)."""

    def __init__(self, nan_rank, nan_step):
        super().__init__("mlp", 40, 10, hidden=[32], optimizer="sgd", lr=0.1, momentum=0.9)
        self.nan_rank, self.nan_step = nan_rank, nan_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_step:
            loss = loss * float("nan")
        return loss


def model():
    pl.seed_everything(0, verbose=False)
    return NanOnRank(nan_rank=2, nan_step=3)


@pytest.mark.parametrize("strategy", [RingStrategy(), DSSyncStrategy(group_size=2),
                                      DSSyncStrategy(group_size=2, sync="grads", exchange="direct")],
                         ids=["ring", "dssync-local", "dssync-grads-direct"])
def test_error_names_the_rank(strategy):
    # ring: every rank sees the NaN average and they find the culprit together; dssync params: local check;
    # dssync grads over direct groups: the pair sees the NaN average and sums one flag per rank in its group
    with pytest.raises(Exception) as err:
        fit(model(), strategy, 4, 8, 6)
    message = str(err.value)
    assert "non-finite loss or gradients from rank 2 at step 3" in message, message[-2000:]
    if getattr(strategy, "exchange", None) == "direct":  # traced inside rank 2's pair at step 3 by the flag sum
        from lightning_straggler.policies.dssync import DSSyncSchedule

        pair = list(DSSyncSchedule(4, 2, "butterfly").group_of(2, 3))
        assert f"seen by ranks {pair}" in message, message[-2000:]


# nonfinite="skip" (the poisoned step skipped on every rank, one event): in one process,
# tests/test_inprocess_strategies.py.
