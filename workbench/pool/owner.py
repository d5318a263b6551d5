"""Who does the pool's socket I/O: a caller waiting for its command, or a background thread between commands.

Latency of a round trip to the ranks is dominated by thread handoffs, not by
signing or pickling (~30 µs together). So there is no dedicated I/O thread
that every message passes through: the sockets are *owned* by whichever
thread needs them. A caller waiting for its command's results takes them and
polls them itself (no handoff); between commands a background thread takes
them over to deliver events, heartbeats and health checks. Messages sent from
other threads go to an outbox that the current owner flushes, woken through
`wake` (the switchboard's socket pair) when it is blocked in a poll.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("workbench.pool")


class SocketOwner:
    """Hands the sockets to one thread at a time. `serve(timeout_ms)` is one round of I/O, run by the owner."""

    def __init__(self, serve: Callable[[int], None], wake: Callable[[], None]) -> None:
        self._serve, self._wake = serve, wake
        self.lock = threading.Lock()  # whoever holds it does the socket I/O
        self.turns = threading.Condition()
        self.waiters = 0
        self.last_caller_io = 0.0
        self.polling = False
        """True while the owner is blocked in a poll (then `wake` makes it return)."""
        self.running = True
        self.thread = threading.Thread(target=self._background, name="workbench-pool-io", daemon=True)

    def start(self) -> None:
        """Start the background thread (once whoever `serve` belongs to is complete)."""
        self.thread.start()

    def wake_if_polling(self) -> None:
        if self.polling:
            self._wake()

    def wait(self, done: threading.Event, timeout: float | None) -> bool:
        """Wait for `done`, doing the socket I/O in this thread when no one else is: no thread handoff."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.turns:
            self.waiters += 1
        try:
            while not done.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.wake_if_polling()  # the background thread yields when it sees a waiter
                if self.lock.acquire(timeout=0.01):
                    try:
                        while not done.is_set() and self.running:
                            left = None if deadline is None else deadline - time.monotonic()
                            if left is not None and left <= 0:
                                return False
                            self._serve(50 if left is None else max(0, min(50, int(left * 1000))))
                    finally:
                        self.lock.release()
                else:
                    done.wait(0.01)
            return True
        finally:
            # No notify: waking the background thread here would make it contend for the GIL with this caller's
            # next command; it looks again within 20 ms anyway.
            with self.turns:
                self.waiters -= 1
                self.last_caller_io = time.monotonic()

    def owning(self) -> "_Owning":
        """Context manager: hold the sockets (to close or restart), taking them from the background thread."""
        return _Owning(self)

    def stop(self) -> None:
        """End the background thread (the sockets are closed next)."""
        self.running = False
        self.thread.join(2)

    def _background(self) -> None:
        """Serve the sockets while no caller waits: events, heartbeats and health between commands."""
        while self.running:
            with self.turns:
                # A caller that just waited will likely wait again soon (a loop of pool.run): leave it the socket.
                if self.waiters or time.monotonic() - self.last_caller_io < 0.1:
                    self.turns.wait(0.02)
                    continue
            if not self.lock.acquire(timeout=0.02):
                continue
            try:
                if self.running:
                    self._serve(20)
            except Exception:  # noqa: BLE001 - the I/O must survive anything a message does
                if not self.running:
                    return
                log.exception("workbench pool I/O error")
            finally:
                self.lock.release()


class _Owning:
    def __init__(self, owner: SocketOwner) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        with self.owner.turns:
            self.owner.waiters += 1
        self.owner.wake_if_polling()
        self.owner.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.owner.lock.release()
        with self.owner.turns:
            self.owner.waiters -= 1
            self.owner.turns.notify_all()
