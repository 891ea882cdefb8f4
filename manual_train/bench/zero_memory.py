"""ZeRO's memory per rank: the bytes each rank really holds, next to the paper's formulas (docs/zero.md).

    per_rank_bytes(model, optimizer)      storage held by this rank now: parameters, gradients, optimizer state
    zero_formula_bytes(psi, N, stage)     the ZeRO paper's per-rank model (stage 0: plain DDP)
    run_report(sharded)                   what the zero loop prints at the end and writes to summary.json
    measure_per_rank_bytes(N)             the benchmark's entry (cpu.py's zero_memory): N gloo processes, one
                                          AdamW step of DDP and of each ZeRO (impl, stage), every rank's bytes
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from manual_train.zero import CPU_CAPABLE, ZeroConfig, device_ids, shard


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


def run_report(sharded) -> tuple[str, dict]:
    """The zero loop's end-of-run report (zero.Sharded.memory_report): what each rank holds now, between steps
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


# ---------------------------------------------------------------------- the benchmark's multi-process measurement
def _input_batch(info, batch_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, *info.input_shape, generator=g), torch.randint(0, info.num_classes,
                                                                                  (batch_size,), generator=g)


def measure_rank(configs, model_name: str = "cnn", optimizer_name: str = "adamw", info=None, batch_size: int = 8,
                 device: torch.device = torch.device("cpu"), reduce_buffer_size: Optional[int] = None) -> list[dict]:
    """In a running process group: one training step per (impl, stage) (stage 0: plain DDP) and this rank's bytes.

    After the step, `params`/`grads`/`optimizer_state` are what stays allocated between steps;
    `params_after_forward` is what is held between forward and backward, where FSDP2's stage 2 (gathered
    parameters kept for backward) and stage 3 (freed, gathered again in backward) differ.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from manual_train.data import DataInfo
    from manual_train.models import build_model, loss_fn
    from manual_train.optim import build_optimizer

    info = info or DataInfo("digits", (1, 8, 8), 10)
    x, y = _input_batch(info, batch_size, seed=dist.get_rank())
    x, y = x.to(device), y.to(device)
    rows = []
    for impl, stage in configs:
        cfg = ZeroConfig(model=model_name, optimizer=optimizer_name, impl=impl, stage=max(stage, 1),
                         reduce_buffer_size=reduce_buffer_size)
        torch.manual_seed(0)
        raw_model = build_model(model_name, info).to(device)
        optimizer = build_optimizer(cfg, raw_model.parameters(), lr=1e-3)
        if stage == 0:
            model = DDP(raw_model, device_ids=device_ids(device))
            optimizer.zero_grad(set_to_none=True)
        else:
            sharded = shard(raw_model, optimizer, cfg, device)
            model, optimizer = sharded.model, sharded.optimizer
            sharded.zero_grad()
        held_before = list(model.parameters())  # FSDP2: the shards, which stay allocated through forward
        loss = loss_fn(model(x), y)
        params_after_forward = storage_bytes(held_before + list(model.parameters()))
        loss.backward()
        optimizer.step()
        rows.append({"impl": impl, "stage": stage, **per_rank_bytes(model, optimizer),
                     "params_after_forward": params_after_forward})
        del model, optimizer, raw_model, loss
    return rows


def _measure_main(rank: int, world_size: int, port: int, out_dir: str, configs, model_name: str,
                  optimizer_name: str) -> None:
    from manual_train.distributed import read_env, setup, teardown

    # torchrun's environment, its agent's store included: the parent holds the store's port open, so no other
    # process can take it between choosing it and using it (distributed.restart_safe_store joins it)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    torch.set_num_threads(1)
    setup(read_env(), torch.device("cpu"), "gloo", 300)
    try:
        rows = measure_rank(configs, model_name, optimizer_name)
    finally:
        teardown()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


def measure_per_rank_bytes(world_size: int, model_name: str = "cnn", optimizer_name: str = "adamw",
                           configs=(("ddp", 0),) + CPU_CAPABLE, start_method: str = "spawn") -> dict:
    """For the benchmark: per-rank bytes of DDP and each ZeRO (impl, stage) at N = world_size, with the formulas.

    Starts world_size CPU processes (gloo; `start_method` as torch.multiprocessing's, "forkserver" reuses a warm
    server), runs one step of each config in them (measure_rank), and returns
    {"world_size", "model", "psi", "bytes_per_param": {...}, "rows": [{"impl", "stage", "per_rank": [{"params",
    "grads", "optimizer_state", "total", "params_after_forward"}, ...one per rank], "formula": {...}}, ...]}
    where stage 0 is plain DDP and "formula" is zero_formula_bytes with fp32 `optimizer_name`'s bytes per parameter.
    Image models only (mlp, cnn, resnet18), on digits-shaped input (1 x 8 x 8, 10 classes).
    """
    import torch.multiprocessing as mp

    from manual_train.data import DataInfo
    from manual_train.models import build_model

    configs = [tuple(c) for c in configs]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # as torchrun's agent hosts it
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_measure_main, args=(world_size, store.port, out_dir, configs, model_name,
                                                optimizer_name), nprocs=world_size, join=True,
                           start_method=start_method)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    del store
    psi = sum(p.numel() for p in build_model(model_name, DataInfo("digits", (1, 8, 8), 10)).parameters())
    per_param = {"param_bytes": 4, "grad_bytes": 4, "state_bytes": state_bytes_per_param(optimizer_name)}
    rows = []
    for i, (impl, stage) in enumerate(configs):
        rows.append({"impl": impl, "stage": stage,
                     "per_rank": [{k: v for k, v in r[i].items() if k not in ("impl", "stage")} for r in ranks],
                     "formula": zero_formula_bytes(psi, world_size, stage, **per_param)})
    return {"world_size": world_size, "model": model_name, "psi": psi, "bytes_per_param": per_param, "rows": rows}
