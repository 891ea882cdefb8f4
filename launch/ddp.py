"""Train with DistributedDataParallel (manual_train/loops/ddp.py). `--help` lists every flag.

    torchrun --nproc_per_node=4 launch/ddp.py      # one process per rank; python launch/ddp.py is a group of one
"""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import ddp  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(ddp.train, ddp.DDPConfig, script="ddp", doc=ddp.__doc__, **ddp.DEFAULTS))
