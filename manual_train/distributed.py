"""Process-group set-up and teardown for scripts started by torchrun (or plain python: world size 1).

torchrun starts one process per rank and tells each who it is through the environment:
RANK (global index), LOCAL_RANK (index on this node: which GPU to use), WORLD_SIZE (all ranks),
LOCAL_WORLD_SIZE (ranks on this node), MASTER_ADDR/MASTER_PORT (where rank 0's store listens).
The order of set-up matters on GPUs: pick the device from LOCAL_RANK *before*
init_process_group, so NCCL binds each process to its own GPU instead of all to cuda:0.
"""
from __future__ import annotations

import datetime
import gc
import importlib
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from manual_train.config import Config, UsageError, arg, check_device_name


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


# What torchrun sets for every worker. A process given only some of them by hand (a stale shell, a wrong
# launcher) would wait for ranks that never come, or fail deep in set-up: read_env refuses it in one line.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def read_env() -> DistEnv:
    """Who this process is, from torchrun's environment (a lone process is rank 0 of 1)."""
    launched = "RANK" in os.environ
    if launched:
        missing = [name for name in LAUNCH_VARS if name not in os.environ]
        if missing:
            raise UsageError("RANK", f"is set but {', '.join(missing)} is not: this process was not started by "
                                     "torchrun", "torchrun --nproc_per_node=N launch/<script>.py, or unset RANK")
    elif _env_int("WORLD_SIZE", 1) != 1:
        raise UsageError("WORLD_SIZE", f"is {os.environ['WORLD_SIZE']} but RANK is not set: a lone process would "
                                       f"wait for ranks that never come", "torchrun --nproc_per_node="
                                       f"{os.environ['WORLD_SIZE']} launch/<script>.py, or unset WORLD_SIZE")
    world_size = _env_int("WORLD_SIZE", 1)
    env = DistEnv(rank=_env_int("RANK", 0), local_rank=_env_int("LOCAL_RANK", 0), world_size=world_size,
                  local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size), launched=launched)
    if not (0 <= env.rank < env.world_size and 0 <= env.local_rank < env.local_world_size <= env.world_size):
        raise UsageError("RANK", f"RANK {env.rank}, LOCAL_RANK {env.local_rank}, WORLD_SIZE {env.world_size}, "
                                 f"LOCAL_WORLD_SIZE {env.local_world_size} do not fit together",
                         "0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE (torchrun's)")
    return env


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise UsageError(name, f"{text!r} is not a whole number", "what torchrun sets") from None


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


def setup(env: DistEnv, device: torch.device, backend: str = "auto", timeout_s: float = 1800,
          bind_device: bool = True) -> None:
    """Bind the GPU, then join the process group (nccl for CUDA, gloo for CPU unless --backend says).

    bind_device=True also passes device_id= to init_process_group: nccl then sets up its communicator on that
    GPU at once, and refuses collectives on tensors on any other device. A rank that drives two GPUs (hybrid
    ddp-mp: DDP broadcasts parameters on both, evaluation's sums live on the decoder's) passes False: the
    group is not bound, and `device` is only the current CUDA device.
    """
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
    import_group_defaults()  # before the group exists: see its docstring (the abort at exit it prevents)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            store=restart_safe_store(env, timeout),
                            device_id=device if device.type == "cuda" and bind_device else None)


@contextmanager
def process_group(cfg, bind_device: bool = True) -> Iterator[tuple[DistEnv, torch.device]]:
    """`with process_group(cfg) as (env, device):` who this process is (torchrun's environment) and its device, inside
    the process group (--backend, --dist-timeout-s). The device (cfg.rank_device: cuda:LOCAL_RANK) is bound before
    init_process_group (setup; bind_device=False for a rank that drives several devices), and the group is left
    on every exit path (teardown): destroy_process_group frees the communicators and lets a process join another
    group later. Under plain python, a group of one: the same code path everywhere."""
    env = read_env()
    device = cfg.rank_device(env)
    setup(env, device, cfg.backend, cfg.dist_timeout_s, bind_device)
    try:
        yield env, device
    finally:
        teardown()


