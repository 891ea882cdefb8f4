"""Train the GPT with pipeline parallelism (manual_train/loops/pipeline.py). `--help` lists every flag.

    torchrun --nproc_per_node=2 launch/pipeline.py   # one stage per rank; python launch/pipeline.py is one stage
"""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import pipeline  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(pipeline.train, pipeline.PipelineConfig, script="pipeline", doc=pipeline.__doc__,
                 **pipeline.DEFAULTS))
