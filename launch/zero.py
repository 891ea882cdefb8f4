"""Train with ZeRO sharding (manual_train/loops/zero.py). `--help` lists every flag.

    torchrun --nproc_per_node=4 launch/zero.py --stage 2   # one process per rank; plain python: a group of one
"""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import zero  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(zero.train, zero.ZeroConfig, script="zero", doc=zero.__doc__, **zero.DEFAULTS))
