"""Gradient accumulation (manual_train/loops/single.py's window, manual_train/data.py's window arithmetic: Windows
counts every target of a window, a text's tokens included)."""
from mutants import Mutant

KILL = ("tests/test_accumulation.py::test_16_x_4_equals_64_on_a_short_set",)
# The baseline's global batch of 32 as 4 micro-batches of 8 (1500 samples: the last window holds 3.5 micro-batches), on
# the MLP for 4 epochs: the correct run learns the digits (val acc >= 0.95), so what a bug costs shows.
DEMO = ("single", 0, "--model", "mlp", "--batch-size", "8", "--accumulate", "4", "--epochs", "4")
TEXT_KILL = ("tests/test_text.py::test_every_loop_trains_single_pys_weights_on_text[ddp_acc]",)
TEXT_ENV = {"JOB_SCENARIOS": "ddp_acc"}
# The whole pydoc set for 6 epochs (global batch 32 as 2 ranks x 2 micro-batches of 8): the correct run ends within 10%
# of docs/gpt.md's 20-epoch bits per byte
TEXT_DEMO = ("ddp", 2, "--model", "gpt", "--dataset", "pydoc", "--batch-size", "8", "--accumulate", "2", "--epochs", "6",
             "--optimizer", "adamw", "--lr", "3e-3")

MUTANTS = [
    Mutant(
        name="accumulation-divide-by-k",
        technique="accumulation",
        file="manual_train/loops/single.py",
        old="            weight = targets / window_targets",
        new="            weight = 1 / cfg.accumulate  # loss / K, as the articles write it",
        says="Each micro-batch's loss divided by K, also in the epoch's last, partial window: that window's gradient "
             "shrinks to its share of a full one, and short micro-batches weigh as much as full ones.",
        report="Lightning #19987",
        kill=KILL, demo=DEMO),
    Mutant(
        name="accumulation-mean-of-micro-means",
        technique="accumulation",
        file="manual_train/loops/single.py",
        old="            weight = targets / window_targets",
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
    Mutant(
        name="accumulation-token-mean-per-micro-batch",
        technique="accumulation",
        file="manual_train/data.py",
        old="        window = self._targets(range(first * m, (first + self.accumulate) * m))",
        new="        window = max(mine, 1) * self.accumulate * n  # each micro-batch's own token mean / K",
        says="On text, each micro-batch's loss averaged over its own tokens and divided by K: a micro-batch of short "
             "samples weighs as much as one of full ones, so the window's gradient is not its tokens' mean.",
        report="huggingface/transformers PR 34191 (the 2024 gradient-accumulation loss fix)",
        kill=TEXT_KILL, env=TEXT_ENV, demo=TEXT_DEMO),
    Mutant(
        name="accumulation-tokens-weighted-by-samples",
        technique="accumulation",
        file="manual_train/data.py",
        old="        self.counts = target_counts(dataset)  # None: every sample has per_sample targets",
        new="        self.counts = None  # every sample weighs as many targets",
        says="On text, micro-batches weighted by their samples, as if every sample had block-size targets: a "
             "document's short last chunk counts as a full one.",
        kill=TEXT_KILL, env=TEXT_ENV, demo=TEXT_DEMO),
    Mutant(
        name="accumulation-labels-read-as-target-counts",
        technique="accumulation",
        file="manual_train/data.py",
        old='    counts = getattr(dataset, "targets_per_sample", None)',
        new='    counts = getattr(dataset, "targets", None)',
        says="Per-sample target counts read from a dataset's `targets`, where torchvision keeps MNIST's labels: "
             "every sample weighs its label (a 0 nothing), and the loss is divided by the labels' sum.",
        kill=("tests/test_text.py::test_a_datasets_labels_are_not_taken_for_target_counts",),
        no_demo="the gallery's datasets (digits, synthetic images, the reverse task, pydoc) keep no `targets`; "
                "torchvision's MNIST does, and the gallery downloads nothing (the test builds an MNIST from IDX files"
                " it writes)."),
]
