"""launch/single.py with a fault injected (tests/faults.py), as tests/faulty_ddp.py is launch/ddp.py's.

    python tests/faulty_single.py --fail-at-step 25 --fail-mode kill <single flags>
"""
import argparse
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from faults import MODES, inject  # noqa: E402

from manual_train.cli import run  # noqa: E402
from manual_train.loops import single  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--fail-at-step", type=int, required=True, help="optimizer steps done when it fails")
    parser.add_argument("--fail-mode", choices=MODES, default="kill")
    fault, rest = parser.parse_known_args()
    inject(single, fault.fail_at_step, 0, fault.fail_mode)
    sys.exit(run(single.train, script="single", doc=single.__doc__, argv=rest))
