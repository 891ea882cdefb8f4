"""Tensor parallelism for the GPT (loops/tensor_parallel.py, docs/tensor_parallel.md), and 2-D FSDP2 x TP.

Megatron-LM's split (Shoeybi et al. 2019) of each transformer block over the --tp ranks of a DeviceMesh:
  attention ..... q, k, v column-wise (each rank computes the q, k, v of n_head/tp heads), proj row-wise (each rank
                  multiplies its heads' outputs by its rows of the projection; an all-reduce sums the partial
                  outputs): one all-reduce forward, one backward (the input's gradient, summed over q, k and v
                  first: the attention's input is declared replicated once, PrepareModuleInput)
  MLP ........... fc column-wise (a quarter of the hidden units on each of 4 ranks, GELU local), proj row-wise:
                  again one all-reduce forward, one backward
  the rest ...... embeddings, LayerNorms, the tied head: replicated on the tp ranks (the same computation on each)
with torch.distributed.tensor.parallel's parallelize_module, ColwiseParallel and RowwiseParallel: the sharded
weights are DTensors, in the GPT's own layout: q, k and v are three Linears (models.CausalSelfAttention; a fused
qkv would give rank 0 all of q and half of k), so every state dict and every DCP shard (--checkpoint-format dcp)
reads the same at any --tp. Two things the plain recipe misses, handled here:
  the heads ..... attention views its q, k, v as (B, T, heads, head_dim): with n_head/tp heads' columns per rank
                  the head count must come from the width (models.py's view with -1; a fixed n_head would cut
                  each rank's columns into n_head heads of head_dim/tp, and run, wrongly), head_dim stays C/n_head
  the DTensor/foreach trap  the layers left unsharded hold plain tensors: the foreach and fused optimizers
                  step all parameters in one kernel list, and fail with "aten._foreach_mul_.Scalar got mixed
                  torch.Tensor and DTensor" (fused: aten._fused_adamw_). Here they become DTensors too, replicated
                  on the tp mesh (replicate(), torch's distribute_module): every parameter a DTensor on one mesh
--sequence-parallel: the activations between the matmuls (LayerNorms, dropout, residual adds) split along the
sequence too, each all-reduce an all-gather plus a reduce-scatter (shard_blocks, split_sequence).
2-D (--dp D --tp T, D x T ranks): a (dp, tp) DeviceMesh; TP inside each row of T ranks, then FSDP2 fully_shard
over the dp dimension (per block, then the root, as manual_train/zero.py), which shards each TP shard again by
rows across the D replicas and reduce-scatters gradients over them. --stage 2 or 3 as in launch/zero.py.
--compile blocks: each block compiled after all that (zero.compile_sharded), TP's hooks and collectives in its graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from manual_train.config import UsageError, arg
from manual_train.distributed import DistEnv, read_env
from manual_train.memory import tp_report
from manual_train.zero import (FSDP2Sharded, ZeroConfig, compile_sharded, fully_shard_units,
                               optimizer_over_dtensors, sharding_spec)

GPT_SIZES = dict(n_head=4, n_embd=64, mlp=256)  # models._build_model's GPT: what --tp must divide


# ---------------------------------------------------------------------- the flags
@dataclass
class TensorParallelConfig(ZeroConfig):
    """launch/zero.py's flags (--stage: the FSDP2 of 2-D runs) plus the mesh's shape."""

    tp: int = arg(0, "tensor-parallel ranks that split every attention and MLP (0: world size / --dp)", min=0)
    dp: int = arg(1, "data-parallel replicas of the tensor-parallel model, sharded by FSDP2 (--stage 2 or 3); "
                     "--dp x --tp must be the world size", min=1)
    sequence_parallel: bool = arg(False, "also split the activations between the blocks' matmuls along the sequence "
                                         "(LayerNorms, dropout, residual adds): all-gather + reduce-scatter in place "
                                         "of each all-reduce, 1/tp of those activations per rank")

    def validate(self) -> None:
        super().validate()
        check_tp(self.model, self.tp, self.dp, self.impl, self.stage)

    def check_compile(self) -> None:
        """--compile blocks: parallelize() compiles each block after parallelize_module (and fully_shard)."""
        if self.compile == "model":
            raise UsageError("--compile", "compiling the whole DTensor model is not built here; each block is",
                             "none or blocks")
        super().check_compile()

    @property
    def compile_after_wrapping(self) -> bool:
        return True  # parallelize() compiles (zero.compile_sharded), not models.build_model_from

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp, tp) of the DeviceMesh; --tp 0 resolved."""
        return self.dp, self.tp or world_size // self.dp


