"""A frozen worker is found, named and blamed (pure pieces of the watchdog, in-process)."""
import signal
import subprocess
import sys

from lightning_straggler.launcher import Report, backstop_timeout_s, blame
from lightning_straggler.watchdog import CollectiveBoard, process_stopped


def _board(now):
    board = CollectiveBoard(4)
    for r in (0, 1, 3):
        board.enter(r, "grads.all")
        board._since[r] = now - 21
    board.enter(2, "grads.all")
    board.leave(2)
    board._last[2] = now - 25
    return board


def test_stopped_rank_is_frozen_and_named_with_the_collective_the_others_wait_in():
    now = 1000.0
    frozen = _board(now).frozen([0, 1, 2, 3], stopped=[2], timeout_s=20, now=now)
    assert list(frozen) == [2]
    text = frozen[2]
    assert "stopped (SIGSTOP" in text and "ranks 0, 1, 3 wait in 'grads.all' for 21 s" in text
    assert "its last one 'grads.all' ended 25 s ago" in text and "SIGKILL" in text


def test_rank_out_of_collectives_is_frozen_only_once_the_others_waited_past_the_limit():
    now = 1000.0
    board = _board(now)
    assert board.frozen([0, 1, 2, 3], stopped=[], timeout_s=30, now=now) == {}  # 21 s < 30 s: a straggler
    frozen = board.frozen([0, 1, 2, 3], stopped=[], timeout_s=20, now=now)
    assert list(frozen) == [2] and "stuck in its own code" in frozen[2]


def test_stopped_inside_the_collective_itself():
    now = 1000.0
    board = _board(now)
    board.enter(2, "grads.all")
    board._since[2] = now - 22
    frozen = board.frozen([0, 1, 2, 3], stopped=[2], timeout_s=20, now=now)
    assert list(frozen) == [2] and "itself inside 'grads.all' for 22 s" in frozen[2]
    # nobody stopped and everyone in a collective: a stall with no single culprit
    assert board.frozen([0, 1, 2, 3], stopped=[], timeout_s=20, now=now) == {}


def test_frozen_rank_is_blamed_and_dead_not_the_healthy_ranks_that_aborted():
    desc = "froze: stopped (SIGSTOP or a debugger), ...; ended with SIGKILL"
    reports = [Report(0, -signal.SIGABRT, seen=50.0), Report(1, -signal.SIGABRT, seen=50.1),
               Report(3, -signal.SIGABRT, seen=50.2), Report(2, -signal.SIGKILL, seen=56.0, frozen=desc)]
    for order in (reports, reports[::-1]):
        failure = blame(order, 4)
        assert (failure.kind, failure.rank, failure.dead_ranks) == ("frozen", 2, [2])
        assert str(failure).startswith("worker rank 2 (of 4) froze: stopped")


def test_process_stopped_reads_the_process_state():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        for _ in range(100):
            if process_stopped(child.pid):
                break
            import time
            time.sleep(0.02)
        assert process_stopped(child.pid)
    finally:
        child.kill()
        child.wait(10)
    assert not process_stopped(child.pid)  # gone


def test_horovod_and_gloo_give_up_well_after_the_watchdog():
    assert backstop_timeout_s(20) == 110 and backstop_timeout_s(300) == 1230


def test_busy_rank_is_a_straggler_until_three_times_the_limit():
    now = 1000.0
    board = _board(now)
    assert board.frozen([0, 1, 2, 3], stopped=[], timeout_s=20, now=now, busy=[2]) == {}  # 21 s: busy, wait
    for r in (0, 1, 3):
        board._since[r] = now - 61
    frozen = board.frozen([0, 1, 2, 3], stopped=[], timeout_s=20, now=now, busy=[2])
    assert list(frozen) == [2] and "busy in its own code for too long" in frozen[2]


def test_main_thread_cpu_moves_only_while_it_runs():
    import time

    from lightning_straggler.watchdog import main_thread_cpu

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # the idle child says when its start-up (which uses CPU: on a loaded machine for longer than any fixed
    # pause) is over
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        a = (main_thread_cpu(spin.pid), main_thread_cpu(idle.pid))
        time.sleep(1.5)
        b = (main_thread_cpu(spin.pid), main_thread_cpu(idle.pid))
        assert b[0] > a[0] and b[1] == a[1]
    finally:
        spin.kill(), idle.kill()
        spin.wait(10), idle.wait(10)
    assert main_thread_cpu(spin.pid) is None
