"""`Workers`: the thread cap, idle exit, close, and that no queued task is stranded."""

from __future__ import annotations

import threading

import pytest

from kvhandoff.transport.workers import Workers
from tests.fakes import threads_named, wait_until


def test_threads_start_on_demand_up_to_the_cap_and_run_every_task() -> None:
    w = Workers(3, 60.0, name="wtest-cap")
    gate = threading.Event()
    started = threading.Semaphore(0)
    done: list[int] = []

    def task(i: int) -> None:
        started.release()
        gate.wait()
        done.append(i)

    for i in range(10):
        w.submit(lambda i=i: task(i))
    for _ in range(3):
        assert started.acquire(timeout=30)
    assert w.threads == 3 and threads_named("wtest-cap") == 3
    gate.set()
    wait_until(lambda: len(done) == 10, what="all tasks")
    assert sorted(done) == list(range(10))
    w.close()
    assert w.threads == 0 and threads_named("wtest-cap") == 0


def test_an_idle_thread_takes_the_next_task_instead_of_a_new_one_starting() -> None:
    w = Workers(4, 60.0, name="wtest-reuse")
    for _ in range(5):
        ran = threading.Event()
        w.submit(ran.set)
        assert ran.wait(30)
        wait_until(lambda: w._idle == w.threads, what="the thread to wait again")
    assert w.threads == 1
    w.close()


def test_threads_exit_after_idle_s_and_come_back_on_demand() -> None:
    w = Workers(2, 0.05, name="wtest-idle")
    ran = threading.Event()
    w.submit(ran.set)
    assert ran.wait(30)
    wait_until(lambda: w.threads == 0, what="the idle thread to exit")
    assert threads_named("wtest-idle") == 0
    again = threading.Event()
    w.submit(again.set)
    assert again.wait(30)
    w.close()


def test_close_runs_queued_tasks_and_follow_ups_then_refuses_new_ones() -> None:
    w = Workers(1, 60.0, name="wtest-close")
    gate = threading.Event()
    order: list[str] = []
    w.submit(gate.wait)
    w.submit(lambda: (order.append("queued"), w.submit(lambda: order.append("follow-up"))))
    closer = threading.Thread(target=w.close)
    closer.start()
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert order == ["queued", "follow-up"]
    with pytest.raises(RuntimeError):
        w.submit(lambda: None)