def restart_safe_store(env: DistEnv, timeout: datetime.timedelta):
    """Under torchrun, the agent's store with this restart attempt's keys kept apart; None elsewhere (env://).

    torchrun's agent hosts one TCPStore at MASTER_ADDR:MASTER_PORT and (torch 2.14) keeps it across the
    restarts of --max-restarts. Its keys outlive a failed group, so the restarted group can read the dead
    ranks' addresses and fail to connect (gloo: "connectFullMesh failed ... Connection refused";
    pytorch/pytorch#167288). A prefix per attempt, as torch itself used before it shared the store, keeps each
    attempt's keys its own. (Setting TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun avoids it too.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=False, timeout=timeout)  # a client: the agent serves it
    return dist.PrefixStore(f"manual_train/attempt_{attempt}", store)


# Modules that take `group=dist.group.WORLD` as a default argument: Python evaluates it once, at import. Imported
# while a group exists, they hold that group for the rest of the process (torch.distributed.nn.functional is
# imported by the first DDP(...), through torch._dynamo; torch.distributed.optim by ZeroRedundancyOptimizer and
# FSDP2; fairscale.optim by OSS and ShardedGradScaler). Imported before init_process_group, they hold None, which
# every collective reads as "the default group at call time".
GROUP_DEFAULT_MODULES = ("torch.distributed.nn", "torch.distributed.optim",
                         "torch.distributed.fsdp.sharded_grad_scaler", "fairscale.optim")


def import_group_defaults() -> None:
    """Import GROUP_DEFAULT_MODULES (those installed) while no process group exists.

    Why it matters: gloo's worker threads stop only when the group object is freed; destroy_process_group
    unregisters the group but cannot free it while a default argument still holds it. The threads then live
    into interpreter shutdown, and one of them may still be dropping the last collective's tensors (whose
    Python objects need the GIL): Python 3.11 ends a thread that asks for the GIL during finalization with
    pthread_exit, the unwind crosses a noexcept destructor (ProcessGroupGloo::AsyncWork), and C++ aborts:
    "terminate called without an active exception", SIGABRT, after `done:` was printed (a loaded machine
    stretches that window: about 1 run in 10 here). With the group freed in teardown(), its destructor joins
    the threads while the interpreter is whole. (~0.7 s here, which the first DDP(...) then no longer spends
    importing the same modules: no net cost for DDP.)
    """
    assert not (dist.is_available() and dist.is_initialized()), "import before init_process_group"
    for name in GROUP_DEFAULT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # fairscale is optional
            pass


def teardown() -> None:
    """destroy_process_group on every exit path (call from a `finally`), and free the group now.

    destroy_process_group unregisters the groups; they end (gloo joins its threads) only when the last reference
    goes. Three kinds outlive it: default arguments (import_group_defaults, at set-up), DeviceMeshes (below) and
    the loop's objects in reference cycles (DDP's reducer, FSDP2's state), which only the garbage collector frees.
    Costs ~0.2-0.4 s here, once per process (a full collection of a heap holding torch._dynamo's modules).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    _release_device_meshes()
    gc.collect()


def _release_device_meshes() -> None:
    """Drop the destroyed groups that DeviceMeshes still hold (FSDP2's mesh: --impl torch --stage 2, 3).

    DTensor's sharding caches keep every DeviceMesh they have seen for the life of the process, and each mesh
    holds its groups in `_pg_registry` (read only under torch.compile; eager code finds groups by name). The
    groups are destroyed by now, so the entries are dead weight that would keep gloo's threads running.
    """
    if "torch.distributed.device_mesh" not in sys.modules:  # never imported: no mesh exists
        return
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():  # ~0.03 s. (The MRO test, not isinstance: that reads deprecated torch objects.)
        if DeviceMesh in type(obj).__mro__ and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
POWERSGD_DEFAULTS = {"rank": 1, "start": 10}


@dataclass
class DDPConfig(Config):
    """The baseline's flags plus the process group's (torchrun's own flags go before the script name)."""

    backend: str = arg("auto", "process-group backend: auto = nccl for CUDA devices, gloo for the CPU",
                       choices=("auto", "nccl", "gloo"))
    dist_timeout_s: float = arg(1800.0, "seconds a collective waits for the other ranks before it fails "
                                        "(torch's default is 30 min; at most 1e7 s, about 115 days)",
                                min=0, min_exclusive=True, max=1e7)
    sync_bn: bool = arg(False, "convert BatchNorm layers to SyncBatchNorm: statistics over the global batch "
                               "(CUDA only)")
    # DDP's own knobs (docs/ddp_knobs.md has what each buys and costs, measured)
    bucket_cap_mb: Optional[float] = arg(None, "MiB per gradient bucket: each bucket is all-reduced as soon as its "
                                               "gradients exist (default: torch's 25, with a first bucket of 1 MiB); "
                                               "the same weights at any size", min=0, min_exclusive=True)
    gradient_as_bucket_view: bool = arg(False, "make each .grad a view into its all-reduce bucket: one copy of the "
                                               "gradients less; the same weights")
    static_graph: bool = arg(False, "promise that every step uses the same parameters: DDP plans once, after the "
                                    "first step; the same weights")
    find_unused_parameters: bool = arg(False, "search every step's graph for parameters forward did not use (needed "
                                              "when some are; costs a graph walk per step)")
    comm_hook: str = arg("none", "what the gradient all-reduce sends: none (DDP's exact all-reduce), fp16 or bf16 "
                                 "(half the bytes, lossy), powersgd (low-rank, lossy; on gloo only when every "
                                 "gradient fits in one bucket)", choices=COMM_HOOKS)
    powersgd_rank: Optional[int] = arg(None, "--comm-hook powersgd: rank of each gradient's approximation (default "
                                             f"{POWERSGD_DEFAULTS['rank']})", min=1)
    powersgd_start: Optional[int] = arg(None, "--comm-hook powersgd: exact all-reduces for this many optimizer steps "
                                              f"first (default {POWERSGD_DEFAULTS['start']}; torch's is 1000)", min=2)

    def knobs_set(self) -> list[str]:
        """The flags of DDP's own knobs that this run sets, PowerSGD's parameters last (refused where no
        DistributedDataParallel is built from them: launch/zero.py's wrappers, launch/pipeline.py, the hybrid's dp-mp)."""
        given = {"--bucket-cap-mb": self.bucket_cap_mb is not None, "--static-graph": self.static_graph,
                 "--gradient-as-bucket-view": self.gradient_as_bucket_view, "--comm-hook": self.comm_hook != "none",
                 "--find-unused-parameters": self.find_unused_parameters,
                 "--powersgd-rank": self.powersgd_rank is not None, "--powersgd-start": self.powersgd_start is not None}
        return [flag for flag, set_ in given.items() if set_]

    def rank_device(self, env: DistEnv) -> torch.device:
        """This rank's device, which process_group makes the current one: cpu, or cuda:LOCAL_RANK (pick_device)."""
        return pick_device(self.device, env)

    def on_cuda(self) -> bool:
        """Whether this run trains on CUDA devices (nccl, --sync-bn and the GPU-per-rank checks depend on it)."""
        return self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())

    def ddp_kwargs(self, device: Optional[torch.device]) -> dict:
        """DistributedDataParallel's keyword arguments for this run: this rank's GPU (None on the CPU, and None for a
        module that spans several devices, device=None: DDP then leaves the inputs where they are) and DDP's own
        knobs. Each keeps the weights bit for bit (docs/ddp_knobs.md has what each buys and costs, measured):
        bucket_cap_mb (small buckets start sending sooner but cost more calls), gradient_as_bucket_view (.grad
        lives in its bucket: one copy less), static_graph (the same parameters every step: buckets planned once),
        find_unused_parameters (walk each step's graph for unused parameters: slower)."""
        return dict(device_ids=device_ids(device), bucket_cap_mb=self.bucket_cap_mb,
                    gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph,
                    find_unused_parameters=self.find_unused_parameters)

    def validate(self) -> None:
        super().validate()
        env = read_env()
        on_cuda = self.on_cuda()
        if self.backend == "nccl" and not on_cuda:
            raise UsageError("--backend", "nccl needs CUDA devices; this run uses the CPU", "auto, gloo")
        if self.sync_bn and not on_cuda:
            # torch: "SyncBatchNorm layers only work with GPU modules" (raised in forward, after set-up)
            raise UsageError("--sync-bn", "SyncBatchNorm runs on CUDA devices only; this run uses the CPU",
                             "--no-sync-bn, or --device cuda")
        for flag, value in (("--powersgd-rank", self.powersgd_rank), ("--powersgd-start", self.powersgd_start)):
            if value is not None and self.comm_hook != "powersgd":
                raise UsageError(flag, f"is PowerSGD's; this run uses --comm-hook {self.comm_hook}",
                                 "--comm-hook powersgd, or leave it out")
        if self.static_graph and self.accumulate > 1:  # measured: torch 2.14, gloo, ddp.py and hybrid.py ddp-mp
            raise UsageError("--static-graph", f"with --accumulate {self.accumulate} fails in torch 2.14: the first "
                                               "backward runs inside no_sync(), and DDP's static graph asserts "
                                               "(expect_autograd_hooks_; pytorch/pytorch#143580)",
                             "--accumulate 1, or leave it out")
        if on_cuda and env.world_size > 1:
            # Checked here, identically on every local rank, rather than by the one rank that finds no GPU.
            if self.device.startswith("cuda:"):
                raise UsageError("--device", f"{self.device} names one GPU, but under torchrun each rank uses "
                                             "cuda:LOCAL_RANK", "auto, cuda, cpu")
            if env.local_world_size > torch.cuda.device_count():
                raise UsageError("--nproc_per_node", f"{env.local_world_size} ranks on this node but only "
                                                     f"{torch.cuda.device_count()} CUDA device(s)",
                                 f"at most {torch.cuda.device_count()}, or --device cpu")


