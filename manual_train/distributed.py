"""Process-group set-up and teardown for scripts started by torchrun (or plain python: world size 1).

torchrun starts one process per rank and tells each who it is through the environment:
RANK (global index), LOCAL_RANK (index on this node: which GPU to use), WORLD_SIZE (all ranks),
LOCAL_WORLD_SIZE (ranks on this node), MASTER_ADDR/MASTER_PORT (where rank 0's store listens).
The order of set-up matters on GPUs: pick the device from LOCAL_RANK *before*
init_process_group, so NCCL binds each process to its own GPU instead of all to cuda:0.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from manual_train.config import UsageError, check_device_name


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launched: bool  # True under torchrun (RANK is set), False for plain `python launch/x.py`

    @property
    def master_process(self) -> bool:
        """Rank 0 alone prints, draws the progress bar and writes files."""
        return self.rank == 0


def read_env() -> DistEnv:
    """Who this process is, from torchrun's environment (a lone process is rank 0 of 1)."""
    launched = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    return DistEnv(rank=int(os.environ.get("RANK", 0)), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                   world_size=world_size,
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), launched=launched)


def pick_device(device_name: str, env: DistEnv) -> torch.device:
    """cpu, or this rank's GPU: cuda:LOCAL_RANK (auto/cuda), or the one named (cuda:N, single process)."""
    check_device_name(device_name, "--device")
    if device_name == "cpu" or (device_name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device_name.startswith("cuda:") and env.world_size == 1:
        return torch.device(device_name)
    if env.local_rank >= torch.cuda.device_count():
        raise UsageError("--device", f"local rank {env.local_rank} has no GPU: this node has "
                                     f"{torch.cuda.device_count()} CUDA device(s) for {env.local_world_size} "
                                     f"local ranks", "--device cpu, or fewer --nproc_per_node")
    return torch.device("cuda", env.local_rank)


def setup(env: DistEnv, device: torch.device, backend: str = "auto", timeout_s: float = 1800) -> None:
    """Bind the GPU, then join the process group (nccl for CUDA, gloo for CPU unless --backend says)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL uses the current device
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--backend", "nccl needs CUDA devices; on CPU use gloo", "auto, gloo")
    if not env.launched:
        # plain `python launch/ddp.py`: a group of one, so the same code path runs everywhere
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            store=restart_safe_store(env, timeout),
                            device_id=device if device.type == "cuda" else None)


def restart_safe_store(env: DistEnv, timeout: datetime.timedelta):
    """Under torchrun, the agent's store with this restart attempt's keys kept apart; None elsewhere (env://).

    torchrun's agent hosts one TCPStore at MASTER_ADDR:MASTER_PORT and (torch 2.14) keeps it across the
    restarts of --max-restarts. Its keys outlive a failed group, so the restarted group can read the dead
    ranks' addresses and fail to connect (gloo: "connectFullMesh failed ... Connection refused"; pytorch
    issue 167288). A prefix per attempt, as torch itself used before it shared the store, keeps each
    attempt's keys its own. (Setting TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun avoids it too.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=False, timeout=timeout)  # a client: the agent serves it
    return dist.PrefixStore(f"manual_train/attempt_{attempt}", store)


def teardown() -> None:
    """destroy_process_group on every exit path (call from a `finally`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
