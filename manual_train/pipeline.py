"""Pipeline parallelism for the GPT (loops/pipeline.py, docs/pipeline.md): its layers split into consecutive stages,
one stage per rank, each batch cut into micro-batches that flow through the stages.

  split .............. Stage: blocks lo..hi-1 of the GPT under the GPT's own names; the first stage also holds the
                       embeddings, the last the final LayerNorm and the head (whose weight is the embedding's: tied)
  the schedule ....... --impl explicit: GPipe written out with send/recv (gpipe_step): every micro-batch forward
                       (the fill), then every backward in reverse (the drain). Stage s waits s ticks before its first
                       forward and as long after its last backward: the bubble, (p-1)/(m+p-1) of the step.
                       --impl torch: torch.distributed.pipelining's PipelineStage with --pipeline-schedule gpipe,
                       1f1b or interleaved-1f1b (two stages per rank, which shortens the bubble)
  exact micro-batches  each micro-batch's loss is its sum over its targets / the batch's targets (rows differ in
                       targets on text); --impl torch pads a batch to a whole number of equal micro-batches, the
                       padded rows' targets ignored (-100)
  tied weights ....... the embedding (first stage) and the head (last) are one tensor: their gradients are summed
                       across the two ranks before the step (Megatron's embedding group), so both copies stay equal
  checkpoints ........ Pipeline.state_dict() and wrap_optimizer gather every stage's state: Run's checkpoint holds
                       the full GPT (any loop can load it) and the optimizer state of each stage
  --compile .......... after the split: each of this rank's Stages (model) or their blocks (blocks); compiling the
                       GPT before it would compile GPT.forward, which no stage runs
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from manual_train.checkpoint import FullState
from manual_train.config import UsageError, arg
from manual_train.distributed import DDPConfig, DistEnv, read_env
from manual_train.models import GPT, GPT_LAYERS, IGNORE, compile_forward



@dataclass
class PipelineConfig(DDPConfig):
    """The DDP loop's flags (its process group's: --backend, --dist-timeout-s; DDP's knobs are refused) plus the
    pipeline's."""

    impl: str = arg("explicit", "explicit: GPipe written out with send/recv; torch: torch.distributed.pipelining",
                    choices=("explicit", "torch"))
    # (not --schedule: that is the LR schedule's flag)
    pipeline_schedule: str = arg("gpipe", "--impl torch's pipeline schedule (explicit is GPipe)",
                                 choices=("gpipe", "1f1b", "interleaved-1f1b"))
    microbatches: int = arg(4, "micro-batches each batch is cut into (the bubble is (p-1)/(m+p-1) of a step)", min=1)
    stages: int = arg(0, "pipeline stages (0: the world size; one stage per rank)", min=0)
    dp: int = arg(1, "data-parallel replicas of the pipeline (only 1: see docs/pipeline.md)", min=1)

    @property
    def compile_after_wrapping(self) -> bool:
        return True  # --compile: each Stage after the split (Pipeline), not the whole GPT before it

    def validate(self) -> None:
        # DDP's knobs first: DDPConfig's checks of them would advise on a DistributedDataParallel that is never built
        if self.sync_bn:
            raise UsageError("--sync-bn", "the pipeline's GPT has no BatchNorm layers to synchronise", "leave it out")
        knobs = self.knobs_set()
        if knobs:  # as ZeroConfig's: silently ignored, they would promise what this loop never does
            raise UsageError(knobs[0], "is a knob of the DDP loop's DistributedDataParallel; launch/pipeline.py builds "
                                       "none (each rank holds other stages: no replica to all-reduce gradients with)",
                             "launch/ddp.py, or leave it out")
        super().validate()
        world_size = read_env().world_size
        if self.model != "gpt":
            raise UsageError("--model", f"the pipeline splits the GPT's blocks; {self.model} has none",
                             "gpt (with --dataset reverse)")
        if self.loss is not None:
            raise UsageError("--loss", "the pipeline's last stage computes the cross-entropy in micro-batch shares "
                                       "(pipeline.share); another loss is not built there", "no --loss")
        if self.dp != 1:
            raise UsageError("--dp", "pipeline x data parallel is not built here (each stage would need its own DDP "
                                     "group and the tied embedding a group per replica)", "1")
        if self.stages not in (0, world_size):
            raise UsageError("--stages", f"{self.stages} stages x --dp {self.dp} != world size {world_size} "
                                         "(one stage per rank)", f"{world_size}, or 0")
        per_rank = 2 if self.impl == "torch" and self.pipeline_schedule == "interleaved-1f1b" else 1
        if per_rank > 1 and world_size == 1:  # torch 2.14: its backward fails ("can't steal_bwd_input ...")
            raise UsageError("--pipeline-schedule", "interleaved-1f1b needs 2 or more ranks: with both stages on one "
                                                    "rank torch.distributed.pipelining fails at the first backward",
                             "torchrun --nproc_per_node=2 or more, or gpipe / 1f1b")
        if GPT_LAYERS % (world_size * per_rank):
            raise UsageError("--stages", f"{world_size * per_rank} stages do not divide the GPT's {GPT_LAYERS} "
                                         "blocks" + (" (interleaved-1f1b: two stages per rank)" if per_rank > 1
                                                     else ""), "a world size that divides it")
        if self.precision == "16-mixed":
            raise UsageError("--precision", "16-mixed: each stage's GradScaler would skip steps on its own "
                                            "gradients alone, and the stages would part", "32-true, 64-true, "
                                                                                          "bf16-mixed")


