"""ZeRO sharding applied to an unmodified model and optimizer: fairscale and torch's own (docs/zero.md).

ZeRO (Rajbhandari et al. 2019) removes DDP's redundancy: every DDP rank holds the whole optimizer state, all
gradients and all parameters. Stage 1 gives each of the N ranks the optimizer state of 1/N of the parameters,
stage 2 also only their gradients, stage 3 also only their parameters (gathered layer by layer when needed).

    raw_model = build_model(...).to(device)
    optimizer = build_optimizer(cfg, raw_model.parameters(), lr)            # the baseline's, unchanged
    model, optimizer = shard(raw_model, optimizer, impl, stage, device, precision)

    impl       stage 1                          stage 2                            stage 3
    torch      ZeroRedundancyOptimizer + DDP    FSDP2 fully_shard(reshard_after_   fully_shard(reshard_after_
                                                forward=False): SHARD_GRAD_OP      forward=True), per block, root
    fairscale  OSS + DDP                        OSS + ShardedDataParallel          FullyShardedDataParallel (CUDA,
                                                                                  2+ ranks)

The few places where the loop does something else than under DDP, each a function here:
  zero_grad ........... ShardedDDP's gradients are views into its reduce buckets: zero them in place
  no_sync ............. DDP/ShardedDDP accumulate locally; FSDP reduce-scatters every micro-batch instead
  clip_grad_norm ...... the norm over every rank's shard: OSS.clip_grad_norm, FSDP's own, DTensor norms (FSDP2)
  shard_aware_scaler .. 16-mixed with sharded gradients: the inf/NaN check is all-reduced
  same_batch_count .... FSDP's forward is a collective: every rank evaluates the same number of batches
  full_*_state_dict ... checkpoints hold the plain full state dicts, gathered to rank 0 (collectives)
  per_rank_bytes ...... storage actually held per rank, next to the paper's formulas (zero_formula_bytes)

fairscale (last release 0.4.13, 2022-12; its FSDP became torch.distributed.fsdp) is optional: pip install -e '.[zero]'.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from manual_train.config import UsageError
from manual_train.precision import cast_input

IMPLS = ("torch", "fairscale")
STAGES = (1, 2, 3)
CPU_CAPABLE = (("torch", 1), ("torch", 2), ("torch", 3), ("fairscale", 1), ("fairscale", 2))
MIXED_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


# ---------------------------------------------------------------------- what can run where
def fairscale_or_error():
    """The fairscale package, or the one-line error saying how to install it."""
    try:
        import fairscale
    except ImportError:
        raise UsageError("--impl", "fairscale is not installed (pip install -e '.[zero]')", "torch") from None
    return fairscale


def check_zero(impl: str, stage: int, precision: str, on_cuda: bool, reduce_buffer_size: Optional[int],
               world_size: Optional[int] = None) -> None:
    """Combinations that cannot work, refused in one line before anything starts.

    world_size: the ranks of the run (None: torchrun's WORLD_SIZE, 1 for a plain `python` process).
    """
    if world_size is None:
        from manual_train.distributed import read_env

        world_size = read_env().world_size
    if impl == "fairscale":
        fairscale_or_error()
        if stage == 3 and not on_cuda:
            # Its forward fails without CUDA (KeyError 'all_gather', also with compute_device=cpu): it uses CUDA
            # streams unconditionally.
            raise UsageError("--stage", "3 with --impl fairscale is FullyShardedDataParallel, which needs CUDA; on "
                                        "the CPU use --impl torch (FSDP2, its successor)",
                             "--impl torch, or --stage 1, 2")
        if stage == 3 and world_size == 1:
            # With one rank fairscale's FSDP shards nothing (p._is_sharded = world_size > 1), so it never creates
            # the _full_param_padded buffers that gather_full_optim_state_dict sizes its gather by: training runs,
            # then the first checkpoint raises AttributeError ('FlatParameter' object has no attribute
            # '_full_param_padded'; fairscale 0.4.13, its last release). FSDP2 runs as a group of one.
            raise UsageError("--impl", "fairscale --stage 3 needs 2 or more ranks: with one, fairscale's FSDP "
                                       "shards nothing and fails gathering its optimizer state for the checkpoint",
                             "--impl torch (FSDP2 runs as a group of one), or torchrun --nproc_per_node >= 2")
        if stage == 2 and precision == "16-mixed" and not on_cuda:
            # The gradients are sharded, so the scaler must all-reduce its inf check: fairscale's ShardedGradScaler
            # does, but builds on torch.cuda.amp.GradScaler and disables itself on a host without CUDA.
            raise UsageError("--precision", "16-mixed with fairscale stage 2 needs fairscale's ShardedGradScaler, "
                                            "which disables itself without CUDA; on the CPU use --impl torch",
                             "32-true, bf16-mixed")
    if precision in ("16-o2", "apex-o2"):
        raise UsageError("--precision", f"{precision} keeps fp32 master weights outside the model, which ZeRO does "
                                        "not shard; 16-mixed and bf16-mixed keep fp32 parameters, which are the "
                                        "master weights ZeRO shards", "32-true, 16-mixed, bf16-mixed")
    if reduce_buffer_size is not None and (impl, stage) != ("fairscale", 2):
        raise UsageError("--reduce-buffer-size", "is ShardedDataParallel's, used by --impl fairscale --stage 2 only")


def shards_gradients(stage: int) -> bool:
    """After backward a rank holds only (or only correctly) its own shard of the gradients."""
    return stage >= 2


def is_fsdp(impl: str, stage: int) -> bool:
    """FSDP2 (torch stages 2, 3) and fairscale's FSDP (stage 3): forward all-gathers parameters."""
    return (impl == "torch" and stage >= 2) or (impl == "fairscale" and stage == 3)


# ---------------------------------------------------------------------- building the sharded model and optimizer
def blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of the units FSDP wraps one by one before the root.

    A transformer's blocks; otherwise the top-level children that hold parameters, looking through a lone
    container (the mlp's `net`): cnn -> features, head; mlp -> its three Linear layers; seq2seq -> encoder,
    decoder; resnet18 -> conv1, bn1, layer1..4, fc. Each unit's parameters are gathered only while it runs.
    """
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        return [(model.blocks, str(i)) for i in range(len(model.blocks))]
    parent = model
    while True:
        children = [(name, c) for name, c in parent.named_children() if any(True for _ in c.parameters())]
        if len(children) == 1 and any(True for _ in children[0][1].children()):
            parent = children[0][1]
            continue
        return [(parent, name) for name, _ in children]


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict:
    """The hyper-parameters to build the same optimizer again (defaults holds some the constructor refuses)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _inputs_to_float64(module: nn.Module, args: tuple) -> tuple:
    """64-true's input cast (precision.CastInputs) as a forward pre-hook: floating inputs to float64."""
    return tuple(cast_input(a, torch.float64) for a in args)


def shard(raw_model: nn.Module, optimizer: torch.optim.Optimizer, impl: str, stage: int, device: torch.device,
          precision: str = "32-true", reduce_buffer_size: Optional[int] = None):
    """(model to call, optimizer to step) for ZeRO `stage` with `impl`, from the baseline's model and optimizer.

    `optimizer` is only a description: its class and hyper-parameters (one parameter group, as build_optimizer
    makes) are rebuilt around the shards. Its state is empty (it never stepped), so nothing is lost. Every rank
    must call this with the same weights (same seed, or the same checkpoint), as with DDP.
    """
    assert len(optimizer.param_groups) == 1, "one parameter group (what optim.build_optimizer builds)"
    optimizer_class, kwargs = type(optimizer), _constructor_kwargs(optimizer)
    params = list(optimizer.param_groups[0]["params"])
    device_ids = [device.index] if device.type == "cuda" else None
    if precision == "64-true":
        # The loop's amp.prepare put CastInputs (float64 inputs) around raw_model, but every wrapper below wraps
        # raw_model itself: the cast moves into a pre-hook of raw_model, which each of them calls (also evaluation)
        raw_model.register_forward_pre_hook(_inputs_to_float64)
    if impl == "torch" and stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Rank r keeps the optimizer state of its share of the tensors (whole tensors, largest first, each to the
        # least-loaded rank); after its local step it broadcasts its updated parameters to the others. The model
        # is a plain DDP model: every rank still holds all parameters and all (all-reduced) gradients.
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
        return DDP(raw_model, device_ids=device_ids), optimizer
    if impl == "fairscale" and stage in (1, 2):
        from fairscale.optim import OSS

        # OSS: the same idea (whole tensors, in parameter order, each to the rank with the fewest elements so
        # far); it also makes the parameters views of one flat buffer per owner rank, so that the broadcast
        # after the step is one call per owner.
        optimizer = OSS(params, optim=optimizer_class, **kwargs)
        if stage == 1:
            return DDP(raw_model, device_ids=device_ids), optimizer
        from fairscale.nn.data_parallel import ShardedDataParallel

        # ShardedDDP reduces each gradient to its owner rank only (reduce, not all-reduce), and frees it on the
        # others, except small ones batched into reduce buffers (reduce_buffer_size elements per owner rank;
        # fairscale's default 2**23): those stay allocated on every rank, so a model smaller than that keeps
        # all its gradients everywhere (docs/zero.md, "What is measured").
        extra = {} if reduce_buffer_size is None else {"reduce_buffer_size": reduce_buffer_size}
        return ShardedDataParallel(raw_model, optimizer, **extra), optimizer
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2: every parameter becomes a DTensor sharded along dim 0 over the ranks (each holds 1/N of every
        # tensor, so the shards are even up to a row). Forward all-gathers a unit's parameters, backward
        # reduce-scatters its gradients, the optimizer steps the local shards. reshard_after_forward=False keeps
        # the gathered parameters from forward until backward (no second all-gather): ZeRO-2's communication,
        # but the parameters are resharded after backward, so between steps they are sharded too (what FSDP1
        # called SHARD_GRAD_OP). True frees each unit's after its forward and gathers it again in backward: ZeRO-3.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp_policy = MixedPrecisionPolicy()  # 32-true: compute and communicate in fp32
        if precision in MIXED_DTYPES:
            # Gather the parameters in 16 bits (half the traffic, half the unsharded memory) and compute in them;
            # reduce-scatter gradients in fp32 into the fp32 shards, which are the master weights the optimizer
            # steps. autocast stays on around forward for the ops it keeps in fp32 (softmax, the loss).
            mp_policy = MixedPrecisionPolicy(param_dtype=MIXED_DTYPES[precision], reduce_dtype=torch.float32)
        for parent, name in blocks(raw_model):
            fully_shard(getattr(parent, name), mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)
        fully_shard(raw_model, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)  # the rest
        return raw_model, optimizer_class(raw_model.parameters(), **kwargs)  # over the DTensor shards
    # fairscale stage 3 (CUDA only, refused elsewhere by check_zero)
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    fsdp_kwargs = dict(reshard_after_forward=True, mixed_precision=precision in MIXED_DTYPES,
                       compute_dtype=MIXED_DTYPES.get(precision))
    for parent, name in blocks(raw_model):
        setattr(parent, name, FSDP(getattr(parent, name), **fsdp_kwargs))
    model = FSDP(raw_model, **fsdp_kwargs)
    return model, optimizer_class(model.parameters(), **kwargs)  # over the flat shards


def shard_aware_scaler(scaler, impl: str, stage: int, device: torch.device, growth_interval: int):
    """16-mixed: a GradScaler whose inf/NaN check sees every rank's gradient shard (else `scaler` itself).

    A plain GradScaler inspects this rank's .grad only; with sharded gradients one rank could skip a step the
    others take. ShardedGradScaler all-reduces found_inf: torch's on any device, fairscale's on CUDA only.
    """
    if not scaler.is_enabled() or not shards_gradients(stage):
        return scaler
    kwargs = dict(init_scale=scaler.get_scale(), growth_interval=growth_interval)
    if impl == "torch":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **kwargs)
    from fairscale.optim.grad_scaler import ShardedGradScaler

    return ShardedGradScaler(**kwargs)


# ---------------------------------------------------------------------- the step
def zero_grad(model, optimizer, impl: str, stage: int) -> None:
    """Drop the last window's gradients before a new one accumulates.

    ShardedDDP's reduce buckets (its default reduce_buffer_size) are flat buffers that the small parameters'
    .grad are views of. optimizer.zero_grad() sets every .grad to None (torch >= 2.0's default): the next
    backward allocates fresh gradients outside the buckets, while the buckets, still holding the previous
    step's values, are what gets reduced. Nothing fails; training silently diverges from DDP (6e-2 after 5
    Adam steps). ShardedDDP's own zero_grad zeroes the buckets in place and sets only the others to None.
    """
    if impl == "fairscale" and stage == 2:
        model.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad(set_to_none=True)


def no_sync(model, impl: str, stage: int, window_end: bool):
    """The context for one micro-step's forward and backward.

    DDP and ShardedDDP: no_sync() on all but the window's last micro-step (one reduction per optimizer step;
    the window's gradients accumulate in full on every rank). FSDP: no context: gradients are reduce-scattered
    after every micro-batch and accumulate in the shards. K reductions instead of one, but no full-size
    gradients are ever held, which is what stage 2 and 3 are for.
    """
    if window_end or is_fsdp(impl, stage):
        return contextlib.nullcontext()
    return model.no_sync()


def clip_grad_norm(model, optimizer, max_norm: float, impl: str, stage: int) -> torch.Tensor:
    """Clip the global gradient norm; a collective where gradients are sharded (call it on every rank).

    fairscale: OSS.clip_grad_norm sums each rank's squared norm over the tensors it owns (all-reduce), then
    scales those; FSDP its own. torch stage 1: DDP left the full gradients on every rank, the baseline's
    clip_grad_norm_ works as is. FSDP2: the gradients are DTensors, whose norms are all-reduced by DTensor.
    """
    if impl == "fairscale" and stage < 3 and optimizer.param_groups[0]["params"][0].dtype == torch.float64:
        return _oss_clip_grad_norm(optimizer, max_norm)  # 64-true: OSS's own computes its norms in float32 only
    if impl == "fairscale":
        return optimizer.clip_grad_norm(max_norm) if stage < 3 else model.clip_grad_norm_(max_norm)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _oss_clip_grad_norm(optimizer, max_norm: float) -> torch.Tensor:
    """OSS.clip_grad_norm's algorithm in the gradients' own dtype (fairscale 0.4.13 passes dtype=torch.float32 to
    every per-tensor norm, which float64 gradients refuse): each rank the norm over the gradients of the tensors it
    owns, the squares all-reduced, then the same clip coefficient applied to its own tensors' gradients."""
    local = [p for group in optimizer.optim.param_groups for p in group["params"] if p.grad is not None]
    local_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.detach()) for p in local]))
    total_norm = local_norm ** 2
    dist.all_reduce(total_norm)
    total_norm = total_norm.sqrt()
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1:
        for p in local:
            p.grad.detach().mul_(clip_coef)
    return total_norm


