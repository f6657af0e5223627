"""The worker module (gthulhu_node/workers.py): a worker's thread is named, started and stopped through
one signal; a work queue coalesces wakes, keeps a gap an urgent wake cuts short, turns on a period, and
tells a waiter when its wake was handled. Real threads; the timings are generous bounds, not targets."""

from __future__ import annotations

import itertools
import threading
import time

from gthulhu_node.workers import Flag, Latest, WorkerThread, WorkQueue, run_in_thread, spawn


def test_a_worker_runs_on_its_named_thread_until_its_stop_signal() -> None:
    seen: list[str] = []

    def run(stop: Flag) -> None:
        seen.append(threading.current_thread().name)
        stop.wait()

    worker = WorkerThread("test-worker", run)
    worker.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.running and seen == ["test-worker"]
    worker.stop()
    assert not worker.running
    assert "test-worker" not in [t.name for t in threading.enumerate()]


def test_run_in_thread_waits_for_its_thread() -> None:
    names: list[str] = []
    run_in_thread("test-once", lambda: names.append(threading.current_thread().name))
    assert names == ["test-once"]


def _served(queue: WorkQueue, turn: object) -> tuple[WorkerThread, Flag]:
    worker = WorkerThread("test-queue", lambda stop: queue.serve(stop, turn))  # type: ignore[arg-type]
    queue.open()
    worker.start()
    return worker, Flag()


def test_wakes_during_a_turn_make_one_more_turn() -> None:
    queue = WorkQueue()
    entered, release = Flag(), Flag()
    turns: list[int] = []

    def turn() -> None:
        turns.append(len(turns))
        entered.set()
        release.wait(5)

    worker, _ = _served(queue, turn)
    try:
        queue.wake()
        assert entered.wait(5)
        for _ in range(10):
            queue.wake()
        release.set()
        assert queue.wait_handled(5)
        assert turns == [0, 1]  # the first wake's turn, and the ten coalesced into one
    finally:
        worker.stop()


def test_wait_handled_returns_at_once_when_nobody_serves() -> None:
    queue = WorkQueue()
    queue.wake()
    assert queue.wait_handled(0.1)  # nobody would ever answer: not a hang


def test_an_urgent_wake_cuts_the_gap_short() -> None:
    queue = WorkQueue(min_gap_s=60.0)
    turns: list[float] = []
    worker, _ = _served(queue, lambda: turns.append(time.monotonic()))
    try:
        queue.wake()
        assert queue.wait_handled(5) and len(turns) == 1
        queue.wake()
        assert not queue.wait_handled(0.2)  # within the minute's gap
        queue.wake(urgent=True)
        assert queue.wait_handled(5) and len(turns) == 2
    finally:
        worker.stop()


def test_a_period_turns_without_wakes_and_stop_ends_the_wait() -> None:
    queue = WorkQueue(period_s=0.05)
    turns: list[int] = []
    worker, _ = _served(queue, lambda: turns.append(1))
    deadline = time.monotonic() + 5
    while len(turns) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(turns) >= 3
    slow = WorkerThread("test-slow", lambda stop: WorkQueue(period_s=3600).serve(stop, lambda: None))
    slow.start()
    started = time.monotonic()
    slow.stop()
    worker.stop()
    assert time.monotonic() - started < 5  # the hour's wait ended by the stop signal


def test_a_failing_turn_does_not_end_the_queue() -> None:
    queue = WorkQueue(backoff_s=3600)
    turns: list[int] = []

    def turn() -> None:
        turns.append(1)
        raise RuntimeError("boom")

    worker, _ = _served(queue, turn)
    try:
        queue.wake()
        assert queue.wait_handled(5)
        queue.wake()  # a wake does not wait out the hour's backoff
        assert queue.wait_handled(5)
        assert len(turns) == 2
    finally:
        worker.stop()


def test_a_failing_turn_is_tried_again_with_a_doubling_backoff() -> None:
    queue = WorkQueue(backoff_s=0.05, max_backoff_s=0.2)
    turns: list[float] = []

    def turn() -> None:
        turns.append(time.monotonic())
        if len(turns) <= 4:
            raise RuntimeError("boom")

    worker, _ = _served(queue, turn)
    try:
        queue.wake()  # one wake: every later turn is a retry
        deadline = time.monotonic() + 10
        while len(turns) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # the fifth turn succeeded: no retry after it
    finally:
        worker.stop()
    assert len(turns) == 5
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(turns)]
    assert [g >= want for g, want in zip(gaps, [0.05, 0.1, 0.2, 0.2], strict=True)] == [True] * 4, gaps


def test_latest_wakes_a_waiter_on_a_ready_value_or_close() -> None:
    latest = Latest(0)
    got: list[int] = []
    waiter = spawn("test-latest", lambda: got.append(latest.wait_for(lambda v: v >= 2, 5)))
    latest.set(1)
    latest.set(2)
    waiter.join(5)
    assert got == [2]
    assert latest.wait_for(lambda v: v > 5, 0.01) == 2  # timed out: the value as it is
    latest.close()
    assert latest.wait_for(lambda v: v > 5, 5) == 2