def device_ids(device: Optional[torch.device]) -> Optional[list]:
    """DDP's device_ids: this rank's GPU, or None on the CPU and for a module on several devices (device None)."""
    return [device.index] if device is not None and device.type == "cuda" else None


def sync_batchnorm(model: torch.nn.Module, cfg: DDPConfig) -> torch.nn.Module:
    """--sync-bn: the model with its BatchNorm layers converted to SyncBatchNorm (statistics over the global batch,
    one extra all-reduce per BatchNorm layer in every forward; CUDA only, refused on the CPU by DDPConfig.validate);
    without it, the model itself."""
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.sync_bn else model


def with_comm_hook(model, cfg: DDPConfig):
    """The DDP-wrapped model with --comm-hook's hook registered (fp16, bf16, powersgd: fewer bytes per all-reduce,
    lossy; see comm_hook), or as it is for --comm-hook none (DDP's own exact all-reduce)."""
    if cfg.comm_hook != "none":
        model.register_comm_hook(*comm_hook(cfg, model))
    return model


def all_sum(*values, device: torch.device) -> list[torch.Tensor]:
    """Sum these numbers (0-d tensors or Python numbers) over every rank: one all-reduce of a float64 stack, so
    sample counts and sums stay exact. Returns float64 0-d tensors on `device` (no host sync here)."""
    sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    dist.all_reduce(sums)
    return list(sums.unbind())


