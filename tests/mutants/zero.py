"""ZeRO (manual_train/loops/zero.py, manual_train/zero.py, manual_train/sharding.py, manual_train/zero_fairscale.py):
fairscale's OSS and ShardedDDP, torch's ZeroRedundancyOptimizer (stage 1) and FSDP2 (stages 2, 3).

The arithmetic mutants are killed by the 64-true parity matrix of tests/test_zero_parity.py (AdamW, 2 ranks, two
epochs, within 1e-9 of DDP), its job restricted here to the two scenarios the killing case reads (the mutant's impl
and DDP under the same variant); the others by the named test of their symptom: the checkpoint's optimizer state
against DDP's, the per-rank bytes between forward and backward, the empty padding batches of the evaluation.
The demos run launch/zero.py under torchrun on 2 ranks (digits, the MLP, 4 epochs: val acc >= 0.95).
"""
from mutants import Mutant

PARITY = "tests/test_zero_parity.py::test_every_cpu_capable_impl_and_stage_equals_ddp"
CLIP = ("--grad-clip", "0.5")  # clips more than 1.0: FSDP2's local-norm bug shows (OSS's does not); 5 epochs


def parity(impl_stage: str, variant: str) -> dict:
    """The killing parity case of (impl_stage, variant) at 2 ranks, and its job's two scenarios."""
    return dict(kill=(f"{PARITY}[{impl_stage}-{variant}-2]",), env={"JOB_SCENARIOS": f"ddp_{variant},{impl_stage}_"
                                                                                       f"{variant}"})


def demo(stage: int, impl: str = "torch", *extra: str, epochs: int = 4) -> tuple:
    return ("zero", 2, "--stage", str(stage), "--impl", impl, "--model", "mlp", "--epochs", str(epochs), *extra)


MUTANTS = [
    Mutant(
        name="zero-sharded-ddp-optimizer-zero-grad",
        technique="zero",
        file="manual_train/zero_fairscale.py",
        old="        self.wrapper.zero_grad(set_to_none=True)",
        new="        self.optimizer.zero_grad()  # torch's: set_to_none=True",
        says="optimizer.zero_grad() under ShardedDDP (fairscale stage 2): every .grad set to None while the reduce "
             "buffers it was a view of keep the last step's sums, and those are what gets reduced: no error, the "
             "weights drift away from DDP's.",
        report="fairscale #354",
        **parity("fairscale2", "plain"), demo=demo(2, "fairscale")),
    Mutant(
        name="zero-oss-clip-local-norm",
        technique="zero",
        file="manual_train/zero_fairscale.py",
        old="    total_norm = local_norm ** 2\n    dist.all_reduce(total_norm)\n",
        new="    total_norm = local_norm ** 2  # the norm of the gradients this rank's OSS shard owns, alone\n",
        says="Clipping by the norm of the local shard's gradients (OSS, each rank's tensors) in place of the global "
             "norm: every rank clips by another factor, the ranks' parameters step with gradients scaled differently.",
        **parity("fairscale1", "clip"), demo=demo(1, "fairscale", *CLIP, epochs=5)),
    Mutant(
        name="zero-fsdp2-clip-local-shard-norm",
        technique="zero",
        file="manual_train/sharding.py",
        old="        return torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)",
        new="        grads = [getattr(p.grad, '_local_tensor', p.grad) for p in self.raw_model.parameters() "
            "if p.grad is not None]\n"
            "        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  "
            "# this rank's shard\n"
            "        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))\n"
            "        return norm",
        says="clip_grad_norm_ written over the local tensors of FSDP's sharded gradients: each rank clips by the "
             "norm of its own 1/N rows, so the clipped gradient is no longer the unsharded one's direction.",
        **parity("torch2", "clip"), demo=demo(2, "torch", *CLIP, epochs=5)),
    Mutant(
        name="zero-optimizer-state-not-consolidated",
        technique="zero",
        file="manual_train/sharding.py",
        old="        self.optimizer.consolidate_state_dict(to=0)\n"
            "        return self.optimizer.state_dict() if dist.get_rank() == 0 else {}",
        new="        return self.optimizer.optim.state_dict()  # this rank's shard (consolidating is a collective)",
        says="The checkpoint saves the local optimizer's state_dict() (ZeroRedundancyOptimizer's .optim) instead of "
             "consolidating every rank's shard first: last.pt holds rank 0's shard alone, renumbered, and a resume "
             "restarts the other tensors' Adam moments from zero.",
        kill=("tests/test_zero_parity.py::test_checkpoint_holds_ddps_full_model_and_optimizer_state[torch1]",),
        env={"JOB_SCENARIOS": "ddp_half,torch1_half"},
        demo=demo(1, "torch", "--optimizer", "adamw", "--lr", "2e-3", "--schedule", "constant"), demo_stop=100),
    Mutant(
        name="zero-fsdp2-reshard-after-forward-inverted",
        technique="zero",
        file="manual_train/zero.py",
        old="        fully_shard(getattr(parent, name), mesh=mesh, reshard_after_forward=cfg.stage == 3, "
            "mp_policy=mp_policy)",
        new="        fully_shard(getattr(parent, name), mesh=mesh, reshard_after_forward=cfg.stage == 2, "
            "mp_policy=mp_policy)",
        says="reshard_after_forward the wrong way round for the blocks: --stage 3 keeps every gathered block from "
             "forward to backward (ZeRO-2's memory), --stage 2 frees them; the weights are the same, the memory is "
             "not what the stage promises.",
        kill=("tests/test_zero_parity.py::test_stage_3_shards_parameters_and_gradients_too[2]",),
        env={"JOB_SCENARIOS": "memory"}, demo=demo(3)),
    Mutant(
        name="zero-eval-padded-with-repeats",
        technique="zero",
        file="manual_train/sharding.py",
        old="            yield tuple(t[:0] for t in last)",
        new="            yield last  # one more batch, as DistributedSampler pads with repeats",
        says="The rank with fewer validation batches pads with its last batch again (DistributedSampler's pad=True "
             "idea) instead of an empty one: those samples count twice in the validation loss and accuracy.",
        kill=("tests/test_zero_cli.py::test_padding_with_empty_batches_leaves_the_evaluation_sums_unchanged",),
        demo=demo(3, "torch", "--eval-batch-size", "148")),
    Mutant(
        name="zero-fsdp2-optimizer-before-sharding",
        technique="zero",
        file="manual_train/zero.py",
        old="    fully_shard_units(raw_model, mesh, cfg, mp_policy)\n    compile_sharded(raw_model, cfg)\n"
            "    optimizer = optimizer_over_dtensors(raw_model, optimizer_class, kwargs, cfg)\n",
        new="    optimizer = optimizer_over_dtensors(raw_model, optimizer_class, kwargs, cfg)  # before fully_shard\n"
            "    fully_shard_units(raw_model, mesh, cfg, mp_policy)\n    compile_sharded(raw_model, cfg)\n",
        says="The optimizer built before fully_shard: it holds the unsharded parameters, which FSDP2 has replaced by "
             "DTensor shards; their .grad stays None, so step() updates tensors no forward uses and the model never "
             "trains.",
        kill=("tests/test_zero_cli.py::test_shards_optimizer_steps_the_parameters_forward_uses[3]",), demo=demo(3)),
]
