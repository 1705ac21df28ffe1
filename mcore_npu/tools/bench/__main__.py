"""``python -m mcore_npu.tools.bench {attention,mask,step,cp,gdn,ssd,dsa}`` is ``mcore-npu bench``."""

import argparse
import sys

from mcore_npu._warnings import hide_known_harmless_warnings
from mcore_npu.tools.bench import add_arguments, run

if __name__ == "__main__":
    hide_known_harmless_warnings()
    parser = argparse.ArgumentParser(prog="python -m mcore_npu.tools.bench")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
