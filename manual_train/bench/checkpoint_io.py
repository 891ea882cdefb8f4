"""How long a save blocks the training loop: last.pt (gathered to rank 0) vs --checkpoint-format dcp (every rank its
shards), synchronous vs --async-checkpoint (docs/checkpointing.md, "Async saves").

blocked_rows() starts `world_size` gloo processes on this machine and runs the ZeRO loop (FSDP2, --stage 2) three
times, saving every `every` optimizer steps: --checkpoint-format pt, dcp, and dcp with --async-checkpoint. Each run's
summary.json has checkpoint_blocked_s_per_save: the seconds Run.save kept the loop waiting, each save (rank 0's; the
other ranks wait for it at the save's barrier). Under async the loop waits for the copy of its shards to host memory,
and for the previous save's write to finish (one write in flight). The model is the mlp on 3x64x64 synthetic
images: 1.6M parameters, 6 MB of fp32 weights plus 13 MB of AdamW state.
In the CPU suite: manual_train/bench/cpu.py's entry checkpoint_io calls blocked_rows.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from manual_train.bench.harness import spawn_ranks
from manual_train.distributed import _free_port

VARIANTS = {"pt, sync": dict(checkpoint_format="pt"), "dcp, sync": dict(checkpoint_format="dcp"),
            "dcp, async": dict(checkpoint_format="dcp", async_checkpoint=True)}
CLAIMS = {"dcp, sync": "(no number claimed)", "dcp, async": "(no number claimed)"}
FLAGS = dict(model="mlp", dataset="synthetic", synthetic_classes=10, optimizer="adamw",
             impl="torch", stage=2, log_every=1000, progress=False, eval_every=1000)


def _rank_child(rank: int, world_size: int, ports: list, root: str, steps: int, every: int, shape: str, out) -> None:
    from manual_train.config import config_from
    from manual_train.loops import zero as zero_loop

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    for (name, flags), port in zip(VARIANTS.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        cfg = config_from(zero_loop.ZeroConfig, **FLAGS, **flags, synthetic_shape=shape, batch_size=8,
                          synthetic_size=8 * world_size * steps, max_steps=steps, checkpoint_every_steps=every,
                          out_dir=str(Path(root) / name.replace(", ", "-")))
        summary = zero_loop.train(cfg)
        if rank == 0:
            out[name] = summary["checkpoint_blocked_s_per_save"]


def blocked_rows(world_size: int = 2, steps: int = 8, every: int = 2, shape: str = "3,64,64") -> list[dict]:
    """One row per variant: the seconds each save blocked the loop (rank 0), in order. world_size 1 runs in this
    process (a group of one; the caller restores os.environ), the others in fresh ones."""
    with tempfile.TemporaryDirectory() as root:
        ports = [_free_port() for _ in VARIANTS]
        if world_size == 1:
            out, threads = {}, torch.get_num_threads()
            try:
                _rank_child(0, 1, ports, root, steps, every, shape, out)
            finally:
                torch.set_num_threads(threads)
        else:
            out = spawn_ranks(_rank_child, world_size, world_size, ports, root, steps, every, shape)
        return [dict(variant=name, world_size=world_size, blocked_s=list(out[name])) for name in VARIANTS]


def checkpoint_io_entry(bench):
    """The CPU suite's entry: blocked seconds per save, each variant vs pt's synchronous save."""
    from manual_train.bench.harness import Outcome, ratio_row

    raw = blocked_rows(steps=bench.pick(4, 8))
    base = raw[0]
    rows = [ratio_row(bench.entry, base["variant"], r["variant"], "seconds the loop is blocked per save (rank 0)",
                      base["blocked_s"], r["blocked_s"], claim=CLAIMS[r["variant"]]) for r in raw[1:]]
    notes = ["ZeRO loop, FSDP2 stage 2, 2 gloo ranks, mlp on 3x64x64 (1.6M parameters: 6 MB weights + 13 MB AdamW "
             "state), a save every 2 steps. pt gathers the full state to rank 0 and writes one file; dcp writes each "
             "rank's shards in parallel; async copies them to host memory and writes in a thread, the next save "
             "waiting for it. " + "; ".join(f"{r['variant']}: " + ", ".join(f"{x:.3f}" for x in r["blocked_s"]) + " s"
                                            for r in raw)]
    return Outcome(rows, {"rows": raw}, notes)


if __name__ == "__main__":
    for row in blocked_rows():
        print(row)
