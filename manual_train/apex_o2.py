"""apex's O2 (launch/apex_o2.py; loops/apex_o2.py is the lesson, docs/apex_o2.md the story).

  ApexO2Config ...... the base flags with --precision 16-o2 (default) or apex-o2, and the O2 scaler's cap
  16-o2 ............. apex's O2 written out: an fp16 model (BatchNorm kept fp32, `cast_o2`, `O2Forward`), fp32
                      master weights in the optimizer, dynamic loss scaling (`DynamicLossScaler`), the masters
                      copied back each step; checkpoints hold the masters (`O2Masters`)
  apex-o2 ........... apex.amp.initialize(model, optimizer, opt_level="O2") and amp.scale_loss, when apex.amp
                      is importable (CUDA only; `apex_amp_or_error`, `ApexScaler`)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from manual_train.config import COMPILE_SCRIPTS, MAX_LOSS_SCALE, O2_PRECISIONS, Config, _number, arg
from manual_train.errors import UsageError
from manual_train.precision import check_precision
from manual_train.runtime import resolve_device


def apex_amp_or_error():
    """apex.amp, or a one-line UsageError saying why not and what to use instead."""
    try:
        from apex import amp  # NVIDIA apex <= 25.05 built from source; the PyPI "apex" is unrelated
    except Exception:
        raise UsageError("--precision", "apex-o2 needs apex.amp, which is not importable here (apex is not on "
                         "PyPI and apex.amp was removed after release 25.05); --precision 16-o2 runs the same "
                         "O2 algorithm without apex", "16-o2") from None
    return amp


class DynamicLossScaler:
    """apex's dynamic loss scale, step by step (apex/amp/scaler.py, release 25.05 defaults).

    fp16 gradients of small losses underflow to zero; multiplying the loss by a large scale before
    backward moves them into fp16's range, and dividing the gradients by it afterwards restores
    them. Too large a scale overflows to inf: then the step is skipped and the scale halved. After
    `growth_interval` clean steps in a row it is doubled again, up to `max_scale`.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, max_scale: float = 2.0 ** 24):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.max_scale = growth_interval, max_scale
        self.clean_steps = 0  # steps since the last overflow or growth

    def get_scale(self) -> float:
        """As GradScaler.get_scale (Run.stepped reads it: the scale only shrinks on a skipped step); no host sync."""
        return self.scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def cast_o2(model: nn.Module) -> nn.Module:
    """O2's model cast: every parameter and buffer to fp16, except affine BatchNorm layers.

    BatchNorm stays fp32 because its running variance and the normalisation's reductions lose too
    much in fp16; cuDNN (and torch on CPU) accept fp16 input with fp32 BatchNorm weights.
    """
    for module in model.modules():
        keep_fp32 = isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None and t.is_floating_point() and not keep_fp32:
                    t.data = t.data.half()
    return model


class O2Forward(nn.Module):
    """O2's forward patch: floating inputs cast to fp16 going in, outputs cast to fp32 coming out.

    apex replaced `model.forward`; a wrapper module does the same visibly. The loss is then
    computed in fp32 from fp32 logits.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        x = x.half() if x.is_floating_point() else x
        return self.module(x).float()


class O2Masters:
    """16-o2's model as a checkpoint sees it (`run.start(model=O2Masters(...))`).

    state_dict(): the model's, with each fp16 parameter replaced by its fp32 master and every other floating
    entry in fp32, so an O2 checkpoint holds the weights the optimizer steps (not their rounded copy) and loads
    into a 32-true run as well. load_state_dict(): fp32 weights into the masters and into the fp16 model (copy_
    rounds), so a resumed run continues from the saved masters exactly (--resume, --restore-best).
    """

    def __init__(self, module: nn.Module, model_params: list, master_params: list):
        self.module = module
        self.master_of = {id(p): m for p, m in zip(model_params, master_params)}

    def _masters_by_name(self) -> dict:
        return {name: self.master_of[id(p)] for name, p in self.module.named_parameters(remove_duplicate=False)
                if id(p) in self.master_of}

    def state_dict(self) -> dict:
        masters = self._masters_by_name()
        return {k: masters[k].detach().clone() if k in masters else v.float() if v.is_floating_point() else v
                for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, master in self._masters_by_name().items():
                master.copy_(state[name])
        self.module.load_state_dict(state)


class ApexScaler:
    """apex-o2's loss scale as the loop and Run see a scaler: state_dict()/load_state_dict() are amp's own (what
    apex said to checkpoint), get_scale() its current scale (Run.stepped compares it with the previous step's:
    apex, too, halves it only on a skipped step), and update() nothing: apex updated it when scale_loss closed."""

    def __init__(self, amp):
        self.amp = amp

    def get_scale(self) -> float:
        return float(self.amp._amp_state.loss_scalers[0].loss_scale())

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return self.amp.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.amp.load_state_dict(state)


@dataclass
class ApexO2Config(Config):
    """launch/apex_o2.py's flags: the base ones with --precision 16-o2 (default) or apex-o2, and the O2 scaler's
    cap. The other scripts refuse these two precisions (Config.check_precision_choice)."""

    precision: str = arg("16-o2", "16-o2 is apex's O2 written out (loops/apex_o2.py); apex-o2 is apex.amp itself "
                                  "(CUDA, apex <= 25.05 built from source)", choices=O2_PRECISIONS)
    loss_scale_max: float = arg(2.0 ** 24, "cap on the dynamic loss scale (16-o2, as apex; at most 2**64)",
                                min=1, max=MAX_LOSS_SCALE)

    def check_precision_choice(self) -> None:
        pass  # argparse took one of O2_PRECISIONS

    def check_compile(self) -> None:
        if self.compile != "none":
            raise UsageError("--compile", "apex's amp.initialize patches forward after the model is built; not built "
                                          "for apex-o2", COMPILE_SCRIPTS)

    def validate_step(self) -> None:
        super().validate_step()
        if self.precision == "16-o2" and self.loss_scale_init > self.loss_scale_max:  # the scaler's cap
            cap = _number(self.loss_scale_max)
            raise UsageError("--loss-scale-init", f"{_number(self.loss_scale_init)} is above --loss-scale-max {cap}",
                             f"<= {cap}")
        if self.precision == "apex-o2":
            apex_amp_or_error()
            check_precision(self.precision, resolve_device(self.device))
