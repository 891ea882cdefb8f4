"""The speed and memory levers (manual_train/models.py's Recomputed, manual_train/optim.py's keep_impl and build_optimizer).

Activation checkpointing recomputes each block's forward in backward: the recompute must see what forward saw
(the same dropout masks) and must not change state forward already changed (BatchNorm's running statistics). Killed
by the 64-true checks of tests/test_levers.py: gradients and buffers against no checkpointing, and the DDP loop with
dropout against itself without the levers.
"""
from mutants import Mutant

MUTANTS = [
    Mutant(
        name="levers-recompute-new-dropout-masks",
        technique="levers",
        file="manual_train/models.py",
        old="        return checkpoint(run, *args, use_reentrant=False, ",
        new="        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, ",
        says="The recompute without forward's RNG state (preserve_rng_state=False, to save a copy of the RNG per "
             "block): dropout draws other masks in backward's recompute, so the gradient is of another network.",
        report="allenai/OLMo#702 and allenai/OLMo-core#828 (preserve_rng_state=False with dropout), "
               "openai/guided-diffusion#167",
        kill=("tests/test_levers.py::test_ddp_and_zero_train_gpt_the_same_with_checkpointing_and_another_impl[ddp]",),
        demo=("single", 0, "--model", "gpt", "--dataset", "reverse", "--dropout", "0.1", "--activation-checkpointing",
              "full", "--optimizer", "adamw", "--lr", "3e-3", "--epochs", "4")),
    Mutant(
        name="levers-recompute-updates-batchnorm-again",
        technique="levers",
        file="manual_train/models.py",
        old="                m.momentum, m.num_batches_tracked = 0.0, None\n",
        new="                pass\n",
        says="The recompute runs BatchNorm in training mode as it is: its running mean and variance are updated "
             "twice per step (forward and recompute) and its batch count too; the gradients stay right, the "
             "evaluation statistics do not.",
        kill=("tests/test_levers.py::test_checkpointing_gradients_and_buffers_equal_none[resnet18]",),
        demo=("single", 0, "--model", "resnet18", "--dataset", "digits", "--activation-checkpointing", "full",
              "--epochs", "2")),
    Mutant(
        name="levers-resume-takes-the-checkpoints-impl",
        technique="levers",
        file="manual_train/optim.py",
        old="    optimizer.register_load_state_dict_post_hook(lambda opt: [g.update(chosen) for g in opt.param_groups])\n",
        new="",
        says="load_state_dict copies the checkpoint's param_groups, fused and foreach included: a run resumed with "
             "another --optimizer-impl silently steps with the one it was saved with.",
        kill=("tests/test_levers.py::test_resume_keeps_the_impl_it_was_built_with",),
        no_demo="a demo resumes with the command it started with, so the impl asked for is the checkpoint's; the bug "
                "shows when a resume asks for another --optimizer-impl, and then in which kernel steps, which the "
                "test reads off the optimizer."),
    Mutant(
        name="levers-fused-sgd-under-16-mixed",
        technique="levers",
        file="manual_train/optim.py",
        old="                                      cfg.optimizer == \"sgd\" and cfg.precision == \"16-mixed\", "
            "SCALER_SKIPS_FUSED_SGD,\n",
        new="                                      False, SCALER_SKIPS_FUSED_SGD,\n",
        says="The fastest kernel everywhere: fused SGD under the 16-mixed loss scaler, whose kernel writes its "
             "momentum on the overflow steps the scaler skips; the first real step jumps by it and the run reaches "
             "NaN.",
        report="LibreYOLO/libreyolo#771 (fused SGD corrupts momentum on scaler-skipped steps)",
        kill=("tests/test_levers.py::test_16_mixed_never_fuses_sgd_whose_kernel_writes_momentum_on_skipped_steps",),
        demo=("single", 0, "--precision", "16-mixed", "--model", "mlp", "--loss-scale-init", "1e9", "--epochs", "4")),
]
