"""ZeRO sharding applied to an unmodified model and optimizer, decided once (docs/zero.md).

ZeRO (Rajbhandari et al. 2019) removes DDP's redundancy: every DDP rank holds the whole optimizer state, all
gradients and all parameters. Stage 1 gives each of the N ranks the optimizer state of 1/N of the parameters,
stage 2 also only their gradients, stage 3 also only their parameters (gathered layer by layer when needed).

    optimizer = build_optimizer(cfg, raw_model.parameters(), lr)   # the baseline's, unchanged
    sharded = shard(model, optimizer, cfg, device)                 # --impl and --stage are resolved here, once
    model, optimizer = sharded.model, sharded.optimizer            # to call, to step

    impl       stage 1                          stage 2                            stage 3
    torch      ZeroRedundancyOptimizer + DDP    FSDP2 fully_shard(reshard_after_   fully_shard(reshard_after_
                                                forward=False): SHARD_GRAD_OP      forward=True), per block, root
    fairscale  OSS + DDP                        OSS + ShardedDataParallel          FullyShardedDataParallel (CUDA,
               (manual_train/zero_fairscale.py)                                    2+ ranks)

The few places where the loop does something else than under DDP are methods of what shard() returns, so the
loop calls them without asking which implementation or stage it runs (torchtitan's parallelize_llama):
  zero_grad() ............. ShardedDDP's gradients are views into its reduce buckets: zeroed in place
  no_sync(window_end) ..... DDP/ShardedDDP accumulate locally; FSDP reduce-scatters every micro-batch instead
  clip_grad_norm(max) ..... the norm over every rank's shard: DTensor norms (FSDP2), OSS's, fairscale FSDP's
  grad_scaler(...) ........ 16-mixed with sharded gradients: the inf/NaN check is all-reduced
  eval_model, reshard(), same_batch_count(loader)   FSDP's forward is a collective: every rank evaluates the
                            same number of batches, through FSDP itself
  full_model, full_optimizer   checkpointed objects: state_dict() gathers the plain full state to rank 0 (a
                            collective), load_state_dict() keeps this rank's shard of a full state
  memory_report() ......... storage held per rank next to the paper's formulas (manual_train/memory.py)

fairscale (last release 0.4.13, 2022-12; its FSDP became torch.distributed.fsdp) is optional: pip install -e '.[zero]'.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from manual_train.checkpoint import CHECKPOINT_FORMATS, check_checkpoint_format
from manual_train.config import UsageError, arg
from manual_train.distributed import DDPConfig, device_ids
from manual_train.optim import dtensor_kwargs, keep_impl, sharded_scaler_kwargs
from manual_train.precision import CastInputs
from manual_train.sharding import MIXED_DTYPES, Sharded, blocks, check_plain_layout, same_batch_count

IMPLS = ("torch", "fairscale")
STAGES = (1, 2, 3)
CPU_CAPABLE = (("torch", 1), ("torch", 2), ("torch", 3), ("fairscale", 1), ("fairscale", 2))


# ---------------------------------------------------------------------- the flags, and what can run where
@dataclass
class ZeroConfig(DDPConfig):
    """The DDP loop's flags plus which ZeRO stage, and whose implementation of it."""

    stage: int = arg(2, "ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters",
                     choices=STAGES)
    impl: str = arg("torch", "torch (ZeroRedundancyOptimizer, FSDP2: every stage, CPU and CUDA) or fairscale (OSS, "
                             "ShardedDDP; stage 3 is its FSDP, CUDA only; pip install -e '.[zero]')", choices=IMPLS)
    checkpoint_format: str = arg("pt", "pt: last.pt, the full state gathered to rank 0 (every loop resumes it); dcp: "
                                       "last.dcp/, every rank writes its own shards, no gather; resumes at any world "
                                       "size (FSDP2: --impl torch --stage 2|3; docs/checkpointing.md)",
                                 choices=CHECKPOINT_FORMATS)
    async_checkpoint: bool = arg(False, "with --checkpoint-format dcp: write the shards in a background thread (the "
                                        "loop waits only for a copy to host memory; the next save waits for this one)")
    reduce_buffer_size: Optional[int] = arg(None, "fairscale stage 2: elements per owner rank in ShardedDDP's "
                                                  "gradient reduce buffers; None is fairscale's 2**23, 0 shards "
                                                  "every gradient", min=0)

    def validate(self) -> None:
        super().validate()
        on_cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
        check_zero(self.impl, self.stage, self.precision, on_cuda, self.reduce_buffer_size)
        check_checkpoint_format(self.checkpoint_format, self.async_checkpoint, allowed="--impl torch --stage 2|3",
                                sharded=self.impl == "torch" and self.stage in (2, 3))
        if self.knobs_set():  # DDP's constructor arguments and comm hooks: shard() builds its wrappers without them
            raise UsageError(self.knobs_set()[0], "is a knob of the DDP loop's DistributedDataParallel; launch/zero.py "
                                                  "builds its wrappers in manual_train/zero.py, without it",
                             "launch/ddp.py, or leave it out")

    @property
    def compile_after_wrapping(self) -> bool:
        """--compile under FSDP2 (--impl torch, stages 2, 3) is applied by _fsdp2, after fully_shard, not by
        models.build_model_from; stage 1 compiles before DDP, as the DDP loop does."""
        return self.impl == "torch" and self.stage in (2, 3)

    @property
    def saves_dcp(self) -> bool:
        """--checkpoint-format dcp: every rank writes its own shards (FSDP2; checked by check_checkpoint_format)."""
        return self.checkpoint_format == "dcp"

    @property
    def saves_async(self) -> bool:
        """--async-checkpoint (with dcp only)."""
        return self.saves_dcp and self.async_checkpoint

    def check_compile(self) -> None:
        """fairscale's wrappers refuse --compile; FSDP2 compiles after fully_shard (compile_after_wrapping)."""
        if self.compile != "none" and self.impl == "fairscale":
            raise UsageError("--compile", "fairscale's wrappers (OSS + ShardedDDP, its FSDP) are not built with it",
                             "none, or --impl torch")
        super().check_compile()


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
        from manual_train import zero_fairscale

        zero_fairscale.check(stage, precision, on_cuda, world_size)
    if reduce_buffer_size is not None and (impl, stage) != ("fairscale", 2):
        raise UsageError("--reduce-buffer-size", "is ShardedDataParallel's, used by --impl fairscale --stage 2 only")


