"""Evaluation (manual_train/evaluation.py, the DDP loop's all-reduce of its sums, manual_train/data.py's eval_shard).

Distributed evaluation is killed by the uneven-window DDP check, which holds every rank's validation numbers to one
process's (15 validation samples: shards of 8 and 7); evaluate() itself by the test that watches its forward passes
(no graph, eval mode, the mode restored) and the test of exact sums.
"""
from mutants import Mutant

DDP_KILL = ("tests/test_ddp_parity.py::test_uneven_windows_on_two_ranks_equal_one_process",)
DDP_ENV = {"JOB_SCENARIOS": "parity_odd"}
MODE_KILL = ("tests/test_logging_eval.py::test_evaluation_builds_no_graph_and_restores_the_mode",)
UNEVEN = ("ddp", 3, "--dataset", "synthetic", "--synthetic-size", "77", "--batch-size", "5", "--epochs", "4")
# The MLP learns the digits (val acc >= 0.95) in 4 epochs, with dropout 0.1 for the mode bugs to act on in 5
DROPOUT = ("single", 0, "--model", "mlp", "--dropout", "0.1", "--epochs", "5")
PLAIN = ("single", 0, "--model", "mlp", "--epochs", "4", "--eval-batch-size", "200")  # 297 = 200 + a short 97

MUTANTS = [
    Mutant(
        name="evaluation-per-rank-metrics",
        technique="evaluation",
        file="manual_train/loops/ddp.py",
        old="        loss_total, correct, count = all_sum(loss_total, correct, count, device=device)\n"
            "        # <<< DDP\n"
            "        return (loss_total / count).item(), (correct / count).item()",
        new="        # <<< DDP\n"
            "        return (loss_total / count).item(), (correct / count).item()",
        says="Each rank divides its own shard's sums (no all-reduce): rank 0 reports 1/N of the validation set, and "
             "early stopping decides on per-rank numbers, so ranks may stop at different epochs (and hang).",
        kill=DDP_KILL, env=DDP_ENV, demo=UNEVEN),
    Mutant(
        name="evaluation-padded-val-shard",
        technique="evaluation",
        file="manual_train/data.py",
        old="    return dataset if world_size == 1 else Subset(dataset, range(rank, len(dataset), world_size))",
        new="    return dataset if world_size == 1 else Subset(dataset, list(DistributedSampler(dataset, world_size, "
            "rank, shuffle=False)))",
        says="Validation shards from DistributedSampler, which pads a set that N does not divide with repeats of its "
             "first samples: they count twice in the all-reduced metrics.",
        report="Lightning #7929",
        kill=DDP_KILL, env=DDP_ENV, demo=UNEVEN),
    Mutant(
        name="evaluation-no-eval-mode",
        technique="evaluation",
        file="manual_train/evaluation.py",
        old="    model.eval()  # BatchNorm uses running statistics, dropout is off\n",
        new="",
        says="Validation without model.eval(): dropout keeps dropping and BatchNorm normalises with the batch's "
             "statistics (and updates its running ones) while the model is being measured.",
        kill=MODE_KILL, demo=DROPOUT),
    Mutant(
        name="evaluation-under-autograd",
        technique="evaluation",
        file="manual_train/evaluation.py",
        old="    context = torch.inference_mode() if eval_mode == \"inference\" else torch.no_grad()",
        new="    context = torch.inference_mode() if eval_mode == \"inference\" else nullcontext()",
        says="Validation without torch.no_grad(): every forward records a graph that is never used, and the summed "
             "loss keeps each batch's graph alive until the evaluation ends (memory grows with the set).",
        kill=MODE_KILL, demo=PLAIN),
    Mutant(
        name="evaluation-leaves-eval-mode",
        technique="evaluation",
        file="manual_train/evaluation.py",
        old="    model.train(was_training)\n",
        new="",
        says="model.eval() for validation and no model.train() after it: training goes on in eval mode after the "
             "first validation (dropout off, BatchNorm frozen at its running statistics).",
        kill=MODE_KILL, demo=DROPOUT),
    Mutant(
        name="evaluation-last-batch-as-full",
        technique="evaluation",
        file="manual_train/evaluation.py",
        old="            loss_sum += criterion(logits, y, reduction=\"sum\")",
        new="            loss_sum += criterion(logits, y) * loader.batch_size",
        says="Each batch's mean loss times the loader's batch size: the last, short batch counts as a full one, so "
             "the validation loss depends on --eval-batch-size.",
        kill=("tests/test_logging_eval.py::test_validation_metrics_are_exact_sums_not_a_mean_of_batch_means",),
        demo=PLAIN),
]
