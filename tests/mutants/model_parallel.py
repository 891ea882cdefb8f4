"""Model parallelism (manual_train/loops/model_parallel.py's marked lines, manual_train/model_parallel.py's
split_encoder_decoder, EncoderDecoderSplit and the fill-drain schedule)."""
from mutants import Mutant

PARITY = "tests/test_model_parallel.py::test_mp_loop_equals_baseline[{}]"  # 64-true, two epochs of 205 samples, M = 1 or 3
# The default reverse task (16,384 samples) for 5 epochs: the correct run reaches val acc >= 0.99 (2 epochs: 0.97)
DEMO = ("model_parallel", 0, "--microbatches", "3", "--epochs", "5")
DEMO_M1 = ("model_parallel", 0, "--epochs", "5")  # naive model parallelism, no micro-batches

MUTANTS = [
    Mutant(
        name="model-parallel-mean-of-microbatch-losses",
        technique="model-parallel",
        file="manual_train/loops/model_parallel.py",
        old="                loss = criterion(logits, y)",
        new="                loss = torch.stack([criterion(lc, yc) for lc, yc in zip(logits.chunk(cfg.microbatches), "
            "y.chunk(cfg.microbatches))]).mean()",
        says="Each micro-batch's mean loss, averaged over the micro-batches: with uneven micro-batches (4 + 4 + 2) "
             "the short one's samples weigh more than the others.",
        kill=(PARITY.format(3),), demo=DEMO),
    Mutant(
        name="model-parallel-detached-hop",
        technique="model-parallel",
        file="manual_train/model_parallel.py",
        old="            h = h.to(self.dec_device)  # the only activation",
        new="            h = h.detach().to(self.dec_device)  # the only activation",
        says="The encoder's hidden state sent to the decoder's device detached (`h.detach().to(B)`, or a tensor "
             "rebuilt from its values): backward stops at the hop, and the encoder never trains.",
        kill=(PARITY.format(1),), demo=DEMO_M1),
    Mutant(
        name="model-parallel-pipeline-detached-hop",
        technique="model-parallel",
        file="manual_train/model_parallel.py",
        old="hidden.pop(m).to(self.dec_device))",
        new="hidden.pop(m).detach().to(self.dec_device))",
        says="The pipeline hands each micro-batch's hidden state to the decoder's stage detached: the decoder "
             "trains, the encoder keeps its initial weights.",
        kill=(PARITY.format(3),), demo=DEMO),
    Mutant(
        name="model-parallel-split-copies-the-halves",
        technique="model-parallel",
        file="manual_train/model_parallel.py",
        old="    return EncoderDecoderSplit(model.encoder, model.decoder, enc_device, dec_device, microbatches)",
        new="    import copy  # a split model of its own, from copies of the halves\n"
            "    return EncoderDecoderSplit(copy.deepcopy(model.encoder), copy.deepcopy(model.decoder), enc_device, "
            "dec_device, microbatches)",
        says="The split built from copies of the encoder and decoder: it trains its copies while the optimizer "
             "steps, and the checkpoint saves, the model's own weights, which never get a gradient.",
        kill=("tests/test_model_parallel.py::test_split_equals_one_device[1]",), demo=DEMO),
    Mutant(
        name="model-parallel-no-drain",
        technique="model-parallel",
        file="manual_train/model_parallel.py",
        old="            for t in range(num_microbatches + num_stages - 1)]",
        new="            for t in range(num_microbatches)]",
        says="The fill-drain schedule without its drain (M clocks instead of M + S - 1): the last micro-batches "
             "never reach the later stages.",
        kill=("tests/test_model_parallel.py::test_fill_drain_schedule_and_bubble",), demo=DEMO),
]
