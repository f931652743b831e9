"""The background thread that drives a Scheduler (for servers): it steps while there is work and
sleeps until a submit or cancel wakes it."""
from __future__ import annotations

import threading
import time

from ..errors import GlmcoreError
from ..events import FinishReason
from .step import end


class BackgroundDriver:
    """Scheduler's start/stop; it uses the Scheduler's step, queue lock, wake event and slot table."""

    def start(self):
        """Drive the scheduler from a background thread (for servers)."""
        if self._thread is None:
            self.threaded, self._stop = True, False
            self._thread = threading.Thread(target=self._loop, name="glmcore-scheduler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop:
            try:
                busy = self.step()
            except Exception as e:     # a bug must not leave consumers waiting forever
                self._fail_all(GlmcoreError(f"internal error in the scheduler: {type(e).__name__}: {e}; "
                                            "please report"))
                continue
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _all(self) -> list:
        with self._lock:
            return list(self.waiting) + self.table.running()

    def _fail_all(self, err: GlmcoreError) -> None:
        states = self._all()
        with self._lock:
            self.waiting.clear()
        self._deliver([ev for s in states for ev in end(s, FinishReason.ERROR, err)])

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the background thread: running requests get grace_s to finish, then are cancelled."""
        deadline = time.monotonic() + grace_s
        while self._thread is not None and (self.waiting or self.busy_slots) and time.monotonic() < deadline:
            time.sleep(0.02)
        for s in self._all():
            s.handle.cancel()
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            # the loop reaps the cancelled requests at its next step before it exits
            self._thread.join(timeout=60)
            self._thread = None
        self.threaded = False
        self.step()
