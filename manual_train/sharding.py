"""What every ZeRO implementation builds on: torch's (manual_train/zero.py) and fairscale's
(manual_train/zero_fairscale.py) both import this module, and neither imports the other's (docs/zero.md).

  Sharded ................ ZeRO stage 1 with ZeroRedundancyOptimizer inside DDP, and the base class of every
                           (impl, stage): the loop's calls (zero_grad, no_sync, clip_grad_norm, ...) as under DDP
  blocks(model) .......... the units FSDP wraps one by one before the root
  same_batch_count ....... evaluation under FSDP: every rank calls forward equally often (SameBatchCount)
  MIXED_DTYPES ........... the compute dtype of --precision 16-mixed and bf16-mixed
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from manual_train.checkpoint import FullState
from manual_train.config import UsageError
from manual_train.memory import zero_report

MIXED_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


# ---------------------------------------------------------------------- what the loop calls
class Sharded:
    """ZeRO stage 1 with torch's ZeroRedundancyOptimizer inside plain DDP, and the base of every (impl, stage):
    its methods do what the DDP loop does; each subclass overrides what its sharding changes.

    wrapper: DDP, ShardedDataParallel or the FSDP root (what no_sync, clipping and the state dicts use);
    model: what the loop calls (the wrapper, inside CastInputs under 64-true: the cast stays outermost);
    cfg: the run's zero.ZeroConfig (tensor_parallel.TensorParallelConfig, a subclass, for TP).
    """

    def __init__(self, wrapper: nn.Module, optimizer, raw_model: nn.Module, cfg, device: torch.device,
                 psi: int, cast: Callable[[nn.Module], nn.Module]):
        self.wrapper, self.optimizer, self.raw_model, self.cfg, self.psi = wrapper, optimizer, raw_model, cfg, psi
        self.device = device
        self.model = cast(wrapper)
        self.eval_model = cast(self._eval_module())
        self.full_model = FullState(self.model_state_dict, self.load_model_state_dict, raw_model,
                                    sharded=self._dtensor_state())
        self.full_optimizer = FullState(self.optimizer_state_dict, self.load_optimizer_state_dict)

    def __str__(self) -> str:
        return f"--impl {self.cfg.impl} --stage {self.cfg.stage}: {type(self.wrapper).__name__} + " \
               f"{type(self.optimizer).__name__}"

    def _eval_module(self) -> nn.Module:
        """DDP's inner module, as the DDP loop evaluates (DDP's forward broadcasts buffers: a collective)."""
        return self.wrapper.module

    def _dtensor_state(self) -> Optional[tuple]:
        """(module, optimizer) when the parameters are DTensors, which --checkpoint-format dcp saves shard by shard
        (FullState.sharded); None here: DDP's parameters are whole on every rank."""
        return None

    # ------------------------------------------------------------------ the step
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self, window_end: bool):
        """DDP: no_sync() on all but the window's last micro-step, one all-reduce per optimizer step."""
        return nullcontext() if window_end else self.wrapper.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, clipped. Stage 1: DDP left the full gradients on every rank, the baseline's
        clip_grad_norm_ works as is. FSDP2: the gradients are DTensors, whose norms torch all-reduces (so every
        rank must call it)."""
        return torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)

    def grad_scaler(self, device_type: str, **kwargs) -> torch.amp.GradScaler:
        """Full gradients on every rank: a plain GradScaler sees the same inf/NaN everywhere."""
        return torch.amp.GradScaler(device_type, **kwargs)

    # ------------------------------------------------------------------ evaluation
    def same_batch_count(self, loader):
        return loader  # DDP evaluates the inner module: no collective in forward

    def reshard(self) -> None:
        """After evaluation: nothing to free (the parameters are not gathered)."""

    # ------------------------------------------------------------------ checkpoints: the plain full state dicts
    def model_state_dict(self) -> dict:
        """Stage 1 and fairscale's stage 2 hold the full parameters on every rank: no communication."""
        return self.raw_model.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        self.raw_model.load_state_dict(state)  # every rank reads the same file: the same weights everywhere

    def optimizer_state_dict(self) -> dict:
        """consolidate_state_dict pulls every shard to rank 0: a collective (rank 0 alone calling it waits for
        ever). The result is torch.optim's own layout, which the unsharded optimizer of launch/single.py loads."""
        self.optimizer.consolidate_state_dict(to=0)
        return self.optimizer.state_dict() if dist.get_rank() == 0 else {}

    def load_optimizer_state_dict(self, state: dict) -> None:
        check_plain_layout(state)
        self.optimizer.load_state_dict(state)  # ZeroRedundancyOptimizer and OSS keep the state of their tensors

    # ------------------------------------------------------------------ the end
    def memory_report(self) -> tuple[str, dict]:
        """(the per-rank table for the console, the summary.json fields): a collective."""
        return zero_report(self)


def check_plain_layout(optimizer_state: dict) -> None:
    """Refuse, in one line, an optimizer state in fairscale FSDP's own layout (it resumes only into that)."""
    if "uncollected_local_ids" in optimizer_state:
        raise UsageError("--resume", "this checkpoint's optimizer state is fairscale FSDP's own layout",
                         "--impl fairscale --stage 3, or a checkpoint of another loop")


# ---------------------------------------------------------------------- the units, the devices
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


# ---------------------------------------------------------------------- evaluation under FSDP
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


def same_batch_count(loader, device: torch.device) -> SameBatchCount:
    """`loader` padded to the largest batch count of any rank (one all-reduce)."""
    count = torch.tensor([len(loader)], device=device)  # nccl reduces CUDA tensors only
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return SameBatchCount(loader, int(count.item()))
