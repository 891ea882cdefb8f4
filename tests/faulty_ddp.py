"""launch/ddp.py with a fault injected (tests/faults.py): the tests' seam for failures in a real process.

    torchrun --nproc_per_node=2 tests/faulty_ddp.py --fail-at-step 5 --fail-rank 1 --fail-mode raise <ddp flags>
"""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from faults import main  # noqa: E402

from manual_train.loops import ddp  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(main(ddp, "ddp", "raise", ddp.DDPConfig, ddp.DEFAULTS))
