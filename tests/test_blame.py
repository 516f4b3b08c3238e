"""Which rank the launcher blames when workers fail (pure, in-process): the first cause wins, whatever
order the reports arrive in."""
import itertools
import signal

import pytest

from lightning_straggler.launcher import ABORTED, CONSEQUENCE, OWN, STOPPED, Report, blame, classify, exception_text


def _tb(exception_line, frames=("lightning/pytorch/trainer/trainer.py", "lightning_straggler/strategies/horovod_base.py")):
    lines = ["Traceback (most recent call last):"]
    for path in frames:
        lines += [f'  File "/site-packages/{path}", line 10, in run', "    do_it()"]
    return "\n".join(lines + [exception_line]) + "\n"


NONFINITE = _tb("lightning_straggler.strategies.horovod_base.NonFiniteError: non-finite loss or gradients from "
                "rank 2 at step 3 (dssync, seen by ranks [2]); training stopped before the update reached the model")
NO_SET = _tb("ValueError: Allreduce: Process set provided does not exist, or has not been registered.")
SHUT_DOWN = _tb("horovod.common.exceptions.HorovodInternalError: Horovod has been shut down. This was caused by an "
                "exception on one of the ranks or an attempt to allreduce, allgather or broadcast a tensor after "
                "one of the ranks finished execution.")
BROKEN = _tb("RuntimeError: Gloo error: [/horovod/third_party/gloo/gloo/transport/tcp/pair.cc:598] "
             "Connection closed by peer [127.0.0.1]:41231")
USER = _tb("ValueError: boom on purpose at step 4",
           frames=("horovod/torch/mpi_ops.py", "gloo/transport/whatever.py", "tests/reliability_helpers.py"))


def _orders(reports):
    return list(itertools.permutations(reports))


@pytest.mark.parametrize("consequence", [NO_SET, SHUT_DOWN, BROKEN], ids=["no-process-set", "shut-down", "broken"])
def test_own_exception_wins_over_consequences_in_every_arrival_order(consequence):
    # the race seen on a fresh clone: rank 0's consequence arrived (and was even noted) first
    reports = [Report(0, 1, consequence, noted=100.0, seen=100.1), Report(1, 1, consequence, noted=100.2, seen=100.3),
               Report(2, 1, NONFINITE, noted=100.5, seen=104.0)]
    for order in _orders(reports):
        failure = blame(order, 4)
        assert (failure.kind, failure.rank, failure.dead_ranks) == ("raised", 2, [2]), [r.rank for r in order]
        assert "non-finite loss or gradients from rank 2 at step 3" in str(failure)
        assert str(failure).startswith("worker rank 2 (of 4) raised lightning_straggler.strategies.horovod_base.NonFiniteError")
        assert "not blamed" in str(failure) and "rank 0 raised " + consequence.splitlines()[-1][:40] in str(failure)


def test_sigkill_wins_over_sigabrt_and_broken_connections_in_every_arrival_order():
    reports = [Report(0, -signal.SIGABRT, seen=10.0), Report(1, 1, BROKEN, noted=10.1, seen=10.2),
               Report(2, -signal.SIGKILL, seen=12.0), Report(3, -signal.SIGABRT, seen=10.05)]
    for order in _orders(reports):
        failure = blame(order, 4)
        assert (failure.kind, failure.rank, failure.dead_ranks) == ("died", 2, [2])
        assert "worker rank 2 (of 4) killed by SIGKILL" in str(failure)


def test_sigabrt_alone_is_blamed_only_when_it_is_the_only_one():
    # one rank aborted on its own (a C++ assertion) and its peers lost the connection
    lone = [Report(1, -signal.SIGABRT, seen=5.0), Report(0, 1, BROKEN, noted=5.1, seen=5.2)]
    for order in _orders(lone):
        assert (blame(order, 2).rank, blame(order, 2).dead_ranks) == (1, [1])
    # healthy ranks whose collective gave up (a frozen peer): nobody to restart without
    several = [Report(0, -signal.SIGABRT, seen=31.0), Report(1, -signal.SIGABRT, seen=30.0),
               Report(3, -signal.SIGABRT, seen=30.5)]
    for order in _orders(several):
        failure = blame(order, 4)
        assert failure.rank == 1 and failure.dead_ranks == []
        assert "no worker failed on its own" in str(failure)


def test_only_consequences_blame_the_earliest_and_nobody_dead():
    reports = [Report(3, 1, SHUT_DOWN, noted=7.0, seen=7.5), Report(1, 1, NO_SET, noted=6.0, seen=8.0)]
    for order in _orders(reports):
        failure = blame(order, 4)
        assert failure.rank == 1 and failure.dead_ranks == []


def test_several_own_failures_first_noted_first_and_all_dead():
    reports = [Report(1, 1, USER, noted=3.0, seen=3.5), Report(3, 1, USER, noted=2.0, seen=4.0),
               Report(0, 0, seen=1.0)]
    for order in _orders(reports):
        failure = blame(order, 4)
        assert failure.rank == 3 and failure.dead_ranks == [1, 3] and "-- also: rank 1 raised" in str(failure)


def test_a_rank_stopped_while_still_running_is_listed_never_blamed():
    # its exit code is the launcher's SIGTERM, which must not read as "killed by SIGTERM" (its own failure)
    stopped = Report(2, -signal.SIGTERM, stopped="was still running 5.0 s after the first failure; stopped by the launcher")
    reports = [Report(0, 1, SHUT_DOWN, noted=7.0, seen=7.5), Report(1, 1, USER, noted=6.0, seen=8.0), stopped]
    for order in _orders(reports):
        failure = blame(order, 3)
        assert failure.rank == 1 and failure.dead_ranks == [1] and len(failure.reports) == 3
        assert "rank 2 was still running 5.0 s after the first failure; stopped by the launcher" in str(failure)
    alone = blame([stopped, Report(0, 0, seen=1.0)], 2)
    assert alone.rank is None and alone.dead_ranks == [] and "without a reported failure" in str(alone)


def test_classification():
    assert classify(Report(0, -signal.SIGKILL))[:2] == (OWN, "died")
    assert classify(Report(0, -signal.SIGSEGV))[:2] == (OWN, "died")
    assert classify(Report(0, -signal.SIGABRT))[:2] == (ABORTED, "died")
    assert classify(Report(0, 3))[0] == OWN and "exited with code 3" in classify(Report(0, 3))[2]
    assert classify(Report(0, 1, USER))[:2] == (OWN, "raised")  # 'gloo' in a frame path is not the exception
    for text in (NO_SET, SHUT_DOWN, BROKEN):
        assert classify(Report(0, 1, text))[:2] == (CONSEQUENCE, "raised")
    assert classify(Report(0, -signal.SIGKILL, frozen="froze"))[:2] == (OWN, "frozen")
    assert classify(Report(0, -signal.SIGTERM, stopped="stopped"))[:2] == (STOPPED, "stopped")


def test_exception_text_takes_the_last_exception_of_a_chain():
    chained = USER + "\nDuring handling of the above exception, another exception occurred:\n\n" + SHUT_DOWN
    assert exception_text(chained).startswith("horovod.common.exceptions.HorovodInternalError")
    multi = _tb("RuntimeError: first line\nsecond line of the message")
    assert exception_text(multi) == "RuntimeError: first line\nsecond line of the message"
