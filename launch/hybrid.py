"""Hybrid data + model parallelism (manual_train/loops/hybrid.py). `--help` lists every flag.

    python launch/hybrid.py --mode dp-mp                          # one process: DataParallel inside each half
    torchrun --nproc_per_node=2 launch/hybrid.py --mode ddp-mp    # one process per device pair, DDP over the split
"""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import hybrid  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(hybrid.train, hybrid.HybridConfig, script="hybrid", doc=hybrid.__doc__, **hybrid.DEFAULTS))
