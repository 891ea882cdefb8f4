"""Model parallelism: encoder and decoder on two devices, optionally pipelined (manual_train/loops/model_parallel.py).
Defaults to the reverse-digits seq2seq task. `--help` lists every flag."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import model_parallel  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(model_parallel.train, model_parallel.ModelParallelConfig, script="model_parallel",
                 doc=model_parallel.__doc__, **model_parallel.DEFAULTS))
