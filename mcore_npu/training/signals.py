"""SIGTERM and SIGINT stop a training run after the current step, never in the middle of one.

The handler only records the signal (raising inside arbitrary code could be swallowed); the loop
reads ``StopRequest.signum`` after each step. A second SIGINT exits at once with 130, unsaved.
"""

from __future__ import annotations

import os
import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installs the handlers in ``__enter__`` (main thread only) and restores them on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None and signum == signal.SIGINT:
            os.write(2, b"mcore-npu train: second SIGINT: exiting at once, without saving\n")
            os._exit(128 + signum)
        if self.signum is None:
            self.signum = signum
            os.write(2, f"mcore-npu train: {name}: stopping after the current step\n".encode())

    @property
    def exit_code(self) -> int:
        return 0 if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name
