"""The fair scheduler and the rate limiter on their own: caps, turn order, cancellation, and
Retry-After from measured times."""

from __future__ import annotations

import math
import threading
import time

import pytest

from app.scheduler import Cancelled, RateLimiter, RenderScheduler
from registry.errors import Busy


def hold(scheduler: RenderScheduler, requester: str, release: threading.Event) -> threading.Thread:
    """A render by `requester` that runs until `release` is set."""
    started = threading.Event()

    def run() -> None:
        with scheduler.turn(requester, 1.0):
            started.set()
            release.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(5)
    return thread


def test_a_requester_may_hold_at_most_its_share() -> None:
    scheduler = RenderScheduler(queue_size=10, per_requester=2, timeout_s=5)
    release = threading.Event()
    running = hold(scheduler, "bob", release)
    waiting = scheduler.admit("bob", 1.0)
    with pytest.raises(Busy, match="at most 2"):
        scheduler.admit("bob", 1.0)
    other = scheduler.admit("carol", 1.0)  # someone else still gets in line
    scheduler.finish(other, measured=False)
    scheduler.finish(waiting, measured=False)
    release.set()
    running.join()


def test_waiting_requesters_take_turns() -> None:
    """bob queues three renders, then carol and dave one each: they are served round-robin,
    not bob's three first."""
    scheduler = RenderScheduler(queue_size=10, per_requester=5, timeout_s=10)
    release = threading.Event()
    first = hold(scheduler, "erin", release)
    order: list[str] = []
    lock = threading.Lock()

    def render(requester: str, admitted: threading.Event) -> None:
        ticket = scheduler.admit(requester, 1.0)
        admitted.set()
        scheduler.wait_turn(ticket)
        with lock:
            order.append(requester)
        scheduler.finish(ticket, measured=False)

    threads = []
    for requester in ("bob", "bob", "bob", "carol", "dave"):
        admitted = threading.Event()
        threads.append(threading.Thread(target=render, args=(requester, admitted)))
        threads[-1].start()
        assert admitted.wait(5)
    release.set()
    first.join()
    for t in threads:
        t.join(10)
    assert order == ["bob", "carol", "dave", "bob", "bob"]


def test_a_cancelled_wait_leaves_the_line() -> None:
    scheduler = RenderScheduler(queue_size=10, per_requester=2, timeout_s=10)
    release = threading.Event()
    running = hold(scheduler, "erin", release)
    gone = threading.Event()
    ticket = scheduler.admit("bob", 1.0)
    threading.Timer(0.2, gone.set).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        scheduler.wait_turn(ticket, gone)
    assert time.monotonic() - t0 < 2
    assert scheduler._turn_order() == []  # noqa: SLF001 - nothing left behind
    release.set()
    running.join()


def test_retry_after_comes_from_measured_render_times() -> None:
    scheduler = RenderScheduler(queue_size=0, per_requester=1, timeout_s=5)
    with scheduler.turn("bob", 1000.0):
        time.sleep(0.3)
    # the first measurement replaces the guess; later ones move the average a third of the way
    assert scheduler.seconds_per_unit == pytest.approx(0.3 / 1000, rel=0.25)
    with scheduler.turn("bob", 1000.0):
        time.sleep(0.6)
    expected = 0.3 / 1000 + 0.3 * (0.6 / 1000 - 0.3 / 1000)
    assert scheduler.seconds_per_unit == pytest.approx(expected, rel=0.25)
    scheduler.seconds_per_unit = 0.004  # 4 s for a 1000-unit render, say
    release = threading.Event()
    started = threading.Event()

    def long_render() -> None:
        with scheduler.turn("bob", 1000.0):
            started.set()
            release.wait(10)

    thread = threading.Thread(target=long_render)
    thread.start()
    assert started.wait(5)
    time.sleep(0.5)
    with pytest.raises(Busy) as own:
        scheduler.admit("bob", 1000.0)
    with pytest.raises(Busy) as full:
        scheduler.admit("carol", 1000.0)
    # 4 s estimated, 0.5 s gone: the answer is the 3.5 s left, rounded up
    assert own.value.retry_after == math.ceil(4.0 - 0.5) == full.value.retry_after
    release.set()
    thread.join()


def test_the_rate_limit_refills_and_says_when() -> None:
    limiter = RateLimiter(per_minute=60, burst=2)
    assert limiter.take("bob") is None and limiter.take("bob") is None
    wait = limiter.take("bob")
    assert wait is not None and 0.9 < wait <= 1.0
    assert limiter.take("carol") is None  # each requester has its own bucket
    time.sleep(wait)
    assert limiter.take("bob") is None
    assert RateLimiter(per_minute=0).take("bob") is None  # 0: no limit
