"""Pipeline parallelism (manual_train/loops/pipeline.py's marked lines, manual_train/pipeline.py: the split, GPipe
written out, torch.distributed.pipelining's schedules, the tied weight and clipping across stages).

The arithmetic mutants are killed by the 64-true parity of tests/test_pipeline.py: two stages on two ranks against
single.py (the GPT on reverse, 203 samples in batches of 30 cut into 4 uneven micro-batches, accumulation over 2,
clipping at 0.5), its job restricted to the one scenario the killing case reads; the micro-batch weighting already
by one stage in micro-batches against the baseline (no process group beyond a group of one: seconds).
The demos run launch/pipeline.py under torchrun on 2 ranks, one epoch of the reverse task in batches of 30.
"""
from mutants import Mutant

LIB = "manual_train/pipeline.py"
PARITY = "tests/test_pipeline.py::test_two_stages_train_the_baselines_weights"
EXPLICIT = dict(kill=(f"{PARITY}[explicit]",), env={"JOB_SCENARIOS": "explicit"})
DEMO = ("pipeline", 2, "--epochs", "1", "--batch-size", "30", "--grad-clip", "0.5")

MUTANTS = [
    Mutant(
        name="pipeline-tied-grad-not-summed",
        technique="pipeline",
        file="manual_train/loops/pipeline.py",
        old="                raw_model.reduce_tied_grads()  # PIPELINE: the embedding's and the head's gradients, summed "
            "(tied)\n",
        new="",
        says="The tied embedding/head weight's two copies (first and last stage) each step with their own half of the "
             "gradient (the embedding's, the head's) instead of the sum: the copies part after the first step, and "
             "neither is the baseline's.",
        **EXPLICIT, demo=DEMO),
    Mutant(
        name="pipeline-micro-batches-weighted-1-over-m",
        technique="pipeline",
        file=LIB,
        old="                out = share(out, yc, targets) * weight",
        new="                out = F.cross_entropy(out.flatten(0, -2), yc.flatten()) / pipe.m * weight  # each mean / m",
        says="Each micro-batch's mean loss divided by the number of micro-batches: a batch of 30 cut 8+8+7+7 "
             "weights the 7-row micro-batches as much as the 8-row ones (a mean of means, not the batch's mean).",
        kill=("tests/test_pipeline.py::test_one_stage_in_micro_batches_is_the_baseline",), demo=DEMO),
    Mutant(
        name="pipeline-torch-scale-grads-twice",
        technique="pipeline",
        file=LIB,
        old="                                      loss_fn=self._torch_loss if train else None, scale_grads=False)",
        new="                                      loss_fn=self._torch_loss if train else None)  # scale_grads=True",
        says="torch.distributed.pipelining's default scale_grads=True kept while the loss is already each "
             "micro-batch's share: the gradients are divided by m twice, as if the learning rate were lr / m.",
        kill=(f"{PARITY}[torch_gpipe]",), env={"JOB_SCENARIOS": "torch_gpipe"},
        demo=("pipeline", 2, "--impl", "torch", "--epochs", "1", "--batch-size", "30")),
    Mutant(
        name="pipeline-clip-per-stage-norm",
        technique="pipeline",
        file=LIB,
        old="        norm_sq = torch.nn.utils.get_total_norm(counted, 2.0).to(torch.float64) ** 2\n"
            "        dist.all_reduce(norm_sq)\n",
        new="        norm_sq = torch.nn.utils.get_total_norm(counted, 2.0).to(torch.float64) ** 2  # this stage's\n",
        says="clip_grad_norm_ on each stage's own parameters: every stage clips by its own norm, so the stages' "
             "gradients are scaled by different factors and the update is no longer the clipped global gradient.",
        **EXPLICIT, demo=DEMO),
    Mutant(
        name="pipeline-clip-tied-counted-twice",
        technique="pipeline",
        file=LIB,
        old="        counted = [p.grad for p in params if self.first or p is not self.tied_weight()]",
        new="        counted = [p.grad for p in params]",
        says="The global norm summed over every stage's parameters, the tied embedding/head weight on both the first "
             "and the last stage: its gradient counts twice in the norm, so clipping scales too hard.",
        **EXPLICIT, demo=DEMO),
    Mutant(
        name="pipeline-stage-boundary-off-by-one",
        technique="pipeline",
        file=LIB,
        old="        self.stages = nn.ModuleList(Stage(gpt, s * depth, (s + 1) * depth, s == 0, s == n_stages - 1) "
            "for s in ids)",
        new="        self.stages = nn.ModuleList(Stage(gpt, s * depth, (s + 1) * depth - 1, s == 0, s == n_stages - 1) "
            "for s in ids)",
        says="The stage boundaries off by one (blocks lo..hi-2): a block at each boundary belongs to no stage, runs "
             "nowhere and is missing from the gathered checkpoint.",
        **EXPLICIT, demo=DEMO),
]
