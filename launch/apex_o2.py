"""Train with apex's O2 written out (manual_train/loops/apex_o2.py), or apex itself. `--help` lists every flag."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import apex_o2  # noqa: E402
from manual_train.apex_o2 import ApexO2Config  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(apex_o2.train, ApexO2Config, script="apex_o2", doc=apex_o2.__doc__))