# ---------------------------------------------------------------------- what the loop calls
class FSDP2Sharded(Sharded):
    """torch stages 2 and 3: FSDP2's fully_shard, every parameter a DTensor sharded by rows over the ranks."""

    def _eval_module(self) -> nn.Module:
        return self.wrapper  # its forward gathers the parameters (a collective: same_batch_count)

    def _dtensor_state(self) -> tuple:
        return self.raw_model, self.optimizer  # every parameter a DTensor shard (fully_shard)

    def no_sync(self, window_end: bool):
        """No context: gradients are reduce-scattered after every micro-batch and accumulate in the shards. K
        reductions instead of one, but no full-size gradient is ever held, which is what stages 2 and 3 are for."""
        return nullcontext()

    def grad_scaler(self, device_type: str, **kwargs) -> torch.amp.GradScaler:
        """A plain GradScaler inspects this rank's gradient shard only: one rank could skip a step the others take.
        torch's ShardedGradScaler all-reduces found_inf (on any device)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **kwargs)

    def same_batch_count(self, loader):
        return same_batch_count(loader, self.device)

    def reshard(self) -> None:
        """Stage 2 (reshard_after_forward=False): a forward without backward leaves the gathered parameters in
        place (they are freed after backward); free them now rather than hold the full model until the next step.
        Stage 3 freed them after each forward: a no-op there."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.raw_model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.raw_model, options=_full_options(cpu_offload=True))  # {} off rank 0

    def load_model_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.raw_model, state, options=_full_options())  # each rank copies its shard

    def optimizer_state_dict(self) -> dict:
        """get_optimizer_state_dict keys the state by parameter name; torch.optim keys it by position."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        by_name = get_optimizer_state_dict(self.raw_model, self.optimizer, options=_full_options(cpu_offload=True))
        if dist.get_rank() != 0:
            return {}
        index = {name: i for i, (name, _) in enumerate(self.raw_model.named_parameters())}
        return {"state": {index[name]: state for name, state in by_name["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]}

    def load_optimizer_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        check_plain_layout(state)
        name = [n for n, _ in self.raw_model.named_parameters()]
        by_name = {"state": {name[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self.raw_model, self.optimizer, by_name, options=_full_options())  # this shard


def _full_options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


# ---------------------------------------------------------------------- shard(): the decision, made once
def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict:
    """The hyper-parameters to build the same optimizer again (defaults holds some the constructor refuses)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def sharding_spec(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: ZeroConfig,
                  device: torch.device) -> tuple[dict, type, dict]:
    """(the Sharded's keyword arguments, the optimizer's class, its constructor's keyword arguments) for shard() and
    tensor_parallel.parallelize(): raw_model with the 64-true cast peeled off (put back around the result),
    psi counted before sharding, and the hyper-parameters the optimizer is rebuilt with around the shards."""
    assert len(optimizer.param_groups) == 1, "one parameter group (what optim.build_optimizer builds)"
    casts = isinstance(model, CastInputs)
    raw_model = model.module if casts else model
    spec = dict(raw_model=raw_model, cfg=cfg, device=device, psi=sum(p.numel() for p in raw_model.parameters()),
                cast=(lambda m: CastInputs(m, model.dtype)) if casts else (lambda m: m))  # psi: before sharding
    kwargs = sharded_scaler_kwargs(_constructor_kwargs(optimizer), cfg.precision, cfg.optimizer_impl)
    return spec, type(optimizer), kwargs


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: ZeroConfig, device: torch.device) -> Sharded:
    """ZeRO stage `cfg.stage` with `cfg.impl`, from the baseline's model and optimizer (what the loop needs).

    `model` is raw_model, or CastInputs(raw_model) under 64-true: the sharding wraps raw_model and the cast goes
    around the result, so inputs are float64 before any wrapper sees them (also in evaluation). `optimizer` is
    only a description: its class and hyper-parameters (one parameter group, as build_optimizer makes) are
    rebuilt around the shards; its state is empty (it never stepped), so nothing is lost. Every rank must call
    this with the same weights (same seed), as with DDP.
    """
    spec, optimizer_class, kwargs = sharding_spec(model, optimizer, cfg, device)
    params = list(optimizer.param_groups[0]["params"])
    if cfg.impl == "fairscale":
        from manual_train import zero_fairscale

        return zero_fairscale.shard(params, optimizer_class, kwargs, **spec)
    if cfg.stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Rank r keeps the optimizer state of its share of the tensors (whole tensors, largest first, each to the
        # least-loaded rank); after its local step it broadcasts its updated parameters to the others. The model
        # is a plain DDP model: every rank still holds all parameters and all (all-reduced) gradients.
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
        return Sharded(DDP(spec["raw_model"], device_ids=device_ids(device)), optimizer, **spec)
    return _fsdp2(optimizer_class, kwargs, **spec)


def _fsdp2(optimizer_class, kwargs: dict, raw_model: nn.Module, cfg: ZeroConfig, device: torch.device,
           **spec) -> FSDP2Sharded:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # FSDP2: every parameter becomes a DTensor sharded along dim 0 over the ranks (each holds 1/N of every
    # tensor, so the shards are even up to a row). Forward all-gathers a unit's parameters, backward
    # reduce-scatters its gradients, the optimizer steps the local shards. reshard_after_forward=False keeps
    # the gathered parameters from forward until backward (no second all-gather): ZeRO-2's communication,
    # but the parameters are resharded after backward, so between steps they are sharded too (what FSDP1
    # called SHARD_GRAD_OP). True frees each unit's after its forward and gathers it again in backward: ZeRO-3.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp_policy = MixedPrecisionPolicy()  # 32-true, 64-true: compute and communicate in the parameters' dtype
    if cfg.precision in MIXED_DTYPES:
        # Gather the parameters in 16 bits (half the traffic, half the unsharded memory) and compute in them;
        # reduce-scatter gradients in fp32 into the fp32 shards, which are the master weights the optimizer
        # steps. autocast stays on around forward for the ops it keeps in fp32 (softmax, the loss).
        mp_policy = MixedPrecisionPolicy(param_dtype=MIXED_DTYPES[cfg.precision], reduce_dtype=torch.float32)
    fully_shard_units(raw_model, mesh, cfg, mp_policy)
    compile_sharded(raw_model, cfg)
    optimizer = optimizer_over_dtensors(raw_model, optimizer_class, kwargs, cfg)
    return FSDP2Sharded(raw_model, optimizer, raw_model=raw_model, cfg=cfg, device=device, **spec)


def fully_shard_units(raw_model: nn.Module, mesh, cfg: ZeroConfig, mp_policy=None) -> None:
    """FSDP2 on `mesh`: each block (sharding.blocks) its own unit, then the root for the rest; stage 3 reshards after
    forward. mp_policy None: compute and communicate in the parameters' dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for parent, name in blocks(raw_model):
        fully_shard(getattr(parent, name), mesh=mesh, reshard_after_forward=cfg.stage == 3, mp_policy=mp_policy)
    fully_shard(raw_model, mesh=mesh, reshard_after_forward=cfg.stage == 3, mp_policy=mp_policy)  # the rest


def optimizer_over_dtensors(raw_model: nn.Module, optimizer_class, kwargs: dict, cfg: ZeroConfig):
    """The baseline's optimizer rebuilt over the DTensor parameters (no fused SGD on DTensors: foreach then)."""
    kwargs = dtensor_kwargs(optimizer_class, kwargs, cfg.optimizer_impl)
    return keep_impl(optimizer_class(raw_model.parameters(), **kwargs))


def compile_sharded(raw_model: nn.Module, cfg: ZeroConfig) -> None:
    """--compile under FSDP2, after fully_shard (docs/levers.md): each unit's forward is compiled on its own, so the
    FSDP hooks around it (all-gather before, reshard after: torch._dynamo.disable'd) stay outside the graphs.
    blocks: each block's forward, one graph per distinct shape (the GPT's 4 blocks share 1). model: the root's
    forward, which calls the FSDP-wrapped blocks, so dynamo splits it at their hooks (fullgraph=True there raises
    Unsupported: "skipping FSDP hooks"). Compiling before fully_shard also captured on torch 2.14.1 (measured)."""
    from manual_train.models import blocks_of, compile_forward

    units = [raw_model] if cfg.compile == "model" else blocks_of(cfg.model, raw_model) if cfg.compile == "blocks" \
        else []
    for unit in units:
        compile_forward(unit, fullgraph=cfg.compile == "blocks")
