"""Optimizer (and its implementation, docs/levers.md), LR schedule and LR scaling with the batch size
(docs/batch_size.md)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from manual_train.config import SCALER_SKIPS_FUSED_SGD, Config
from manual_train.errors import UsageError


def scaled_lr(cfg: Config, global_batch_size: int) -> float:
    """--lr scaled from --base-batch-size to the global batch.

    linear: lr * B / B0 (Goyal et al. 2017, for SGD with warm-up); sqrt: lr * sqrt(B / B0) (the
    rule often used with Adam); none: --lr as given.
    """
    ratio = global_batch_size / cfg.base_batch_size
    if cfg.lr_scaling == "linear":
        return cfg.lr * ratio
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr


def resolve_impl(impl: Optional[str], params: list) -> str:
    """--optimizer-impl, or (None) the fastest that applies to these parameters' device and dtype.

    fused: one kernel per (device, dtype) group that reads each parameter, gradient and state once (torch's CPU
    kernels since 2.4, CUDA, MPS, XPU): 4.2x (SGD) and 5.3x (AdamW) as fast as for-loop on a 2-core CPU
    (docs/levers.md); floating parameters only. foreach: one multi-tensor op per math step (few CUDA launches; on
    the CPU a loop in C++, no faster than for-loop here). for-loop: one Python-driven op per parameter per math
    step, what torch.optim runs on the CPU when neither is asked for, and the one every kernel is checked against.
    """
    if impl is not None:
        return impl
    fused_devices = _get_fused_kernels_supported_devices()
    if params and all(p.device.type in fused_devices and p.is_floating_point() for p in params):
        return "fused"
    return "foreach" if params and all(p.is_cuda for p in params) else "for-loop"


def build_optimizer(cfg: Config, params, lr: float) -> torch.optim.Optimizer:
    """torch.optim's SGD (momentum 0.9) or AdamW with --optimizer-impl's kernel (resolve_impl); under 16-mixed, SGD
    is never fused (config.SCALER_SKIPS_FUSED_SGD): the default falls back to foreach, an explicit fused is refused."""
    params = list(params)
    impl = resolve_impl(cfg.optimizer_impl, params)
    kwargs = dict(lr=lr, weight_decay=cfg.weight_decay, foreach=impl == "foreach", fused=impl == "fused" or None)
    kwargs = foreach_instead_of_fused(kwargs, cfg.optimizer_impl,
                                      cfg.optimizer == "sgd" and cfg.precision == "16-mixed", SCALER_SKIPS_FUSED_SGD,
                                      "foreach, for-loop, or --optimizer adamw")
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, **kwargs)
    else:
        optimizer = torch.optim.SGD(params, momentum=0.9, **kwargs)
    return keep_impl(optimizer)


def keep_impl(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Keep this optimizer's implementation across load_state_dict (--resume).

    load_state_dict copies the checkpoint's param_groups, "fused" and "foreach" included: a run resumed with
    another --optimizer-impl would silently step with the checkpoint's. The state itself (step, exp_avg,
    exp_avg_sq, momentum_buffer) has one layout for all three, so only the two keys are put back.
    """
    chosen = {k: optimizer.param_groups[0].get(k) for k in ("foreach", "fused")}
    optimizer.register_load_state_dict_post_hook(lambda opt: [g.update(chosen) for g in opt.param_groups])
    return optimizer


def dtensor_kwargs(optimizer_class, kwargs: dict, impl: Optional[str]) -> dict:
    """kwargs for optimizer_class over DTensor parameters (FSDP2): DTensor has no sharding rule for fused SGD's
    kernel (torch 2.14), so the fastest that applies is foreach; an explicit --optimizer-impl fused is refused."""
    return foreach_instead_of_fused(kwargs, impl, optimizer_class is torch.optim.SGD,
                                    "fused SGD does not run on FSDP2's DTensor parameters (torch has no sharding "
                                    "rule for it)", "foreach, for-loop, or --optimizer adamw")


def sharded_scaler_kwargs(kwargs: dict, precision: str, impl: Optional[str]) -> dict:
    """kwargs for an optimizer stepped by a ZeRO loss scaler under 16-mixed. GradScaler hands a fused optimizer its
    scale and found_inf to skip inside the kernel; the sharded scalers (FSDP2's ShardedGradScaler, fairscale's)
    keep found_inf as a 1-element tensor, which the fused kernels refuse (torch 2.14: "output with shape [] doesn't
    match the broadcast shape [1]"). So foreach there, and an explicit --optimizer-impl fused is refused."""
    return foreach_instead_of_fused(kwargs, impl, precision == "16-mixed",
                                    "fused optimizers do not take ZeRO's sharded loss scaler's found_inf under "
                                    "16-mixed (torch 2.14)", "foreach, for-loop, or --precision bf16-mixed")


def foreach_instead_of_fused(kwargs: dict, impl: Optional[str], fused_fails: bool, why: str, allowed: str) -> dict:
    """Where a fused kernel cannot run (`fused_fails`): the default falls back to foreach, an explicit
    --optimizer-impl fused is a one-line refusal saying `why`."""
    if not (fused_fails and kwargs.get("fused")):
        return kwargs
    if impl == "fused":
        raise UsageError("--optimizer-impl", why, allowed)
    return {**kwargs, "fused": None, "foreach": True}


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    """LambdaLR over optimizer steps: linear warm-up, then cosine decay to zero (or constant)."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
