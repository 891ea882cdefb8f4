"""Model parallelism: encoder and decoder on two devices, optionally pipelined (manual_train/loops/model_parallel.py).
Defaults to the reverse-digits seq2seq task. `--help` lists every flag."""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import model_parallel  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(model_parallel.train, model_parallel.ModelParallelConfig, script="model_parallel",
                 doc=model_parallel.__doc__, **model_parallel.DEFAULTS))