def check_tp(model: str, tp: int, dp: int, impl: str, stage: int, world_size: int | None = None) -> None:
    """The combinations that cannot work, refused in one line before anything starts."""
    world_size = read_env().world_size if world_size is None else world_size
    if model != "gpt":
        raise UsageError("--model", f"tensor parallelism splits the GPT's attention and MLP; {model} has none",
                         "gpt (with --dataset reverse)")
    if world_size % dp:
        raise UsageError("--dp", f"{dp} does not divide the world size {world_size}", "a divisor of it")
    tp = tp or world_size // dp
    if dp * tp != world_size:
        raise UsageError("--tp", f"--dp {dp} x --tp {tp} != world size {world_size} (one rank per mesh cell)",
                         f"{world_size // dp}, or 0")
    for what, size in GPT_SIZES.items():
        if size % tp:
            raise UsageError("--tp", f"{tp} does not divide the GPT's {what} ({size})", "1, 2 or 4")
    if impl != "torch":
        raise UsageError("--impl", "2-D parallelism here is FSDP2 (torch) over TP's DTensors", "torch")
    if dp > 1 and stage == 1:
        raise UsageError("--stage", "ZeroRedundancyOptimizer does not take DTensor parameters", "2 or 3")


def dp_coords(cfg: TensorParallelConfig, env: DistEnv) -> tuple[int, int]:
    """(dp size, this rank's dp index): the mesh is (dp, tp) row-major, so ranks r*tp .. r*tp+tp-1 form replica r
    and share every batch."""
    dp, tp = cfg.mesh_shape(env.world_size)
    return dp, env.rank // tp


# ---------------------------------------------------------------------- the sharding
def _replicated_inputs(module, inputs, mesh):
    """distribute_module's input_fn: plain tensors in become DTensors replicated on the tp mesh (no copy)."""
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                 if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)


def replicate(raw_model: nn.Module, mesh) -> None:
    """Every module holding plain parameters (embeddings, LayerNorms, the head): its parameters replicated on the
    tp mesh (DTensors), its inputs made DTensors on the way in and its output a plain tensor on the way out. The
    computation is the same on every tp rank; the point is that every parameter is a DTensor (the foreach trap).
    The tied head gets the embedding's new parameter again (distribute_module makes one per module)."""
    from torch.distributed.tensor import DTensor, distribute_module

    for module in list(raw_model.modules()):
        plain = [p for p in module._parameters.values() if p is not None and not isinstance(p, DTensor)]
        if plain:
            distribute_module(module, mesh, input_fn=_replicated_inputs, output_fn=lambda m, out, _: out.to_local())
    if getattr(raw_model, "head", None) is not None:
        raw_model.head.weight = raw_model.tok.weight


