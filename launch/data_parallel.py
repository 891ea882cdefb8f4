"""Data parallelism in one process: nn.DataParallel or its steps written out (manual_train/loops/data_parallel.py).
`--help` lists every flag."""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import data_parallel  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(data_parallel.train, data_parallel.DataParallelConfig, script="data_parallel",
                 doc=data_parallel.__doc__))