# ---------------------------------------------------------------------- DDP's communication hooks
class CommCount:
    """The state of counting_hook: the hook it wraps and that hook's state, and what this rank has sent so far."""

    def __init__(self, kind: str, hook, state=None):
        self.kind, self.hook, self.state = kind, hook, state
        self.bytes = 0  # bytes of gradients this rank handed to all-reduce
        self.syncs = 0  # gradient synchronisations: one per optimizer step (no_sync's backwards call no hook)

    @property
    def bytes_per_sync(self) -> float:
        return self.bytes / max(1, self.syncs)


def counting_hook(count: CommCount, bucket):  # no annotations: DDP compares them with classes, these would be strings
    """A DDP communication hook: count the bytes `count.hook` all-reduces for this bucket (a dist.GradBucket), then
    run it; returns its torch.futures.Future.

    What each hook hands to all-reduce: allreduce_hook the bucket as it is; fp16/bf16 the bucket cast to 2 bytes
    per element; PowerSGD the bucket as it is for its first --powersgd-start steps, then a low-rank P and Q for
    each matrix it compresses plus the rest uncompressed, which its own state counts (total_numel_after_compression,
    in the bucket's dtype). tests/test_ddp_knobs.py checks these counts against every tensor handed to
    torch.distributed.all_reduce. Counting bytes, not time: a 2-core machine cannot show a communication speed-up.
    """
    buffer = bucket.buffer()
    powersgd = count.state if count.kind == "powersgd" else None
    compressing = powersgd is not None and powersgd.iter >= powersgd.start_powerSGD_iter
    elements_before = powersgd.total_numel_after_compression if compressing else 0
    future = count.hook(count.state, bucket)
    if compressing:
        count.bytes += (powersgd.total_numel_after_compression - elements_before) * buffer.element_size()
    else:
        count.bytes += buffer.numel() * (2 if count.kind in ("fp16", "bf16") else buffer.element_size())
    count.syncs += bucket.is_last()  # bucket 0, the last one reduced in a synchronisation
    return future


