"""launch/zero.py with a fault injected (tests/faults.py), as tests/faulty_ddp.py is launch/ddp.py's.

    torchrun --nproc_per_node=2 tests/faulty_zero.py --fail-at-step 5 --fail-rank 1 --fail-mode term <zero flags>
"""
import argparse
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from faults import MODES, inject  # noqa: E402

from manual_train.cli import run  # noqa: E402
from manual_train.loops import zero  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--fail-at-step", type=int, required=True, help="optimizer steps done when it fails")
    parser.add_argument("--fail-rank", type=int, default=0, help="the global rank that fails")
    parser.add_argument("--fail-mode", choices=MODES, default="raise")
    fault, rest = parser.parse_known_args()
    inject(zero, fault.fail_at_step, fault.fail_rank, fault.fail_mode)
    sys.exit(run(zero.train, zero.ZeroConfig, script="zero", doc=zero.__doc__, argv=rest, **zero.DEFAULTS))