def block_plan(sequence: bool = False) -> dict:
    """Megatron's split of one block, as parallelize_module's plan: {submodule name: its style}.

    attn's input is declared replicated before q, k and v take it, so that backward sums their three partial
    gradients of it and all-reduces once (torchtitan's plan; without it each Linear would all-reduce its own).
    sequence (--sequence-parallel, Korthikanti et al. 2022): between the matmuls the activations stay split along the
    sequence (Shard(1)); the LayerNorms run on this rank's positions (SequenceParallel: their replicated weights'
    gradients all-reduced), column-wise layers all-gather the sequence first, row-wise layers reduce-scatter their
    partial sums into it (together the bytes of the all-reduce they replace)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    into, out_of = (dict(input_layouts=Shard(1)), dict(output_layouts=Shard(1))) if sequence else ({}, {})
    plan = {"attn": PrepareModuleInput(input_layouts=(Shard(1) if sequence else Replicate(),),
                                       desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(**out_of),
            "mlp.0": ColwiseParallel(**into), "mlp.2": RowwiseParallel(**out_of)}
    if sequence:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    return plan


def shard_blocks(raw_model: nn.Module, mesh, sequence: bool = False) -> None:
    """block_plan applied to every block on the tp mesh (and --sequence-parallel's way in and out)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if sequence:
        split_sequence(raw_model, mesh)
    for block in raw_model.blocks:
        parallelize_module(block, mesh, block_plan(sequence))


def split_sequence(raw_model: nn.Module, mesh) -> None:
    """--sequence-parallel's way in and out: the embeddings' output (every position, the same on every tp rank)
    cut to this rank's positions, the last block's output gathered again (the head takes the last n_predict
    positions). As DTensor redistributions, so backward does the reverse: the embeddings' gradient gathered from
    every rank's positions, the head's gradient cut."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def move(out, src, dst):
        return DTensor.from_local(out, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()

    raw_model.drop.register_forward_hook(lambda m, inputs, out: move(out, Replicate(), Shard(1)))
    raw_model.blocks[-1].register_forward_hook(lambda m, inputs, out: move(out, Shard(1), Replicate()))


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TensorParallelConfig,
                device: torch.device) -> "TP":
    """TP (and FSDP2 over dp when --dp > 1) applied to the baseline's model; the optimizer rebuilt over the
    DTensors with the baseline's class and hyper-parameters (it has not stepped: nothing is lost)."""
    from torch.distributed.device_mesh import init_device_mesh

    spec, optimizer_class, kwargs = sharding_spec(model, optimizer, cfg, device)  # as zero.shard
    raw_model = spec["raw_model"]
    dp, tp = cfg.mesh_shape(dist.get_world_size())
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    shard_blocks(raw_model, mesh["tp"], cfg.sequence_parallel)
    replicate(raw_model, mesh["tp"])
    if dp > 1:  # FSDP2 over the replicas: each TP shard sharded again by rows (zero.py's stage 2 or 3)
        fully_shard_units(raw_model, mesh["dp"], cfg)
    # --compile blocks: each block's forward, DTensor hooks and collectives inside the graph (FSDP2's outside)
    compile_sharded(raw_model, cfg)
    optimizer = optimizer_over_dtensors(raw_model, optimizer_class, kwargs, cfg)
    return TP(raw_model, optimizer, **spec, mesh=mesh)


# ---------------------------------------------------------------------- what the loop calls
class TP(FSDP2Sharded):
    """zero.FSDP2Sharded's methods unchanged (no no_sync: FSDP reduce-scatters every micro-batch; DTensor norms for
    clipping; same_batch_count: TP's forward is a collective; the state dicts gathered from DTensors, or with
    --checkpoint-format dcp their shards, all in the GPT's own layout)."""

    def __init__(self, *args, mesh, **kwargs):
        self.mesh = mesh
        self.dp, self.tp = mesh.shape
        super().__init__(*args, **kwargs)  # full_model.sharded: (raw_model, optimizer), for DCP

    def __str__(self) -> str:
        fsdp = f", FSDP2 --stage {self.cfg.stage} over dp" if self.dp > 1 else ""
        return f"DeviceMesh (dp {self.dp}, tp {self.tp}): ColwiseParallel q, k, v, fc; RowwiseParallel proj{fsdp} + " \
               f"{type(self.optimizer).__name__}"

    def memory_report(self) -> tuple[str, dict]:
        return tp_report(self)


__all__ = ["TensorParallelConfig", "TP", "block_plan", "check_tp", "dp_coords", "parallelize"]
