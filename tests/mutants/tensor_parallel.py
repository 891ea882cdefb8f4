"""Tensor parallelism, sequence parallelism and 2-D FSDP2 x TP (manual_train/tensor_parallel.py, the head count of
models.CausalSelfAttention that TP relies on, manual_train/loops/tensor_parallel.py's mesh coordinates).

Each is killed by one of tests/test_tensor_parallel.py's parity checks against single.py (the GPT on reverse, 100
samples, accumulation over 2, clipping at 0.5), its job restricted to the scenario the killing test reads: --tp 2 in
64-true (within 1e-9), --tp 2 in fp32 (within 10 noise floors), --sequence-parallel in 64-true, --dp 2 --tp 2 on 4
ranks in 64-true. These are the known-wrong variants of the sequence-parallel, fp32 and 2-D checks.
The demos run launch/tensor_parallel.py under torchrun on 2 ranks (4 for 2-D), one epoch of the reverse task.
"""
from mutants import Mutant

LIB = "manual_train/tensor_parallel.py"
TEST = "tests/test_tensor_parallel.py"
TP2 = dict(kill=(f"{TEST}::test_tp2_trains_the_baselines_weights[tp2]",), env={"JOB_SCENARIOS": "tp2"})
DEMO = ("tensor_parallel", 2, "--epochs", "1")

MUTANTS = [
    Mutant(
        name="tensor-parallel-fixed-head-count",
        technique="tensor-parallel",
        file="manual_train/models.py",
        old="        q, k, v = (lin(x).unflatten(-1, (-1, head_size)).transpose(1, 2) for lin in (self.q, self.k, self.v))",
        new="        q, k, v = (lin(x).unflatten(-1, (self.n_head, -1)).transpose(1, 2) for lin in (self.q, self.k, "
            "self.v))",
        says="Attention views q, k, v as a fixed n_head heads: on a TP rank, which holds n_head/tp heads' columns, "
             "that cuts them into n_head heads of head_dim/tp; it runs, and attends over the wrong groups of "
             "features (one process is unchanged).",
        **TP2, demo=DEMO),
    Mutant(
        name="tensor-parallel-row-output-not-reduced",
        technique="tensor-parallel",
        file=LIB,
        old="    from torch.distributed.tensor import Replicate, Shard\n"
            "    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,\n"
            "                                                   SequenceParallel)\n\n"
            "    into, out_of = (dict(input_layouts=Shard(1)), dict(output_layouts=Shard(1))) if sequence else ({}, {})",
        new="    from torch.distributed.tensor import Partial, Replicate, Shard\n"
            "    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,\n"
            "                                                   SequenceParallel)\n\n"
            "    into, out_of = (dict(input_layouts=Shard(1)), dict(output_layouts=Shard(1))) if sequence else \\\n"
            "        ({}, dict(output_layouts=Partial()))  # the row-parallel matmul's partial sums, as they are",
        says="The row-parallel projections' outputs left as each rank's partial sums (no all-reduce): every rank "
             "adds only its heads' and hidden units' share to the residual stream.",
        kill=(f"{TEST}::test_tp2_in_fp32_is_within_the_noise_floor",), env={"JOB_SCENARIOS": "tp2_fp32"},
        demo=DEMO),
    Mutant(
        name="tensor-parallel-sp-norm-grads-not-reduced",
        technique="tensor-parallel",
        file=LIB,
        old="    if sequence:\n        plan.update({\"ln1\": SequenceParallel(), \"ln2\": SequenceParallel()})\n",
        new="",
        says="--sequence-parallel without SequenceParallel on the LayerNorms: they run on this rank's positions as "
             "if those were all of them (replicated), so their weights' gradients hold this rank's positions only "
             "and are never summed over the TP group; the ranks' LayerNorms part.",
        kill=(f"{TEST}::test_tp2_trains_the_baselines_weights[sp]",), env={"JOB_SCENARIOS": "sp"},
        demo=("tensor_parallel", 2, "--epochs", "1", "--sequence-parallel")),
    Mutant(
        name="tensor-parallel-untied-head",
        technique="tensor-parallel",
        file=LIB,
        old="    if getattr(raw_model, \"head\", None) is not None:\n"
            "        raw_model.head.weight = raw_model.tok.weight\n",
        new="",
        says="Replicating the layers module by module makes the tied head a parameter of its own (distribute_module "
             "builds one per module): embedding and head then train apart, each on half the gradient.",
        **TP2, demo=DEMO),
    Mutant(
        name="tensor-parallel-2d-sampler-over-all-ranks",
        technique="tensor-parallel",
        file="manual_train/loops/tensor_parallel.py",
        old="    sampler = data.train_sampler(train_ds, cfg.seed, dp, dp_rank, pad=False)",
        new="    sampler = data.train_sampler(train_ds, cfg.seed, env.world_size, env.rank, pad=False)",
        says="2-D with the DDP loop's sampler line kept: the training set split over all dp x tp ranks instead of "
             "the dp replicas, so the ranks of one TP group compute one layer on different samples (and sum "
             "their partial outputs), and each replica sees half its share.",
        kill=(f"{TEST}::test_dp2_tp2_trains_the_baselines_weights[dp2tp2]",), env={"JOB_SCENARIOS": "dp2tp2"},
        demo=("tensor_parallel", 4, "--dp", "2", "--tp", "2", "--epochs", "1")),
]
