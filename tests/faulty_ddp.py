"""launch/ddp.py with a fault injected (tests/faults.py): the tests' seam for failures under real torchrun.

    torchrun --nproc_per_node=2 tests/faulty_ddp.py --fail-at-step 5 --fail-rank 1 --fail-mode raise <ddp flags>
"""
import argparse
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from faults import MODES, inject  # noqa: E402

from manual_train.cli import run  # noqa: E402
from manual_train.loops import ddp  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--fail-at-step", type=int, required=True, help="optimizer steps done when it fails")
    parser.add_argument("--fail-rank", type=int, default=0, help="the global rank that fails")
    parser.add_argument("--fail-mode", choices=MODES, default="raise")
    fault, rest = parser.parse_known_args()
    inject(ddp, fault.fail_at_step, fault.fail_rank, fault.fail_mode)
    sys.exit(run(ddp.train, ddp.DDPConfig, script="ddp", doc=ddp.__doc__, argv=rest, **ddp.DEFAULTS))
