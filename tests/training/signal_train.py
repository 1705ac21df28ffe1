"""Test-only entry point: the real trainer, with real signals sent at chosen moments.

    python -m tests.training.signal_train --config ... [overrides]

- ``SIGNAL_AT_SAVE="4:SIGKILL"`` (or ``"4:SIGINT,SIGINT"``): while the checkpoint of step 4 is
  being saved (its folder exists, Megatron is pickling the common state, no tensor file yet), the
  process sends itself these signals, one after the other, with ``os.kill``.
- ``PAUSE_AT_STEP=2 PAUSE_UNTIL=<file>``: step 3 starts (the stop check after step 2 and its
  save are done), creates ``<file>.paused`` and waits until ``<file>`` exists, so a test can act
  on a run known to be mid-way (start a second run, signal it): it stops after step 3.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time

from mcore_npu.training import train


class _SignalsWhenPickled:
    """Pickled into ``common.pt`` as an empty OrderedDict (loadable with ``weights_only``);
    pickling it sends the signals to this process."""

    def __init__(self, signals: list[int]) -> None:
        self.signals = signals

    def __reduce__(self):  # Megatron pickles the common state twice: signal the first time only
        signals, self.signals = self.signals, []
        for sig in signals:
            os.kill(os.getpid(), sig)
            time.sleep(0.01)  # the Python handler runs here, before the next signal is sent
        return (collections.OrderedDict, ())


class SignalTrainer(train.Trainer):
    def _checkpoint_state(self) -> dict:
        state = super()._checkpoint_state()
        step, _, names = os.environ.get("SIGNAL_AT_SAVE", "").partition(":")
        if step and int(step) == self.step:
            state["signal_probe"] = _SignalsWhenPickled(
                [signal.Signals[n] for n in names.split(",")]
            )
        return state

    def train_step(self):
        if os.environ.get("PAUSE_AT_STEP") and int(os.environ["PAUSE_AT_STEP"]) == self.step:
            with open(os.environ["PAUSE_UNTIL"] + ".paused", "w"):
                pass
            while not os.path.exists(os.environ["PAUSE_UNTIL"]):
                time.sleep(0.05)
        return super().train_step()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    sys.exit(train.run(parser.parse_args(), trainer_class=SignalTrainer))
