"""Resume (manual_train/run.py's Run.start, manual_train/checkpoint.py's resume point and checks).

Most are killed by a 64-true single-process run killed in step 5 and resumed from step 4's mid-epoch last.pt on a
short set, held bit for bit to the uninterrupted run (tests/test_checkpoint.py::
test_a_mid_epoch_resume_on_a_short_set_is_bitwise); the world-size and DCP (FSDP2) ones by the 4 -> 2 rank resumes
of tests/test_world_size.py (its jobs run only the scenarios the test reads here).
"""
from mutants import Mutant

KILL = ("tests/test_checkpoint.py::test_a_mid_epoch_resume_on_a_short_set_is_bitwise",)
POSITION = "    return (int(ckpt[\"epoch\"]), epoch_samples_done(ckpt) // micro_batch, int(ckpt[\"step\"]),"
# the gallery's run: with dropout and a warm-up, stopped mid-epoch 1 (--max-steps 30 of 282) and resumed to its end,
# where it has learned (val acc >= 0.95) (constant after the warm-up: a cosine schedule's length may not change across a
# resume)
DEMO = dict(demo=("single", 0, "--model", "mlp", "--dropout", "0.1", "--epochs", "6", "--schedule", "constant",
                  "--warmup-steps", "40"), demo_stop=30)

MUTANTS = [
    Mutant(
        name="resume-no-rng-state",
        technique="resume",
        file="manual_train/run.py",
        old="            restore_rng(per_rank[env.rank] if len(per_rank) == env.world_size else ckpt[\"rng\"])\n",
        new="",
        says="The checkpoint's RNG streams not restored (Lightning's checkpoints hold none): after a resume every "
             "dropout mask, augmentation and worker seed differs from the uninterrupted run's.",
        kill=KILL, **DEMO),
    Mutant(
        name="resume-no-scheduler-state",
        technique="resume",
        file="manual_train/run.py",
        old="            scheduler.load_state_dict(ckpt[\"scheduler\"])\n",
        new="",
        says="The LR scheduler's state not loaded: the resumed run restarts the schedule (warm-up, cosine) from step "
             "0 while the optimizer continues.",
        kill=KILL, **DEMO),
    Mutant(
        name="resume-no-optimizer-state",
        technique="resume",
        file="manual_train/run.py",
        old="        optimizer.load_state_dict(ckpt[\"optimizer\"])\n",
        new="",
        says="The weights loaded, the optimizer's state not: SGD's momentum (Adam's moments and step count) starts "
             "from zero after every resume.",
        kill=KILL, **DEMO),
    Mutant(
        name="resume-at-epoch-start",
        technique="resume",
        file="manual_train/checkpoint.py",
        old=POSITION,
        new="    return (int(ckpt[\"epoch\"]), 0, int(ckpt[\"step\"]),",
        says="No sampler offset: a mid-epoch checkpoint resumes at its epoch's first batch, so the batches before "
             "it are trained twice (and the epoch's last ones never, when the step budget ends first).",
        kill=KILL, **DEMO),
    Mutant(
        name="resume-position-in-saved-micro-steps",
        technique="resume",
        file="manual_train/checkpoint.py",
        old=POSITION,
        new="    return (int(ckpt[\"epoch\"]), int(progress.get(\"micro_steps_done\", 0)), int(ckpt[\"step\"]),",
        says="The mid-epoch position kept in the checkpoint's own micro-steps: resumed at another world size or "
             "split of the same global batch (4 ranks x 4 -> 2 ranks x 4 x accumulate 2) it starts at the wrong "
             "sample and replays or skips part of the epoch.",
        kill=("tests/test_world_size.py::test_saved_at_4_resumed_at_2_ends_where_the_uninterrupted_run_does[ddp_mid]",),
        env={"JOB_SCENARIOS": "ddp_mid,ddp_mid_at2"},
        no_demo="it shows when a run resumes at another world size or split of the same global batch, and a demo "
                "resumes with the command it started with."),
    Mutant(
        name="resume-dcp-model-shards-only",
        technique="resume",
        file="manual_train/checkpoint.py",
        old="    dcp.load(tensors, checkpoint_id=str(folder))\n",
        new="    dcp.load({\"model\": tensors[\"model\"]}, checkpoint_id=str(folder))\n",
        says="A sharded (DCP) resume that asks for the model's shards only: DCP reads into the tensors it is given, "
             "so the optimizer's state (AdamW's moments and step count, set up empty by get_state_dict) stays at "
             "zero on every rank, at any world size.",
        kill=("tests/test_world_size.py::test_saved_at_4_resumed_at_2_ends_where_the_uninterrupted_run_does"
              "[zero-dcp_mid]",),
        env={"JOB_SCENARIOS": "zero-dcp_mid,zero-dcp_mid_at2"},
        demo=("zero", 2, "--impl", "torch", "--stage", "2", "--checkpoint-format", "dcp", "--optimizer", "adamw",
              "--lr", "2e-3", "--model", "mlp", "--epochs", "4", "--schedule", "constant"), demo_stop=30),
    Mutant(
        name="resume-world-size-unchecked",
        technique="resume",
        file="manual_train/checkpoint.py",
        old="        check_world_size_change(ckpt, cfg, world_size, flag, script)\n",
        new="        pass\n",
        says="A dropout run resumed at another world size without the check: N ranks' RNG streams cannot be dealt "
             "to M ranks, every rank takes rank 0's, and the masks differ from the run's.",
        kill=("tests/test_world_size.py::test_dropout_at_another_world_size_is_refused_and_taking_rank_0s_streams_is"
              "_wrong",),
        env={"JOB_SCENARIOS": "dropout_ref,dropout_boundary"},
        no_demo="it shows when a dropout run resumes at another world size, and a demo resumes with the command it "
                "started with."),
    Mutant(
        name="resume-no-early-stopping-state",
        technique="resume",
        file="manual_train/run.py",
        old="            self.early.load_state_dict(ckpt[\"early_stopping\"])\n",
        new="",
        says="Early stopping's best and patience count not restored: a resumed run takes its first evaluation for a "
             "new best and stops a patience later than the uninterrupted run.",
        kill=("tests/test_early_stopping.py::test_a_resumed_run_continues_the_patience_count",),
        demo=("single", 0, "--monitor", "val_acc", "--early-stop-patience", "2", "--epochs", "6", "--schedule",
              "constant"), demo_stop=94),
    Mutant(
        name="resume-augmentation-per-worker-stream",
        technique="resume",
        file="manual_train/data.py",
        old="        rng.manual_seed(mix64(self.seed, int(self.epoch), int(index)))\n",
        new="",
        says="Random augmentation drawn from the loader worker's own stream: a resumed epoch hands its batches to "
             "the workers from the resume point, and every crop and flip after it differs.",
        report="Lightning #17543 (closed as won't fix), Accelerate #4195",
        kill=("tests/test_augmentation.py::test_a_mid_epoch_resume_with_augmentation_in_two_workers_is_bitwise",),
        no_demo="random augmentation is cifar10's, which the gallery cannot download (the test augments digits "
                "itself)."),
]