class Stage(nn.Module):
    """Blocks lo..hi-1 of `gpt`, plus its embeddings (first stage) or final LayerNorm and head (last stage), under
    the GPT's own attribute names: state_dict keys are the full model's, and forward runs GPT's own code."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.n_predict = first, last, gpt.n_predict
        if first or last:
            self.tok = gpt.tok  # the last stage's head multiplies by the embedding's weight (tied)
        if first:
            self.pos, self.drop = gpt.pos, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})  # keys "blocks.<i>..." as GPT's
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        if self.first:
            x = GPT.embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        return GPT.logits(self, x) if self.last else x


def share(logits, y, targets: int) -> torch.Tensor:
    """A micro-batch's part of its batch's mean loss: the sum over its targets / the batch's `targets`, so the parts
    add up to the batch's mean loss whatever the micro-batches' rows and targets (the mean of each / m would
    over-weight a short one)."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE, reduction="sum") / targets


class Pipeline(nn.Module):
    """This rank's stage(s) of a GPT and the schedule that runs them: step() trains one batch (forward and backward
    of every micro-batch), forward() evaluates (every rank gets the last stage's logits)."""

    def __init__(self, gpt: GPT, cfg: PipelineConfig, env: DistEnv, device: torch.device):
        super().__init__()
        p, rank, self.env, self.m, self.device = env.world_size, env.rank, env, cfg.microbatches, device
        per_rank = 2 if cfg.impl == "torch" and cfg.pipeline_schedule == "interleaved-1f1b" else 1
        n_stages, depth = p * per_rank, len(gpt.blocks) // (p * per_rank)
        ids = [rank + k * p for k in range(per_rank)]  # interleaved: rank r runs stages r and r + p
        self.stages = nn.ModuleList(Stage(gpt, s * depth, (s + 1) * depth, s == 0, s == n_stages - 1) for s in ids)
        for stage in self.stages:  # --compile: this rank's stages (model) or their blocks; GPT.forward never runs
            for unit in [stage] if cfg.compile == "model" else stage.blocks.values() if cfg.compile == "blocks" else []:
                compile_forward(unit, fullgraph=True)
        self.first, self.last = rank == 0, rank == p - 1
        self.width, self.vocab, self.n_predict = gpt.tok.embedding_dim, gpt.tok.num_embeddings, gpt.n_predict
        self.dtype = gpt.tok.weight.dtype
        # the tied weight's two holders; a group of both (every rank must take part in creating it)
        self.tied_group = dist.new_group([0, p - 1]) if p > 1 else None
        self.impl, self.schedule_name, self.stage_ids, self.n_stages = cfg.impl, cfg.pipeline_schedule, ids, n_stages
        self.schedules: dict = {}  # --impl torch: one per (batch rows, train/eval), built at first use

    def __str__(self) -> str:
        how = "GPipe, send/recv" if self.impl == "explicit" else f"torch.distributed.pipelining {self.schedule_name}"
        return f"{self.n_stages} stages ({how}), {self.m} micro-batches, this rank's: {self.stage_ids}"

    # ------------------------------------------------------------------ training: one batch
    def step(self, x, y, weight: float, targets: int, autocast):
        """Forward and backward of every micro-batch of (x, y), which holds `targets` targets; gradients accumulate
        into .grad, scaled so that they add up to `weight` x the batch's mean-loss gradient (the baseline's
        `(loss * weight).backward()`). Returns (weight x the batch's mean loss, the argmax predictions, y's shape):
        the last stage's; on the others a 0 and -1s (no prediction matches a target)."""
        if self.impl == "torch":
            return self._torch_step(x, y, weight, targets, autocast)
        return gpipe_step(self, x, y, weight, targets, autocast)

    def forward(self, x):
        """Evaluation: the pipeline's forward of x; every rank returns the last stage's logits (a broadcast of
        B x n_predict x V numbers: small here; a real vocabulary would send the three sums instead)."""
        n = x.shape[0]
        out = torch.empty(n, self.n_predict or x.shape[1], self.vocab, dtype=self.dtype, device=self.device)
        if self.impl == "torch":
            logits = self._torch_schedule(n, train=False).eval(*[pad(x, self.m, 0)] if self.first else [])
        else:
            logits = gpipe_forward(self, x)
        if self.last:
            out.copy_(logits[:n])
        if self.env.world_size > 1:
            dist.broadcast(out, src=self.env.world_size - 1)
        return out

    # ------------------------------------------------------------------ the step's collectives
    def reduce_tied_grads(self) -> None:
        """Sum the tied weight's gradient of the embedding (first stage) and of the head (last stage), as one
        module's .grad holds both on a single device; both ranks then take the same optimizer step."""
        if self.tied_group is not None and (self.first or self.last):
            dist.all_reduce(self.tied_weight().grad, group=self.tied_group)

    def tied_weight(self):
        """The embedding's weight on the first rank, the head's (the same values) on the last; None elsewhere."""
        holder = self.stages[0] if self.first else self.stages[-1]
        return holder.tok.weight if self.first or self.last else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The baseline's clip_grad_norm_ over the whole model: each rank's sum of squares, all-reduced (the tied
        weight counted once, on the first stage), then every gradient scaled by the same factor."""
        params = [p for p in self.parameters() if p.grad is not None]
        counted = [p.grad for p in params if self.first or p is not self.tied_weight()]
        norm_sq = torch.nn.utils.get_total_norm(counted, 2.0).to(torch.float64) ** 2
        dist.all_reduce(norm_sq)
        total = norm_sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # ------------------------------------------------------------------ --impl torch
    def _torch_schedule(self, rows: int, train: bool):
        """PipelineStage fixes its micro-batches' shapes at its first step, so each batch size (training, the
        epoch's last batch padded, evaluation) gets its own stage objects and schedule (the same modules)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        key = (rows, train)
        if key not in self.schedules:
            stages = [PipelineStage(st, s, self.n_stages, self.device) for st, s in zip(self.stages, self.stage_ids)]
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
            cls = kind[self.schedule_name]
            # scale_grads=False: the loss below is already each micro-batch's share (torch's default divides by m)
            self.schedules[key] = cls(stages if cls is ScheduleInterleaved1F1B else stages[0], self.m,
                                      loss_fn=self._torch_loss if train else None, scale_grads=False)
        return self.schedules[key]

    def _torch_loss(self, logits, y):
        self._predictions.append(logits.detach().argmax(-1))
        return share(logits, y, self._targets) * self._weight  # the padded rows' targets are IGNORE: none

    def _torch_step(self, x, y, weight, targets, autocast):
        n = x.shape[0]
        self._weight, self._targets = weight, targets
        self._predictions = []
        losses: list = []
        inputs = [pad(x, self.m, 0)] if self.first else []  # the first stage's only
        with autocast():
            self._torch_schedule(n, train=True).step(*inputs, target=pad(y, self.m, IGNORE), losses=losses,
                                                     return_outputs=False)
        if not self.last:
            return torch.zeros((), device=self.device), torch.full_like(y, -1)
        return torch.stack(losses).sum().detach(), torch.cat(self._predictions)[:n]  # without the padded rows

    # ------------------------------------------------------------------ checkpoints: the full state
    def local_state(self) -> dict:
        return {k: v for stage in self.stages for k, v in stage.state_dict().items()}

    def state_dict(self, *args, **kwargs) -> dict:
        """The full GPT's state_dict, as Run checkpoints it: every rank calls this (a gather of every stage's)."""
        return {k: v for part in gather(self.local_state(), self.env) for k, v in part.items()}

    def load_state_dict(self, full: dict, strict: bool = True):
        """A full GPT's state_dict (any loop's checkpoint of it): each stage takes its own entries."""
        for stage in self.stages:
            stage.load_state_dict({k: full[k] for k in stage.state_dict()}, strict=strict)

    def wrap_optimizer(self, optimizer) -> FullState:
        """Each rank's optimizer state, a list by rank in the checkpoint (resumed at the same number of stages)."""

        def state_dict() -> dict:
            return {"pipeline_stages": gather(optimizer.state_dict(), self.env)}

        def load_state_dict(state: dict) -> None:
            parts = state.get("pipeline_stages")
            if parts is None or len(parts) != self.env.world_size:
                raise UsageError("--resume", f"the checkpoint's optimizer is not a {self.env.world_size}-stage "
                                             "pipeline's", "a checkpoint of launch/pipeline.py at this world size")
            optimizer.load_state_dict(parts[self.env.rank])

        return FullState(state_dict, load_state_dict)