# ---------------------------------------------------------------------- evaluation
def eval_module(model, impl: str, stage: int) -> nn.Module:
    """The module to evaluate: DDP's and ShardedDDP's inner one (their forward syncs buffers, a collective),
    FSDP itself (its forward gathers the parameters)."""
    return model if is_fsdp(impl, stage) else model.module


class SameBatchCount:
    """Yields the loader's batches, then empty ones until `num_batches`: every rank calls forward equally often.

    FSDP's forward all-gathers parameters: a rank whose validation shard has one batch fewer would leave the
    others waiting in that all-gather. An empty batch adds nothing to evaluate's sums (loss, correct, count).
    """

    def __init__(self, loader, num_batches: int):
        self.loader, self.num_batches = loader, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        last = None
        for last in self.loader:
            yield last
        if last is None:
            last = torch.utils.data.default_collate([self.loader.dataset[0]])
        for _ in range(self.num_batches - len(self.loader)):
            yield tuple(t[:0] for t in last)


def same_batch_count(loader, impl: str, stage: int, device: torch.device):
    """Under FSDP, `loader` padded to the largest batch count of any rank (one all-reduce); else itself."""
    if not is_fsdp(impl, stage):
        return loader
    count = torch.tensor([len(loader)], device=device)  # nccl reduces CUDA tensors only
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return SameBatchCount(loader, int(count.item()))


