"""Train the GPT with tensor parallelism, or 2-D FSDP2 x TP (manual_train/loops/tensor_parallel.py). `--help` lists
every flag.

    torchrun --nproc_per_node=2 launch/tensor_parallel.py                  # --tp 2: attention and MLP split in two
    torchrun --nproc_per_node=4 launch/tensor_parallel.py --dp 2 --tp 2    # 2-D: FSDP2 over 2 replicas of --tp 2
    torchrun --nproc_per_node=4 launch/tensor_parallel.py --dp 2 --tp 2 --checkpoint-format dcp   # sharded last.dcp/
    torchrun --nproc_per_node=2 launch/tensor_parallel.py --resume RUN/last.dcp --batch-size 32  # resharded

--tp ranks split every block's weights (Megatron's column/row split) and compute each batch together; --dp
replicas (sharded by FSDP2, --stage 2 or 3) train on shares of every batch; --dp x --tp is the world size.
docs/tensor_parallel.md
"""
import gc
import os
import sys

gc.disable()  # no collections while torch imports: ~1 s less CPU per process (docs/levers.md)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from manual_train.cli import run  # noqa: E402
from manual_train.loops import tensor_parallel  # noqa: E402

gc.freeze()  # what the imports made lives as long as the process: collections skip it
gc.enable()

if __name__ == "__main__":
    sys.exit(run(tensor_parallel.train, tensor_parallel.TensorParallelConfig, script="tensor_parallel",
                 doc=tensor_parallel.__doc__, **tensor_parallel.DEFAULTS))
