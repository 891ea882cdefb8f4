"""Gradient accumulation (manual_train/loops/single.py's window, manual_train/data.py's window arithmetic)."""
from mutants import Mutant

KILL = ("tests/test_accumulation.py::test_16_x_4_equals_64_on_a_short_set",)
DEMO = ("single", 0, "--batch-size", "16", "--accumulate", "4", "--epochs", "2")

MUTANTS = [
    Mutant(
        name="accumulation-divide-by-k",
        technique="accumulation",
        file="manual_train/loops/single.py",
        old="            weight = x.shape[0] / data.window_samples(n_train, cfg.batch_size, cfg.accumulate, micro_step)",
        new="            weight = 1 / cfg.accumulate  # loss / K, as the articles write it",
        says="Each micro-batch's loss divided by K, also in the epoch's last, partial window: that window's gradient "
             "shrinks to its share of a full one, and short micro-batches weigh as much as full ones.",
        report="Lightning #19987",
        kill=KILL, demo=DEMO),
    Mutant(
        name="accumulation-mean-of-micro-means",
        technique="accumulation",
        file="manual_train/loops/single.py",
        old="            weight = x.shape[0] / data.window_samples(n_train, cfg.batch_size, cfg.accumulate, micro_step)",
        new="            weight = 1 / min(cfg.accumulate, micro_steps_per_epoch - micro_step // cfg.accumulate * "
            "cfg.accumulate)",
        says="The window's loss as the mean of its micro-batches' means: a short last micro-batch (12 samples) "
             "weighs as much as a full one (16).",
        kill=KILL, demo=DEMO),
    Mutant(
        name="accumulation-zero-grad-every-micro-step",
        technique="accumulation",
        file="manual_train/loops/single.py",
        old="            if window_start:\n                optimizer.zero_grad(set_to_none=True)",
        new="            if True:\n                optimizer.zero_grad(set_to_none=True)",
        says="zero_grad() before every micro-batch: only the window's last micro-batch reaches the step.",
        kill=KILL, demo=DEMO),
    Mutant(
        name="accumulation-step-every-micro-step",
        technique="accumulation",
        file="manual_train/loops/single.py",
        old="            window_end = (micro_step + 1) % cfg.accumulate == 0 or micro_step + 1 == micro_steps_per_epoch",
        new="            window_end = True  # a step per micro-batch",
        says="optimizer.step() after every micro-batch: K times the steps, each on a quarter of the gradient.",
        kill=("tests/test_accumulation.py::test_scheduler_and_step_counter_advance_once_per_window", *KILL),
        demo=DEMO),
]
