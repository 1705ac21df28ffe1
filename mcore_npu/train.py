"""``python -m mcore_npu.train``: the trainer's launcher name, kept short for ``torchrun``.

``torchrun --standalone --nproc-per-node 2 -m mcore_npu.train --config ...`` is the same program
as ``mcore-npu train``; the trainer itself lives in :mod:`mcore_npu.training.train`.
"""

import sys

from mcore_npu.training.train import main

if __name__ == "__main__":
    sys.exit(main())
