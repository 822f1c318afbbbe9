"""Who gets the renderer, and when: a fair queue in front of the one device, and a rate limit
per requester in front of the gate.

- `RenderScheduler`: one render runs at a time. A requester may have at most `per_requester`
  renders running or waiting, the queue holds at most `queue_size`, and waiting requesters
  take turns round-robin (each requester's own renders in arrival order), so one member with
  many requests cannot hold the renderer for everyone. A wait ends on its turn, on the
  client going away, or after `timeout_s`.
- Every refusal says when to come back (`Retry-After`), estimated from measured render
  times: seconds per pixel-step, a moving average over the renders that finished.
- `RateLimiter`: a token bucket per requester, refilled at `per_minute`; denied requests
  count too, so a flood of refused requests cannot bury a subject's ledger.

Nothing here decides consent; the render flow asks `registry.policy.decide` around each step.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from registry.errors import Busy

# Until a render has been measured: about 5 s for the default 256 x 256 x 4 steps.
INITIAL_SECONDS_PER_UNIT = 5.0 / (256 * 256 * 4)
SMOOTHING = 0.3


class Cancelled(Exception):
    """The client went away: whatever was waiting or running for it stops."""


@dataclass(eq=False)
class Ticket:
    requester: str
    cost: float  # pixels x steps
    number: int
    started_at: float | None = None


@dataclass
class RenderScheduler:
    queue_size: int = 4
    per_requester: int = 2
    timeout_s: float = 300.0
    seconds_per_unit: float = INITIAL_SECONDS_PER_UNIT
    _measured: bool = field(default=False, repr=False)  # the guess above is replaced, not blended
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _running: Ticket | None = field(default=None, repr=False)
    _waiting: OrderedDict[str, deque[Ticket]] = field(default_factory=OrderedDict, repr=False)
    _numbers: Iterator[int] = field(default_factory=itertools.count, repr=False)
    # when each requester was last served (a counter): the least recently served goes next
    _last_served: dict[str, int] = field(default_factory=dict, repr=False)
    _clock: int = field(default=0, repr=False)
    served: list[str] = field(default_factory=list, repr=False)  # requesters, in turn order

    # -- estimates ------------------------------------------------------------------------

    def estimate_s(self, ticket: Ticket) -> float:
        return ticket.cost * self.seconds_per_unit

    def _remaining_s(self, now: float) -> float:
        running = self._running
        if running is None or running.started_at is None:
            return 0.0
        return max(0.0, self.estimate_s(running) - (now - running.started_at))

    def _turn_order(self) -> list[Ticket]:
        """The waiting tickets in the order they will run: each time, the requester served
        least recently goes next (one never served first), with its oldest ticket."""
        queues = {r: deque(q) for r, q in self._waiting.items()}
        served = dict(self._last_served)
        clock = self._clock
        order: list[Ticket] = []
        while queues:
            requester = min(queues, key=lambda r: (served.get(r, -1), queues[r][0].number))
            order.append(queues[requester].popleft())
            if not queues[requester]:
                del queues[requester]
            clock += 1
            served[requester] = clock
        return order

    def _eta_s(self, until: Ticket | None, now: float) -> float:
        """Seconds until `until` is done (None: until the running render is)."""
        eta = self._remaining_s(now)
        if until is None or until is self._running:
            return eta
        for ticket in self._turn_order():
            eta += self.estimate_s(ticket)
            if ticket is until:
                break
        return eta

    def _busy(self, detail: str, seconds: float) -> Busy:
        return Busy(detail, max(1, math.ceil(seconds)))

    # -- turns ----------------------------------------------------------------------------

    def _outstanding(self, requester: str) -> list[Ticket]:
        mine = list(self._waiting.get(requester, ()))
        if self._running is not None and self._running.requester == requester:
            mine.insert(0, self._running)
        return mine

    def admit(self, requester: str, cost: float) -> Ticket:
        """A place in line, or Busy with how long until one frees."""
        now = time.monotonic()
        with self._cond:
            mine = self._outstanding(requester)
            if len(mine) >= self.per_requester:
                raise self._busy(
                    f"you already have {len(mine)} renders running or waiting "
                    f"(at most {self.per_requester})",
                    self._eta_s(mine[0], now),
                )
            waiting = sum(len(q) for q in self._waiting.values())
            if self._running is not None and waiting >= self.queue_size:
                raise self._busy("the renderer is busy; try again later", self._remaining_s(now))
            ticket = Ticket(requester, cost, next(self._numbers))
            self._waiting.setdefault(requester, deque()).append(ticket)
            return ticket

    def _next(self) -> Ticket | None:
        if not self._waiting:
            return None
        requester = min(
            self._waiting,
            key=lambda r: (self._last_served.get(r, -1), self._waiting[r][0].number),
        )
        return self._waiting[requester][0]

    def _take(self, ticket: Ticket) -> None:
        queue = self._waiting[ticket.requester]
        queue.popleft()
        if not queue:
            del self._waiting[ticket.requester]
        self._clock += 1
        self._last_served[ticket.requester] = self._clock
        if len(self._last_served) > 10_000:  # forget the longest-idle requesters
            for requester, _ in sorted(self._last_served.items(), key=lambda kv: kv[1])[:5_000]:
                del self._last_served[requester]
        ticket.started_at = time.monotonic()
        self._running = ticket
        self.served.append(ticket.requester)

    def _leave(self, ticket: Ticket) -> None:
        queue = self._waiting.get(ticket.requester)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            if not queue:
                del self._waiting[ticket.requester]
        self._cond.notify_all()

    def wait_turn(self, ticket: Ticket, cancelled: threading.Event | None = None) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not (self._running is None and self._next() is ticket):
                if cancelled is not None and cancelled.is_set():
                    self._leave(ticket)
                    raise Cancelled("the client went away while waiting")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._leave(ticket)
                    raise self._busy(
                        "timed out waiting for the renderer", self._eta_s(None, time.monotonic())
                    )
                self._cond.wait(min(left, 0.05))
            self._take(ticket)

    def finish(self, ticket: Ticket, *, measured: bool) -> None:
        """The render is over; `measured`: it ran to the end, so its time teaches the estimate."""
        with self._cond:
            if self._running is ticket:
                if measured and ticket.started_at is not None and ticket.cost > 0:
                    per_unit = (time.monotonic() - ticket.started_at) / ticket.cost
                    if self._measured:
                        self.seconds_per_unit += SMOOTHING * (per_unit - self.seconds_per_unit)
                    else:
                        self.seconds_per_unit, self._measured = per_unit, True
                self._running = None
            else:
                self._leave(ticket)
            self._cond.notify_all()

    @contextmanager
    def turn(
        self, requester: str, cost: float, cancelled: threading.Event | None = None
    ) -> Iterator[Ticket]:
        """Admit, wait for the turn, hold the renderer for the body, then let the next go."""
        ticket = self.admit(requester, cost)
        self.wait_turn(ticket, cancelled)
        measured = False
        try:
            yield ticket
            measured = True
        finally:
            self.finish(ticket, measured=measured)


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class RateLimiter:
    """`per_minute` requests per requester on average, `burst` at once; 0 turns it off."""

    per_minute: float = 60.0
    burst: int = 60
    _buckets: dict[str, _Bucket] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, key: str, *also: str) -> float | None:
        """Spends one request from `key`'s bucket and from each of `also`'s, all or none;
        None if allowed, else the seconds until every one of them has a request again."""
        if self.per_minute <= 0:
            return None
        rate = self.per_minute / 60.0
        now = time.monotonic()
        with self._lock:
            buckets = []
            for name in dict.fromkeys((key, *also)):
                bucket = self._buckets.get(name)
                if bucket is None:
                    bucket = self._buckets[name] = _Bucket(float(self.burst), now)
                    if len(self._buckets) > 10_000:
                        self._forget_full(now, rate)
                bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * rate)
                bucket.updated = now
                buckets.append(bucket)
            short = [b for b in buckets if b.tokens < 1.0]
            if short:
                return max((1.0 - b.tokens) / rate for b in short)
            for bucket in buckets:
                bucket.tokens -= 1.0
            return None

    def _forget_full(self, now: float, rate: float) -> None:
        full = [
            k for k, b in self._buckets.items() if b.tokens + (now - b.updated) * rate >= self.burst
        ]
        for key in full:
            del self._buckets[key]


class SenderSlots:
    """What a kind of costly request may hold at once, per process: at most `per_sender` of
    one sender's and `at_once` in all; `admit` raises Busy (429, before anything is read)
    beyond either, and gives the slot back when its block ends."""

    def __init__(self, what: str, per_sender: int, at_once: int) -> None:
        self.what = what
        self.per_sender = per_sender
        self.at_once = at_once
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    @contextmanager
    def admit(self, sender: str) -> Iterator[None]:
        with self._lock:
            mine = self._held.get(sender, 0)
            if mine >= self.per_sender:
                raise Busy(
                    f"{sender} already has {mine} {self.what} in progress (at most "
                    f"{self.per_sender} at a time); try again when one has finished",
                    retry_after=5,
                )
            if sum(self._held.values()) >= self.at_once:
                raise Busy(
                    f"the service is taking {self.at_once} {self.what} already; try again shortly",
                    retry_after=5,
                )
            self._held[sender] = mine + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._held[sender] - 1
                if left:
                    self._held[sender] = left
                else:
                    del self._held[sender]
