"""DDP (manual_train/loops/ddp.py's marked lines, manual_train/data.py's sampler): the weights, the order, the counts.

Most are killed by one 64-true check on 2 ranks whose last windows hold different numbers of samples (61 samples:
7 on rank 0, 6 on rank 1), which compares the weights, every logged train row, samples_seen and every rank's
validation with one process's (tests/test_ddp_parity.py::test_uneven_windows_on_two_ranks_equal_one_process; its
job runs that scenario alone here). The demos run launch/ddp.py under torchrun on 3 ranks and 77 samples (shards
26/26/25, the docstring's pairing) or on digits (the MLP, 4 or 5 epochs: val acc >= 0.95).
"""
from mutants import Mutant

FILE = "manual_train/loops/ddp.py"
KILL = ("tests/test_ddp_parity.py::test_uneven_windows_on_two_ranks_equal_one_process",)
ENV = {"JOB_SCENARIOS": "parity_odd"}
WEIGHT = "            weight = targets * env.world_size / window_targets"
UNEVEN = ("ddp", 3, "--dataset", "synthetic", "--synthetic-size", "77", "--batch-size", "5", "--accumulate", "2",
          "--epochs", "4")
DIGITS = ("ddp", 2, "--model", "mlp", "--epochs", "4", "--batch-size", "16")  # learns: val acc >= 0.95

MUTANTS = [
    Mutant(
        name="ddp-rank-window",
        technique="ddp",
        file="manual_train/data.py",
        old="        window = self._targets(range(first * m, (first + self.accumulate) * m))",
        new="        window = n * max(1, self._targets(range(first * m + self.sampler.rank, (first + self.accumulate) * m, "
            "n)))",
        says="Each rank weights by its OWN window and DDP averages the ranks' means, a mean of means wherever ranks' "
             "windows hold different numbers of targets: the last windows' samples (7 and 6 of 13: the 6 weigh as "
             "much as the 7), and on text every window's tokens.",
        report="pytorch/torchtitan #1842 (local instead of global valid tokens)",
        kill=KILL, env=ENV, demo=UNEVEN),
    Mutant(
        name="ddp-divide-by-n-twice",
        technique="ddp",
        file=FILE,
        old=WEIGHT,
        new="            weight = targets / window_targets",
        says="The loss divided by the global window's samples, forgetting that DDP's all-reduce averages (divides "
             "by N) too: every gradient is N times too small, as if the learning rate were lr / N.",
        kill=KILL, env=ENV, demo=DIGITS),
    Mutant(
        name="ddp-no-set-epoch",
        technique="ddp",
        file=FILE,
        old="        sampler.set_epoch(epoch, start=first * cfg.batch_size)",
        new="        sampler.start = first * cfg.batch_size  # no set_epoch(epoch): the sampler stays at epoch 0",
        says="No sampler.set_epoch(epoch): DistributedSampler shuffles with seed + 0 in every epoch, so every epoch "
             "repeats the first one's order (torch's DistributedSampler docs warn of exactly this).",
        kill=KILL, env=ENV, demo=DIGITS),
    Mutant(
        name="ddp-pad-duplicates",
        technique="ddp",
        file=FILE,
        old="    sampler = data.train_sampler(train_ds, cfg.seed, env.world_size, env.rank, pad=False)",
        new="    sampler = data.train_sampler(train_ds, cfg.seed, env.world_size, env.rank, pad=True)",
        says="DistributedSampler's own rule (pad=True): a set that N does not divide is filled up with repeats of "
             "its first samples, which then count twice in every epoch.",
        kill=KILL, env=ENV, demo=UNEVEN),
    Mutant(
        name="ddp-no-sync-inverted",
        technique="ddp",
        file=FILE,
        old="            with nullcontext() if window_end else model.no_sync():",
        new="            with model.no_sync() if window_end else nullcontext():",
        says="no_sync() on the wrong micro-step: the all-reduce runs on the window's first micro-batches and the "
             "last one's gradient stays local, so the ranks step with different gradients and drift apart (with "
             "--accumulate 1 nothing is ever all-reduced).",
        kill=KILL, env=ENV, demo=("ddp", 2, "--model", "mlp", "--epochs", "4", "--batch-size", "8", "--accumulate", "2")),
    Mutant(
        name="ddp-same-seed-every-rank",
        technique="ddp",
        file=FILE,
        old="    seed_everything(cfg.seed + env.rank)",
        new="    seed_everything(cfg.seed)",
        says="Every rank seeded alike after the model is built: N ranks draw one random stream N times over, so "
             "dropout masks and augmentations repeat on every rank.",
        kill=("tests/test_ddp_parity.py::test_each_rank_draws_its_own_random_numbers_and_a_resume_continues_them",),
        env={"JOB_SCENARIOS": "rng"},
        demo=("ddp", 2, "--model", "mlp", "--epochs", "5", "--batch-size", "16", "--dropout", "0.1")),
    Mutant(
        name="ddp-samples-seen-per-rank",
        technique="ddp",
        file=FILE,
        old="            samples_seen += data.window_samples(n_all, micro_batch, 1, micro_step)",
        new="            samples_seen += x.shape[0]",
        says="samples_seen counts this rank's micro-batches: rank 0 reports 1/N of the samples the group trained on "
             "(and throughput N times too low).",
        kill=KILL, env=ENV, demo=DIGITS),
    Mutant(
        name="ddp-logged-loss-rank-0",
        technique="ddp",
        file=FILE,
        old="                    loss_total, correct_total, targets = all_sum(loss_sum, correct, log_targets, device=device)",
        new="                    loss_total, correct_total, targets = loss_sum * env.world_size, correct, log_targets",
        says="The logged train loss and accuracy are rank 0's own micro-batches (the log window's sums not "
             "all-reduced): the log shows 1/N of the data, and a NaN on another rank never reaches rank 0.",
        kill=KILL, env=ENV, demo=DIGITS),
]
