"""launch/single.py with a fault injected (tests/faults.py): the tests' seam for failures in a real process.

    python tests/faulty_single.py --fail-at-step 25 --fail-mode kill <single flags>
"""
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from faults import main  # noqa: E402

from manual_train.loops import single  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(single, "single", "kill"))
