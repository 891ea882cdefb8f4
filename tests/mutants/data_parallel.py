"""Explicit DataParallel (manual_train/loops/data_parallel.py's marked lines, manual_train/data_parallel.py's replicate,
scatter, parallel_apply, gather)."""
from mutants import Mutant

SHORT = "tests/test_data_parallel.py::test_explicit_dp_equals_baseline_on_a_short_set"  # 64-true, 3 uneven chunks, 88 samples
DEMO = ("data_parallel", 0, "--impl", "explicit", "--devices", "cpu,cpu,cpu", "--batch-size", "14", "--model", "mlp",
        "--epochs", "4")  # the correct run learns the digits (val acc >= 0.95), with --lr-scaling linear too
LOSS = "                loss = criterion(logits, y)"

MUTANTS = [
    Mutant(
        name="dataparallel-mean-of-replica-losses",
        technique="dataparallel",
        file="manual_train/loops/data_parallel.py",
        old=LOSS,
        new="                loss = torch.stack([criterion(lc, yc) for lc, yc in zip(logits.chunk(len(devices)), "
            "y.chunk(len(devices)))]).mean()",
        says="Each replica's mean loss, then `.mean()` over the replicas (the loss computed inside the wrapped "
             "module, as people do to spread its memory): with uneven chunks (5 + 5 + 4) the short chunk's "
             "samples weigh more than the others.",
        report="huggingface/transformers examples: `loss = loss.mean()  # mean() to average on multi-gpu parallel "
               "training`",
        kill=(SHORT,), demo=DEMO),
    Mutant(
        name="dataparallel-sum-of-replica-losses",
        technique="dataparallel",
        file="manual_train/loops/data_parallel.py",
        old=LOSS,
        new="                loss = torch.stack([criterion(lc, yc) for lc, yc in zip(logits.chunk(len(devices)), "
            "y.chunk(len(devices)))]).sum()",
        says="The replicas' mean losses summed (`loss.sum()` over the gathered per-device losses): the gradient is "
             "about n times the batch's mean, a learning rate n times too large.",
        kill=(SHORT,), demo=DEMO),
    Mutant(
        name="dataparallel-replica-gradients-not-reduced",
        technique="dataparallel",
        file="manual_train/data_parallel.py",
        old="    return [module for _ in devices]\n",
        new="    import copy  # each other device its own copy of the weights\n"
            "    return [module] + [copy.deepcopy(module) for _ in devices[1:]]\n",
        says="Replicas made with copy.deepcopy and nothing to sum their gradients back into the module on the main "
             "device (torch's replicate is a broadcast whose backward reduce-adds them): only the first chunk's "
             "samples train the weights.",
        kill=(SHORT,), demo=DEMO),
    Mutant(
        name="dataparallel-gather-out-of-order",
        technique="dataparallel",
        file="manual_train/data_parallel.py",
        old="    return torch.cat([o.to(output_device) for o in outputs])",
        new="    return torch.cat([o.to(output_device) for o in reversed(outputs)])  # in the order they finished",
        says="The outputs concatenated in the order the devices finished, not the order of the chunks: each chunk's "
             "logits meet another chunk's targets.",
        kill=(SHORT,), demo=DEMO),
    Mutant(
        name="dataparallel-batch-times-devices",
        technique="dataparallel",
        file="manual_train/loops/data_parallel.py",
        old="    global_batch_size = cfg.batch_size * cfg.accumulate\n",
        new="    global_batch_size = cfg.batch_size * cfg.accumulate * len(devices)  # as DDP: a batch per device\n",
        says="The global batch counted as DDP's, batch x devices: DataParallel splits the batch, it does not "
             "multiply it, so the banner, summary.json and --lr-scaling all see n times the real batch.",
        kill=(SHORT,), demo=DEMO + ("--lr-scaling", "linear")),
]
