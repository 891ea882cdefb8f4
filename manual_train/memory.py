"""Bytes per rank: the storage each rank really holds, next to the formulas (docs/zero.md, docs/tensor_parallel.md).

    per_rank_bytes(model, optimizer)      storage held by this rank now: parameters, gradients, optimizer state
    zero_formula_bytes(psi, N, stage)     the ZeRO paper's per-rank model (stage 0: plain DDP)
    held_formula(sizes, tp, dp, bytes)    tensor parallelism's: the split weights / tp, the rest whole, / dp
    zero_report(sharded)                  what the zero loop prints at the end and writes to summary.json
    tp_report(tp)                         the same for the tensor-parallel loop
The benchmark measures with these in processes of its own (manual_train/bench/zero_memory.py, bench/tensor_parallel.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------- measured: storage held
def storage_bytes(tensors) -> int:
    """Bytes of the storage behind `tensors`, each storage once.

    Views of one buffer (OSS's and ShardedDDP's flat buckets, FSDP2's reduce-scatter output) count once, at the
    buffer's full size; a DTensor counts as its local shard (with FSDP's padding); freed storage counts 0.
    """
    from torch.distributed.tensor import DTensor

    seen = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_shard_state(optimizer) -> dict:
    """The optimizer state this rank holds: OSS and ZeroRedundancyOptimizer keep their shard's in .optim."""
    return getattr(optimizer, "optim", optimizer).state


def per_rank_bytes(model, optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds now (storage, not estimates).

    Not counted: communication buffers (DDP's gradient buckets, a second copy of the gradients), activations.
    """
    params = list(model.parameters())
    state = [v for s in optimizer_shard_state(optimizer).values() for v in s.values() if torch.is_tensor(v)]
    counts = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
              "optimizer_state": storage_bytes(state)}
    counts["total"] = sum(counts.values())
    return counts


# ---------------------------------------------------------------------- the paper's model
def state_bytes_per_param(optimizer_name: str, param_bytes: int = 4) -> int:
    """Optimizer state per parameter: AdamW two moments, SGD (momentum 0.9) one buffer, in the parameters' dtype."""
    return {"adamw": 2, "adam": 2, "sgd": 1}[optimizer_name.lower()] * param_bytes


def zero_formula_bytes(psi: int, world_size: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                       state_bytes: float = 12) -> dict:
    """The ZeRO paper's per-rank bytes (Rajbhandari et al. 2019, fig. 1) for psi parameters on N ranks.

    stage 0 is plain DDP: (2 + 2 + K) psi with the paper's mixed-precision Adam (fp16 parameters and gradients,
    K = 12: fp32 master weights, momentum and variance). Stage 1 divides the optimizer state by N (4 psi + K psi/N),
    stage 2 the gradients too (2 psi + (2 + K) psi/N), stage 3 everything ((4 + K) psi/N). Pass the bytes per
    parameter actually used, e.g. fp32 AdamW: param_bytes=4, grad_bytes=4, state_bytes=8.
    """
    n = world_size
    divisors = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    params, grads, state = (psi * b / d for b, d in zip((param_bytes, grad_bytes, state_bytes), divisors))
    return {"params": params, "grads": grads, "optimizer_state": state, "total": params + grads + state}


def format_table(title: str, measured: list[dict], formula: dict, ddp: Optional[dict] = None) -> str:
    """The per-rank table printed at the end of a run: measured bytes per rank, then the paper's model."""
    cols = ("params", "grads", "optimizer_state", "total")
    lines = [title, f"{'':<16}" + "".join(f"{c:>17}" for c in cols)]
    for rank, row in enumerate(measured):
        lines.append(f"{f'rank {rank}':<16}" + "".join(f"{row[c]:>17,}" for c in cols))
    lines.append(f"{'ZeRO formula':<16}" + "".join(f"{round(formula[c]):>17,}" for c in cols))
    if ddp is not None:
        lines.append(f"{'DDP formula':<16}" + "".join(f"{round(ddp[c]):>17,}" for c in cols))
    return "\n".join(lines)


def zero_report(sharded) -> tuple[str, dict]:
    """The zero loop's end-of-run report (sharding.Sharded.memory_report): what each rank holds now, between steps
    (the last step's gradients are still allocated), gathered from every rank (a collective), next to the
    formulas for this stage and for DDP. Returns (the table, the summary.json fields)."""
    from manual_train.precision import param_dtype

    cfg, world_size = sharded.cfg, dist.get_world_size()
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, per_rank_bytes(sharded.wrapper, sharded.optimizer))
    # the weights' dtype: fp32 in every precision but 64-true (autocast and FSDP's mixed precision compute in 16
    # bits from fp32 weights; the paper's 2 + 2 bytes are O2-style fp16 weights, which ZeRO does not run)
    nbytes = torch.empty((), dtype=param_dtype(cfg.precision)).element_size()
    per_param = dict(param_bytes=nbytes, grad_bytes=nbytes, state_bytes=state_bytes_per_param(cfg.optimizer, nbytes))
    formula = zero_formula_bytes(sharded.psi, world_size, cfg.stage, **per_param)
    formula_ddp = zero_formula_bytes(sharded.psi, world_size, 0, **per_param)
    table = format_table(f"bytes per rank (--impl {cfg.impl} --stage {cfg.stage}, {world_size} ranks, psi "
                         f"{sharded.psi:,}; formulas with {nbytes} + {nbytes} + {per_param['state_bytes']} bytes "
                         f"per parameter)", per_rank, formula, formula_ddp)
    return table, dict(zero_impl=cfg.impl, zero_stage=cfg.stage, psi=sharded.psi, per_rank_bytes=per_rank,
                       zero_formula_bytes=formula, ddp_formula_bytes=formula_ddp)


# ---------------------------------------------------------------------- tensor parallelism
# the parameters TP splits; the rest (row-wise biases too) is whole
SPLIT = (".attn.q.", ".attn.k.", ".attn.v.", ".attn.proj.weight", ".mlp.0.", ".mlp.2.weight")
OPTIMIZER_STATE_PER_PARAM = 2  # AdamW's exp_avg and exp_avg_sq


def held_formula(model_full_sizes: dict, tp: int, dp: int, element_size: int) -> int:
    """Bytes per rank of parameters + gradients + AdamW state: (psi_split / tp + psi_rest) / dp elements, each
    held (1 + 1 + 2) times. model_full_sizes: {name: numel} of the unsplit model (tied weights once)."""
    split = sum(n for name, n in model_full_sizes.items() if any(s in name for s in SPLIT))
    rest = sum(model_full_sizes.values()) - split
    return int((split / tp + rest) / dp * (2 + OPTIMIZER_STATE_PER_PARAM) * element_size)


def full_sizes(model: torch.nn.Module) -> dict:
    return {name: p.numel() for name, p in model.named_parameters()}  # DTensors: their global size


def tp_report(tp) -> tuple[str, dict]:
    """(console table, summary.json fields) for the loop's end: this rank's bytes and every rank's, vs the formula
    (a collective: every rank calls it)."""
    held = per_rank_bytes(tp.raw_model, tp.optimizer)["total"]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    element = next(tp.raw_model.parameters()).element_size()
    formula = held_formula(full_sizes(tp.raw_model), tp.tp, tp.dp, element)
    table = (f"bytes per rank (parameters + gradients + optimizer state): {every}; "
             f"formula (psi_split/tp + psi_rest)/dp x 4 x {element} = {formula}")
    return table, {"per_rank_bytes": every, "per_rank_bytes_formula": formula}
