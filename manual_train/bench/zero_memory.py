"""ZeRO's memory per rank, measured by the benchmark: every rank's bytes next to the paper's formulas (docs/zero.md).

    measure_rank(configs)                 in a running process group: one step of each config, this rank's bytes
    measure_per_rank_bytes(N)             the benchmark's entry (cpu.py's zero_memory): N gloo processes, one
                                          AdamW step of DDP and of each ZeRO (impl, stage), every rank's bytes
The byte counts and formulas themselves (per_rank_bytes, zero_formula_bytes; the zero loop's end-of-run report)
are the library's: manual_train/memory.py.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from manual_train.memory import per_rank_bytes, state_bytes_per_param, storage_bytes, zero_formula_bytes
from manual_train.distributed import device_ids
from manual_train.zero import CPU_CAPABLE, ZeroConfig, shard


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
