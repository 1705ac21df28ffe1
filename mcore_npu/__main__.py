"""``python -m mcore_npu`` is ``mcore-npu``."""

import sys

from mcore_npu.cli import main

if __name__ == "__main__":
    sys.exit(main())