def reshard(model, impl: str, stage: int) -> None:
    """FSDP2 stage 2 after evaluation: a forward without backward leaves the gathered parameters in place
    (they are freed after backward); free them now rather than hold the full model until the next step."""
    if impl == "torch" and stage == 2:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


# ---------------------------------------------------------------------- checkpoints: the plain full state dicts
def _full_options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def full_model_state_dict(model, raw_model: nn.Module, impl: str, stage: int) -> dict:
    """The unwrapped model's full state_dict (fp32, no wrapper prefixes) on rank 0. Call on every rank.

    Stage 1 and fairscale stage 2 hold the full parameters on every rank: no communication. FSDP gathers them.
    """
    if impl == "torch" and stage >= 2:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(raw_model, options=_full_options(cpu_offload=True))  # {} off rank 0
    if impl == "fairscale" and stage == 3:
        return model.state_dict()  # fairscale's FSDP: full, original names (a collective)
    return raw_model.state_dict()


def full_optimizer_state_dict(model, optimizer, raw_model: nn.Module, impl: str, stage: int) -> dict:
    """The optimizer state of every shard in torch's own layout (state keyed by parameter index), on rank 0.

    A collective: every rank must call it (fairscale: consolidate_state_dict(0) pulls the shards to rank 0;
    rank 0 alone calling it waits forever). The result loads into the unsharded optimizer of launch/single.py.
    Off rank 0 it returns {}.
    """
    rank = dist.get_rank()
    if impl == "torch" and stage == 1:
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if rank == 0 else {}
    if impl == "fairscale" and stage in (1, 2):
        optimizer.consolidate_state_dict(0)
        return optimizer.state_dict() if rank == 0 else {}
    if impl == "fairscale":
        return model.gather_full_optim_state_dict(optimizer) or {}  # fairscale FSDP's own layout (CUDA)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(raw_model, optimizer, options=_full_options(cpu_offload=True))
    if rank != 0:
        return {}
    # get_optimizer_state_dict keys the state by parameter name; torch.optim keys it by position.
    index = {name: i for i, (name, _) in enumerate(raw_model.named_parameters())}
    return {"state": {index[name]: state for name, state in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in by_name["param_groups"]]}


