"""``python -m mcore_npu.train`` (short for ``torchrun -m``): ``mcore-npu train``, whose trainer
is :mod:`mcore_npu.training.train`."""

import sys

from mcore_npu.training.train import main

if __name__ == "__main__":
    sys.exit(main())
