"""Train with apex's O2 written out (manual_train/loops/apex_o2.py), or apex itself. `--help` lists every flag."""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import apex_o2  # noqa: E402
from manual_train.apex_o2 import ApexO2Config  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(apex_o2.train, ApexO2Config, script="apex_o2", doc=apex_o2.__doc__))