def gather(obj, env: DistEnv) -> list:
    """Every rank's `obj`, a list by rank (all_gather_object pickles it: checkpoints only, not the step)."""
    parts = [None] * env.world_size
    dist.all_gather_object(parts, obj)
    return parts


def pad(t: torch.Tensor, m: int, value) -> tuple:
    """t with rows of `value` appended up to a multiple of m. torch's schedule cuts a batch into m
    equal micro-batches; the padded rows' targets are IGNORE, so they add nothing to the loss or the gradients."""
    extra = -t.shape[0] % m
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)]) if extra else t


# ---------------------------------------------------------------------- --impl explicit: GPipe with send/recv
def micro_batches(x, y, m: int):
    """x and y cut into at most m micro-batches of nearly equal rows (torch.tensor_split: 30 -> 8, 8, 7, 7);
    every rank cuts the same batch the same way, so each knows the shapes it will receive."""
    return [(xc, yc) for xc, yc in zip(x.tensor_split(m), y.tensor_split(m)) if len(xc)]


def gpipe_step(pipe: Pipeline, x, y, weight: float, targets: int, autocast):
    """GPipe (Huang et al. 2019) on this rank's stage: forward every micro-batch, then backward them in reverse.

    With p stages, stage s receives micro-batch j at tick s + j: it idles s ticks before its first forward (the
    fill) and p - 1 - s ticks after its last (the drain starts at the last stage); the same again in backward.
    Every stage keeps all m micro-batches' activations until its backward: memory grows with m (1F1B bounds it).
    """
    stage, rank = pipe.stages[0], pipe.env.rank
    inputs, outputs, sends = [], [], []
    loss_sum = torch.zeros((), device=pipe.device)
    predictions = []
    for xc, yc in micro_batches(x, y, pipe.m):  # the fill: forward of every micro-batch
        inp = xc if pipe.first else recv((len(xc), x.shape[1], pipe.width), pipe, rank - 1).requires_grad_()
        with autocast():  # forward and loss, as the baseline's
            out = stage(inp)
            if pipe.last:  # the loss: this micro-batch's part of the batch's mean, times the window's weight
                predictions.append(out.detach().argmax(-1))
                out = share(out, yc, targets) * weight
                loss_sum += out.detach()
        if not pipe.last:
            sends.append(dist.isend(out.detach().to(pipe.dtype).contiguous(), rank + 1))
        inputs.append(inp)
        outputs.append(out)
    for inp, out in zip(reversed(inputs), reversed(outputs)):  # the drain: backward, last micro-batch first
        grad = None if pipe.last else recv(out.shape, pipe, rank + 1)
        out.backward(grad)
        if not pipe.first:
            sends.append(dist.isend(inp.grad.contiguous(), rank - 1))
    for work in sends:
        work.wait()
    return loss_sum, torch.cat(predictions) if pipe.last else torch.full_like(y, -1)


def gpipe_forward(pipe: Pipeline, x):
    """Evaluation's fill: forward only, every micro-batch; the last stage returns the logits of all of them."""
    stage, rank = pipe.stages[0], pipe.env.rank
    outs, sends = [], []
    for xc, _ in micro_batches(x, x, pipe.m):
        inp = xc if pipe.first else recv((len(xc), x.shape[1], pipe.width), pipe, rank - 1)
        out = stage(inp)
        if pipe.last:
            outs.append(out)
        else:
            sends.append(dist.isend(out.to(pipe.dtype).contiguous(), rank + 1))
    for work in sends:
        work.wait()
    return torch.cat(outs) if pipe.last else None


def recv(shape, pipe: Pipeline, src: int) -> torch.Tensor:
    buf = torch.empty(shape, dtype=pipe.dtype, device=pipe.device)
    dist.recv(buf, src)
    return buf
