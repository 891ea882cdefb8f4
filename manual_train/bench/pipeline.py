"""The pipeline's bubble, measured: each stage's idle fraction of a GPipe step vs (p-1)/(m+p-1) (docs/pipeline.md).

bubble_rows() starts one process per stage (gloo, this machine), runs the explicit GPipe schedule of
manual_train/pipeline.py on the reverse task's GPT for each micro-batch count m, and times what each stage spends
waiting in recv (for the previous stage's activations in the fill, the next stage's gradients in the drain) and at
the barrier that ends each step (a later stage's drain ends before stage 0's): that is its idle time. The formula
assumes every stage takes the same time per micro-batch and communication is free; on a loaded 2-core machine the
measured fractions scatter around it.
In the CPU suite: manual_train/bench/cpu.py's entry pipeline_bubble calls bubble_rows.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from manual_train.bench.harness import spawn_ranks
from manual_train.distributed import DistEnv, _free_port

BATCH = 256


def _stage_child(rank: int, stages: int, microbatches: tuple, steps: int, port: int, out) -> None:
    from manual_train import pipeline, tokens
    from manual_train.models import build_model
    from manual_train.pipeline import Pipeline, PipelineConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=stages)
    env = DistEnv(rank, rank, stages, stages, True)
    train, _, info = tokens.reverse_lm_datasets(BATCH)
    x, y = train.x, train.y
    idle = [0.0]
    real_recv = pipeline.recv

    def timed_recv(*args):  # the time this stage waits for a neighbour: its idle time
        t = time.perf_counter()
        buf = real_recv(*args)
        idle[0] += time.perf_counter() - t
        return buf

    pipeline.recv = timed_recv
    rows = []
    for m in microbatches:
        torch.manual_seed(0)
        cfg = PipelineConfig(model="gpt", dataset="reverse", microbatches=m)
        pipe = Pipeline(build_model("gpt", info), cfg, env, torch.device("cpu"))
        pipe.step(x, y, 1.0, y.numel(), nullcontext)  # warm-up
        dist.barrier()
        idle[0], t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            pipe.step(x, y, 1.0, y.numel(), nullcontext)
            t = time.perf_counter()
            dist.barrier()  # the step ends when the drain reaches stage 0: the later stages idle until then
            idle[0] += time.perf_counter() - t
        wall = time.perf_counter() - t0
        rows.append(idle[0] / wall)
    out[rank] = rows
    dist.destroy_process_group()


def bubble_rows(stages: int = 2, microbatches: tuple = (1, 2, 4, 8), steps: int = 5,
                start_method: str = "spawn") -> list[dict]:
    """One row per m: each stage's measured idle fraction and the formula's (p-1)/(m+p-1). start_method: as
    harness.spawn_ranks'."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = spawn_ranks(_stage_child, stages, stages, tuple(microbatches), steps, _free_port(),
                      start_method=start_method)
    per_stage = [out[r] for r in range(stages)]
    return [dict(stages=stages, microbatches=m, formula=(stages - 1) / (m + stages - 1),
                 idle_fraction_per_stage=[round(per_stage[r][i], 3) for r in range(stages)])
            for i, m in enumerate(microbatches)]


if __name__ == "__main__":
    for row in bubble_rows():
        print(row)