def load_optimizer_state_dict(model, optimizer, state: dict, raw_model: nn.Module, impl: str, stage: int) -> None:
    """Restore a full optimizer state (from any loop's checkpoint) into this rank's shard. Call on every rank."""
    if impl == "fairscale" and stage == 3:
        if "uncollected_local_ids" not in state:
            raise UsageError("--resume", "fairscale FSDP resumes only its own checkpoints (their optimizer state "
                                         "is in its layout)", "a checkpoint of --impl fairscale --stage 3")
        optimizer.load_state_dict(model.get_shard_from_optim_state_dict(state))
        return
    if "uncollected_local_ids" in state:
        raise UsageError("--resume", "this checkpoint's optimizer state is fairscale FSDP's own layout",
                         "--impl fairscale --stage 3, or a checkpoint of another loop")
    if impl == "torch" and stage >= 2:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        name = [n for n, _ in raw_model.named_parameters()]
        by_name = {"state": {name[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(raw_model, optimizer, by_name, options=_full_options())  # keeps this rank's shard
        return
    optimizer.load_state_dict(state)  # ZeroRedundancyOptimizer and OSS keep the state of the tensors they own


def load_full_model_state_dict(model, raw_model: nn.Module, state: dict, impl: str, stage: int) -> None:
    """Load full fp32 weights into the (possibly sharded) model on every rank (--restore-best)."""
    if impl == "torch" and stage >= 2:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(raw_model, state, options=_full_options())  # each rank copies its shard
    elif impl == "fairscale" and stage == 3:
        model.load_state_dict(state)
    else:
        raw_model.load_state_dict(state)


def save_sharded(raw_model: nn.Module, optimizer, folder: Path) -> None:
    """torch stages 2, 3: every rank writes its own shards with torch.distributed.checkpoint (DCP), no gather.

    The option for models whose full state does not fit on one rank: nothing is gathered, files are written in
    parallel, and DCP reshards on load (another world size works). The price: a folder of shards that only DCP
    reads, not the single last.pt that launch/single.py can resume. Call on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(raw_model, optimizer)  # DTensor shards, keyed by name
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load_sharded(raw_model: nn.Module, optimizer, folder: Path) -> None:
    """Read a save_sharded folder into an FSDP2 model and its optimizer (each rank reads its shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(raw_model, optimizer)  # the layout to read into
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(raw_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ---------------------------------------------------------------------- memory: measured and the paper's model
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
    from manual_train.config import Config
    from manual_train.data import DataInfo
    from manual_train.models import build_model, loss_fn
    from manual_train.optim import build_optimizer

    info = info or DataInfo("digits", (1, 8, 8), 10)
    cfg = Config(model=model_name, optimizer=optimizer_name)
    x, y = _input_batch(info, batch_size, seed=dist.get_rank())
    x, y = x.to(device), y.to(device)
    rows = []
    for impl, stage in configs:
        torch.manual_seed(0)
        raw_model = build_model(model_name, info).to(device)
        optimizer = build_optimizer(cfg, raw_model.parameters(), lr=1e-3)
        if stage == 0:
            model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            model, optimizer = shard(raw_model, optimizer, impl, stage, device, reduce_buffer_size=reduce_buffer_size)
        zero_grad(model, optimizer, impl, stage)
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


def largest_tensor_numel(model: nn.Module) -> int:
    """The bound on OSS's and ZeroRedundancyOptimizer's imbalance: they never split a tensor."""
    return max(p.numel() for p in model.parameters())