def comm_hook(cfg: DDPConfig, model) -> tuple:
    """(state, hook) for `model.register_comm_hook`: --comm-hook's hook (torch.distributed.algorithms.ddp_comm_hooks)
    inside counting_hook; `state.bytes_per_sync` is what each rank sent per optimizer step. --comm-hook none is
    torch's allreduce_hook: what DDP does without a hook, bit for bit, in Python."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if cfg.comm_hook == "powersgd":
        check_powersgd(model, cfg.bucket_cap_mb)
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=cfg.powersgd_rank or POWERSGD_DEFAULTS["rank"],
                                       start_powerSGD_iter=cfg.powersgd_start or POWERSGD_DEFAULTS["start"])
        return CommCount("powersgd", powersgd.powerSGD_hook, state), counting_hook
    hooks = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}
    return CommCount(cfg.comm_hook, hooks[cfg.comm_hook]), counting_hook


def gradient_buckets(model, bucket_cap_mb: Optional[float]) -> int:
    """How many buckets DDP's reducer holds this model's gradients in from its second step on.

    The first step runs with one bucket; after it DDP rebuilds them in the order backward produced the gradients,
    each closed once it reaches its cap: 1 MiB for the first and 25 MiB for the others by default, --bucket-cap-mb
    for all when given. Computed with torch's own assignment, in both parameter orders (backward's is close to the
    reverse of the model's), the larger count."""
    mib = 2 ** 20
    cap = int((bucket_cap_mb or 25) * mib)
    limits = [mib, cap] if bucket_cap_mb is None else [cap]
    params = [p for p in model.parameters() if p.requires_grad]
    return max(len(dist._compute_bucket_assignment_by_size(order, limits, [False] * len(order))[0])
               for order in (params, params[::-1]))


def check_powersgd(model, bucket_cap_mb: Optional[float]) -> None:
    """Refuse PowerSGD where it is known to fail: gloo with the gradients in more than one bucket.

    Measured (torch 2.14, 2 CPU ranks): with two or more buckets 22 of 22 runs hung or aborted with `gloo::
    EnforceNotMet ... collective mismatch`. The hook all-reduces each bucket's P and Q from future callbacks, which
    gloo runs on its own threads, so two buckets' all-reduces can reach the ranks in different orders."""
    if dist.get_backend() != "gloo":
        return
    buckets = gradient_buckets(model, bucket_cap_mb)
    if buckets > 1:
        grad_mib = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2 ** 20
        raise UsageError("--comm-hook", f"powersgd on gloo fails (hangs or 'collective mismatch') when the gradients "
                                        f"span more than one bucket: these {grad_mib:.2f} MiB make {buckets} at "
                                        f"--bucket-cap-mb {bucket_cap_mb or '25 (first bucket 1)'}",
                         f"--bucket-cap-mb {math.ceil(grad_mib)} or more, fp16, bf16, none, or nccl on GPUs")
