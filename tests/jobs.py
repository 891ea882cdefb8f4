"""Real multi-process jobs for tests: N ranks on gloo, torchrun's environment set by hand.

The ranks meet at TCPStores the test process hosts, as torchrun's agent hosts one
(TORCHELASTIC_USE_AGENT_STORE; manual_train/distributed.py, restart_safe_store): one store per scenario of
the job, each on a port the OS chose and held open for the whole job, so no port picked in advance can be
taken by another process on a shared machine, and no scenario's group meets the previous one's keys.
The ranks come from a forkserver that imported torch once, so a job costs its training time rather than
N imports of torch (~4 s each here).
"""
from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as tmp_mp


def _rank_entry(rank: int, scenario_fn: Callable, world_size: int, store_ports: list, out_dir: str,
                scenarios: list) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: several ranks share 2 cores
    results = {}
    for name, port in zip(scenarios, store_ports):
        os.environ["MASTER_PORT"] = str(port)
        results[name] = scenario_fn(name, world_size, rank, Path(out_dir))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


def run_job(scenario_fn: Callable, world_size: int, out_dir: Path, scenarios: list, preload: list) -> list[dict]:
    """Run scenario_fn(name, world_size, rank, out_dir) -> JSON-able dict on every rank, for each scenario in
    order; return each rank's {name: result}. An exception in any rank fails the job (and the test)."""
    if os.environ.get("JOB_SCENARIOS"):  # `make mutants`: only the scenarios the mutant's killing tests read
        scenarios = [s for s in scenarios if s in os.environ["JOB_SCENARIOS"].split(",")]
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", *preload])
    out_dir.mkdir(parents=True, exist_ok=True)
    stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # 0: the OS picks
              for _ in scenarios]
    try:
        tmp_mp.start_processes(_rank_entry, args=(scenario_fn, world_size, [s.port for s in stores], str(out_dir),
                                                  scenarios), nprocs=world_size, join=True, start_method="forkserver")
    finally:
        del stores  # closes the servers
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
