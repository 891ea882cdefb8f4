"""Tensor parallelism's bytes, measured: held per rank and communicated per step, vs the formulas
(docs/tensor_parallel.md).

    CountComm                          a TorchDispatchMode that adds up the bytes handed to every collective
    comm_formula(...)                  Megatron: 2 all-reduces per block forward, 2 backward, of b*s*h elements
                                       each (sequence parallel: an all-gather and a reduce-scatter for each);
                                       2-D adds FSDP2's all-gather and reduce-scatter of the tp shard
    measure(shapes)                    the benchmark: dp x tp gloo processes (per shape), one AdamW step of the reverse
                                       task's GPT, every rank's bytes next to the formulas
The bytes held and their formula (per_rank_bytes, held_formula; the loop's end-of-run report, tp_report) are the
library's: manual_train/memory.py.
In the CPU suite: manual_train/bench/cpu.py's entry tensor_parallel calls tensor_parallel_entry.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from manual_train.bench.harness import spawn_ranks
from manual_train.memory import SPLIT, full_sizes, held_formula, per_rank_bytes


def comm_formula(n_layer: int, b: int, s: int, h: int, tp: int, dp: int, psi_per_tp_rank: float, stage: int,
                 element_size: int, sequence_parallel: bool = False) -> dict:
    """Bytes handed to collectives per rank per optimizer step (the payload, not the ring's 2(n-1)/n wire factor).

    TP (Megatron): each block all-reduces the attention's and the MLP's output in forward and their input's
    gradient in backward: 4 n_layer all-reduces of b*s*h elements, b the replica's batch. Sequence parallel: each
    of those becomes an all-gather and a reduce-scatter of b*s*h (8 n_layer; on a ring each moves (n-1)/n of it,
    the pair as much as one all-reduce), plus the sequence's way out (forward) and in (backward): 2 b*s*h more.
    FSDP2 over dp (2-D): one all-gather of the tp shard's parameters (psi/tp, gathered size) in forward, a second
    in backward under stage 3, and one reduce-scatter of its gradients."""
    activations = (8 * n_layer + 2 if sequence_parallel else 4 * n_layer) * b * s * h * element_size
    tp_bytes = activations if tp > 1 else 0
    gathers = 0 if dp == 1 else (2 if stage == 3 else 1)
    fsdp_bytes = int((gathers + (dp > 1)) * psi_per_tp_rank * element_size)
    return {"tp": tp_bytes, "fsdp": fsdp_bytes, "total": tp_bytes + fsdp_bytes}


class CountComm(TorchDispatchMode):
    """Bytes of the tensors handed to each collective op (DTensor's functional collectives, FSDP2's c10d calls),
    by kind. A collective's payload: the reduced tensor (all-reduce), the gathered output (all-gather), the input
    of a reduce-scatter."""

    KINDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast")

    def __init__(self):
        super().__init__()
        self.bytes: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # let DTensor run first and desugar into collectives we then see
            return NotImplemented  # (as torch's CommDebugMode); modes otherwise run before subclasses
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional") and any(k in name for k in self.KINDS):
            kind = "all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name else "all_reduce"
            if func.namespace == "_c10d_functional":  # (input, ...) -> output
                payload = out if kind == "all_gather" else args[0]
            else:  # c10d's in-place ops: (outputs, inputs, ...) or (tensors, ...)
                payload = args[1] if kind == "reduce_scatter" else args[0]
            tensors = payload if isinstance(payload, (list, tuple)) else [payload]
            self.bytes[kind] = self.bytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return out


def _child(rank: int, shapes: tuple, port: int, batch: int, out) -> None:
    from manual_train import tokens
    from manual_train.models import GPT_LAYERS, build_model, loss_fn
    from manual_train.tensor_parallel import TensorParallelConfig, parallelize

    dp, tp, sp = shapes
    world = dp * tp
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train, _, info = tokens.reverse_lm_datasets(batch * dp)
    x, y = train.x[rank // tp::dp], train.y[rank // tp::dp]
    torch.manual_seed(0)
    model = build_model("gpt", info)
    sizes = full_sizes(model)
    cfg = TensorParallelConfig(model="gpt", dataset="reverse", optimizer="adamw", dp=dp, tp=tp, sequence_parallel=sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded = parallelize(model, optimizer, cfg, torch.device("cpu"))
    with CountComm() as comm:
        loss_fn(sharded.model(x), y).backward()
        sharded.optimizer.step()
    held = per_rank_bytes(sharded.raw_model, sharded.optimizer)
    psi = sum(sizes.values())
    split = sum(n for name, n in sizes.items() if any(s in name for s in SPLIT))
    out[rank] = dict(dp=dp, tp=tp, held=held["total"], held_formula=held_formula(sizes, tp, dp, 4),
                     comm=comm.bytes, comm_total=sum(comm.bytes.values()),
                     comm_formula=comm_formula(GPT_LAYERS, x.shape[0], x.shape[1], 64, tp, dp,
                                               split / tp + psi - split, cfg.stage, 4, sp))
    dist.destroy_process_group()


def measure(shapes=((1, 2, False), (1, 2, True), (2, 2, False)), batch: int = 16,
            start_method: str = "spawn") -> list[dict]:
    """One row per (dp, tp, sequence parallel): every rank's bytes held and communicated in one step, and the
    formulas'. start_method: as harness.spawn_ranks'."""
    from manual_train.distributed import _free_port

    rows = []
    for dp, tp, sp in shapes:
        out = spawn_ranks(_child, dp * tp, (dp, tp, sp), _free_port(), batch, start_method=start_method)
        ranks = [out[r] for r in range(dp * tp)]
        rows.append(dict(dp=dp, tp=tp, sequence_parallel=sp, held_per_rank=[r["held"] for r in ranks],
                         held_formula=ranks[0]["held_formula"], comm_per_rank=[r["comm_total"] for r in ranks],
                         comm_by_kind=ranks[0]["comm"], comm_formula=ranks[0]["comm_formula"]))
    return rows


def tensor_parallel_entry(bench):
    """cpu.py's entry: bytes held per rank and communicated per step at (dp, tp) = (1, 2), the same with sequence
    parallel, and (2, 2)."""
    from manual_train.bench.harness import Outcome, value_row

    raw = measure()
    rows = []
    for r in raw:
        label = f"dp {r['dp']} x tp {r['tp']}" + (", sequence parallel" if r["sequence_parallel"] else "")
        rows.append(value_row(bench.entry, "formula", label, "bytes held per rank", r["held_per_rank"],
                              claim=f"(psi_split/tp + psi_rest)/dp x 16 = {r['held_formula']}"))
        rows.append(value_row(bench.entry, "formula", label, "bytes to collectives per rank per step",
                              r["comm_per_rank"], claim=f"Megatron (4 or 8 L + 2) b s h + FSDP = "
                                                        f"{r['comm_formula']['total']}"))
    notes = ["Held: local shards of parameters, gradients and AdamW state (FSDP pads each shard to whole rows). "
             "Communicated: the payload of every collective (all-reduced tensor, gathered output, reduce-scatter "
             "input), counted by a TorchDispatchMode; the wire carries 2(n-1)/n of an all-reduce per rank in a ring, "
             "(n-1)/n of an all-gather or reduce-scatter. Sequence parallel also reduces the LayerNorms' partial "
             "weight gradients in the optimizer step (12 KB here), which the formula leaves out."]
    return Outcome(rows, {"rows": raw}, notes)


if __name__ == "__main__":
    for row in measure():
        print(row)
