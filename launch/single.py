"""Train on one device: the baseline (manual_train/loops/single.py). `--help` lists every flag."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import single  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(single.train, script="single", doc=single.__doc__))
