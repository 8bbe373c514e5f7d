"""Which LoRAJob gets a pass next: the burst-first work queue, and the resync that re-queues them on time."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from lorajob_operator import caches
from lorajob_operator.caches import Caches, Key


class WorkQueue:
    """LoRAJob keys waiting for a pass, each at most once; a key being worked on is handed out again only
    after `done` (so passes over one LoRAJob never overlap). A key asked for with `read_progress` keeps it.

    A key added `urgent` (a LoRAJob whose spec no pass has acted on yet: new or edited) goes ahead of the
    others, which only follow up on children and time: in a burst the first JobSets are not queued behind
    the follow-ups of earlier LoRAJobs, and those follow-ups coalesce while they wait."""

    def __init__(self) -> None:
        self._urgent_order: collections.deque[Key] = collections.deque()
        self._order: collections.deque[Key] = collections.deque()
        self._waiting: dict[Key, bool] = {}
        """Key -> read_progress, for every key queued or re-added while being worked on."""
        self._urgent: set[Key] = set()
        """The waiting keys added urgent."""
        self._working: set[Key] = set()
        self._changed = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, key: Key, read_progress: bool = False, urgent: bool = False) -> None:
        with self._changed:
            if key in self._waiting:
                self._waiting[key] |= read_progress
                if urgent and key not in self._urgent:
                    self._urgent.add(key)
                    if key not in self._working:
                        self._order.remove(key)
                        self._urgent_order.append(key)
                return
            self._waiting[key] = read_progress
            if urgent:
                self._urgent.add(key)
            if key not in self._working:
                self._enqueue(key)

    def _enqueue(self, key: Key) -> None:
        (self._urgent_order if key in self._urgent else self._order).append(key)
        self._changed.notify()

    def get(self) -> tuple[Key, bool] | None:
        """The next key and its read_progress (blocks; None once closed)."""
        with self._changed:
            while not (self._urgent_order or self._order) and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            key = (self._urgent_order or self._order).popleft()
            self._urgent.discard(key)
            self._working.add(key)
            return key, self._waiting.pop(key)

    def done(self, key: Key) -> None:
        with self._changed:
            self._working.discard(key)
            if key in self._waiting:
                self._enqueue(key)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class Resync:
    """Queues every cached LoRAJob every `resync_seconds`, and single ones sooner when a pass asked to be
    looked at again (retry backoff, TTL, a blocked LoRAJob's recheck, the stall watchdog's deadline), both
    with read_progress.

    It reads the caches only: it re-runs decide on what the watches delivered, which catches an event
    whose pass was lost or failed, and drives time-based decisions (deadlines, TTL, backoff)."""

    def __init__(self, view: Caches, queue: WorkQueue, interval: float, before_full_pass: Callable[[], None] = lambda: None):
        self.view = view
        self.queue = queue
        self.interval = interval
        self.before_full_pass = before_full_pass
        self.last_pass = 0.0
        self._due: dict[Key, float] = {}
        self._due_lock = threading.Lock()  # worker threads schedule while the loop reads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lorajob-resync", daemon=True)

    def start(self) -> None:
        self.last_pass = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def schedule(self, key: Key, after: float | None) -> None:
        if after is not None:
            with self._due_lock:
                self._due[key] = min(self._due.get(key, float("inf")), time.monotonic() + after)

    def _take_due(self, now: float) -> list[Key]:
        with self._due_lock:
            keys = [key for key, due in self._due.items() if due <= now]
            for key in keys:
                del self._due[key]
            return keys

    def _next_due(self) -> float:
        with self._due_lock:
            return min(self._due.values(), default=float("inf"))

    def alive(self) -> bool:
        return self._thread.is_alive() and time.monotonic() - self.last_pass < 5 * self.interval + 60

    def _run(self) -> None:
        next_full = time.monotonic() + self.interval
        while not self._stop.is_set():
            now = time.monotonic()
            for key in self._take_due(now):
                # With the log: the stall watchdog's deadline pass judges the trainer's newest step.
                self.queue.add(key, read_progress=True)
            if now >= next_full:
                self.before_full_pass()
                for body in self.view.lorajobs():
                    self.queue.add(caches.key_of(body), read_progress=True)
                next_full = now + self.interval
                self.last_pass = now
            self._stop.wait(max(0.05, min(next_full, self._next_due()) - time.monotonic()))
