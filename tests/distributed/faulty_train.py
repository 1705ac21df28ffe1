"""Test-only entry point: the real trainer, with a failure injected on one rank mid-step.

    torchrun --standalone --nproc-per-node 2 -m tests.distributed.faulty_train --config ...

``FAULT_RANK`` picks the rank, ``FAULT_KIND`` is ``raise`` (an exception inside the forward
pass of step 3) or ``exit`` (the process dies there without a word, as on an OOM kill).
"""

from __future__ import annotations

import argparse
import os
import sys

from mcore_npu.training import train


class FaultyTrainer(train.Trainer):
    def _forward_step(self, data_iterator, model):
        rank = int(os.environ.get("RANK", 0))
        if self.step == 2 and rank == int(os.environ["FAULT_RANK"]):
            if os.environ["FAULT_KIND"] == "exit":
                os._exit(3)
            raise RuntimeError(f"injected failure on rank {rank} in step {self.step + 1}")
        return super()._forward_step(data_iterator, model)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    sys.exit(train.run(parser.parse_args(), trainer_class=FaultyTrainer))
