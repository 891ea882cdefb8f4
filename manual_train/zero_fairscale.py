"""fairscale's ZeRO, kept apart from manual_train/zero.py: OSS (stages 1, 2), ShardedDataParallel (stage 2) and
FullyShardedDataParallel (stage 3, CUDA only), each a subclass of sharding.Sharded overriding what it changes.

fairscale (Meta) is where these were developed; its last release is 0.4.13 (2022-12) and its FSDP became
torch.distributed.fsdp. manual_train.zero imports this module only for --impl fairscale, after checking that
fairscale is installed (pip install -e '.[zero]'); --impl torch (the default) never imports it.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from fairscale.optim import OSS
from fairscale.optim.grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

from manual_train.config import UsageError
from manual_train.distributed import device_ids
from manual_train.sharding import MIXED_DTYPES, Sharded, blocks, same_batch_count


def check(stage: int, precision: str, on_cuda: bool, world_size: int) -> None:
    """What fairscale cannot do here, refused in one line before anything starts."""
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


def shard(params: list, optimizer_class, kwargs: dict, *, raw_model: nn.Module, cfg, device: torch.device,
          **spec) -> Sharded:
    """zero.shard for --impl fairscale: the wrapper and the sharded optimizer of `cfg.stage`."""
    spec.update(raw_model=raw_model, cfg=cfg, device=device)
    if cfg.stage == 3:
        fsdp_kwargs = dict(reshard_after_forward=True, mixed_precision=cfg.precision in MIXED_DTYPES,
                           compute_dtype=MIXED_DTYPES.get(cfg.precision))
        for parent, name in blocks(raw_model):
            setattr(parent, name, FullyShardedDataParallel(getattr(parent, name), **fsdp_kwargs))
        model = FullyShardedDataParallel(raw_model, **fsdp_kwargs)
        return FairscaleFSDP(model, optimizer_class(model.parameters(), **kwargs), **spec)  # over the flat shards
    # OSS: ZeroRedundancyOptimizer's idea (whole tensors, here in parameter order, each to the rank with the fewest
    # elements so far); it also makes the parameters views of one flat buffer per owner rank, so that the
    # broadcast after the step is one call per owner.
    optimizer = OSS(params, optim=optimizer_class, **kwargs)
    if cfg.stage == 1:
        return OSSWithDDP(DDP(raw_model, device_ids=device_ids(device)), optimizer, **spec)
    # ShardedDDP reduces each gradient to its owner rank only (reduce, not all-reduce), and frees it on the
    # others, except small ones batched into reduce buffers (reduce_buffer_size elements per owner rank;
    # fairscale's default 2**23): those stay allocated on every rank, so a model smaller than that keeps
    # all its gradients everywhere (docs/zero.md, "What is measured").
    extra = {} if cfg.reduce_buffer_size is None else {"reduce_buffer_size": cfg.reduce_buffer_size}
    return OSSWithShardedDDP(ShardedDataParallel(raw_model, optimizer, **extra), optimizer, **spec)


class OSSWithDDP(Sharded):
    """Stage 1: OSS inside plain DDP (every rank holds all parameters and all-reduced gradients)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """OSS.clip_grad_norm sums each rank's squared norm over the tensors it owns (all-reduce), then scales
        those: a collective. 64-true: OSS's own computes its norms in float32 only, so the same algorithm here."""
        if self.optimizer.param_groups[0]["params"][0].dtype == torch.float64:
            return _oss_clip_grad_norm(self.optimizer, max_norm)
        return self.optimizer.clip_grad_norm(max_norm)

    def optimizer_state_dict(self) -> dict:
        self.optimizer.consolidate_state_dict(0)  # on every rank: it pulls the shards to rank 0
        return self.optimizer.state_dict() if dist.get_rank() == 0 else {}


class OSSWithShardedDDP(OSSWithDDP):
    """Stage 2: OSS inside ShardedDataParallel, which reduces each gradient to its owner rank."""

    def zero_grad(self) -> None:
        """ShardedDDP's reduce buckets (its default reduce_buffer_size) are flat buffers that the small parameters'
        .grad are views of. optimizer.zero_grad() sets every .grad to None (torch >= 2.0's default): the next
        backward allocates fresh gradients outside the buckets, while the buckets, still holding the previous
        step's values, are what gets reduced. Nothing fails; training silently diverges from DDP (6e-2 after 5
        Adam steps). ShardedDDP's own zero_grad zeroes the buckets in place and sets only the others to None."""
        self.wrapper.zero_grad(set_to_none=True)

    def grad_scaler(self, device_type: str, **kwargs) -> torch.amp.GradScaler:
        """16-mixed: fairscale's ShardedGradScaler all-reduces the inf/NaN check over the gradient shards (CUDA
        only: refused elsewhere by check)."""
        return ShardedGradScaler(**kwargs) if kwargs.get("enabled") else super().grad_scaler(device_type, **kwargs)


class FairscaleFSDP(Sharded):
    """Stage 3: fairscale's FullyShardedDataParallel, per block, then the root (CUDA, 2+ ranks)."""

    def _eval_module(self) -> nn.Module:
        return self.wrapper  # its forward gathers the parameters (a collective: same_batch_count)

    def no_sync(self, window_end: bool):
        return nullcontext()  # as FSDP2: gradients are reduce-scattered into the shards every micro-batch

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.wrapper.clip_grad_norm_(max_norm)  # its own: the norm over every rank's flat shards

    def grad_scaler(self, device_type: str, **kwargs) -> torch.amp.GradScaler:
        return ShardedGradScaler(**kwargs) if kwargs.get("enabled") else super().grad_scaler(device_type, **kwargs)

    def same_batch_count(self, loader):
        return same_batch_count(loader, self.device)

    def model_state_dict(self) -> dict:
        return self.wrapper.state_dict()  # full, original names (a collective)

    def load_model_state_dict(self, state: dict) -> None:
        self.wrapper.load_state_dict(state)

    def optimizer_state_dict(self) -> dict:
        """fairscale FSDP's own layout (it resumes into fairscale stage 3 only), gathered to rank 0."""
        return self.wrapper.gather_full_optim_state_dict(self.optimizer) or {}

    def load_optimizer_state_dict(self, state: dict) -> None:
        if "uncollected_local_ids" not in state:
            raise UsageError("--resume", "fairscale FSDP resumes only its own checkpoints (their optimizer state "
                                         "is in its layout)", "a checkpoint of --impl fairscale --stage 3")
        self.optimizer.load_state_dict(self.wrapper.get_shard_from_optim_state_dict(state))


def _oss_clip_grad_norm(optimizer: OSS, max_norm: float) -> torch.Tensor:
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
