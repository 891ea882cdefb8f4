"""Hybrid data + model parallelism (manual_train/loops/hybrid.py's marked lines, manual_train/hybrid.py,
manual_train/hybrid.py's hybrid_dp_mp), both modes: dp-mp (one process) and ddp-mp (one process per device pair)."""
from mutants import Mutant

# 2 ranks x batch 10 on 61 samples (shards 31/30, rank 1's last micro-batch empty) vs one process x 20: a job of 2 ranks
# from tests/jobs.py, only its "uneven" scenario (about 5 s)
UNEVEN = "tests/test_hybrid.py::test_ddp_mp_on_a_set_the_ranks_do_not_divide_equals_one_process[uneven]"
UNEVEN_ENV = {"JOB_SCENARIOS": "uneven"}
TORCHRUN = "tests/test_hybrid.py::test_ddp_mp_two_ranks_equal_one_process_with_twice_the_batch"  # accumulate 2
# The demos learn the reverse task (val acc >= 0.99): ddp-mp on an odd-sized set (16,001 samples, shards 8001/8000)
# for 8 epochs (6: 0.985), dp-mp on the default 16,384 for 5
DEMO_DDP = ("hybrid", 2, "--mode", "ddp-mp", "--synthetic-size", "16001", "--batch-size", "16", "--accumulate", "2",
            "--epochs", "8")
DEMO_DP = ("hybrid", 0, "--mode", "dp-mp", "--impl", "explicit", "--epochs", "5")

MUTANTS = [
    Mutant(
        name="hybrid-articles-decoder-wraps-the-encoder",
        technique="hybrid",
        file="manual_train/hybrid.py",
        old="    decoder = data_parallel(DecoderStage(model.decoder), group_b, group_b[0], impl)",
        new="    decoder = data_parallel(EncoderStage(model.encoder), group_b, group_b[0], impl)",
        says="The source article's `self.decoder = DataParallel(self.encoder, ...)`: the encoder wrapped twice, the "
             "model's decoder never used nor trained (and the encoder's stage cannot take the decoder's inputs).",
        report="the source article's hybrid example (docs/hybrid.md)",
        kill=("tests/test_hybrid.py::test_dp_mp_wrappers_hold_their_own_stage[explicit]",), demo=DEMO_DP),
    Mutant(
        name="hybrid-weight-forgets-ddp-average",
        technique="hybrid",
        file="manual_train/loops/hybrid.py",
        old="            weight = targets * env.world_size / window_targets",
        new="            weight = targets / window_targets",
        says="Each rank's micro-batch weighted by its share of the global window, without the x N that undoes DDP's "
             "average: every step's gradient is 1/N of the window's mean (dp-mp, N = 1, cannot tell).",
        kill=(UNEVEN,), env=UNEVEN_ENV, demo=DEMO_DDP),
    Mutant(
        name="hybrid-no-sync-inverted",
        technique="hybrid",
        file="manual_train/loops/hybrid.py",
        old="            with nullcontext() if window_end else model.no_sync():",
        new="            with model.no_sync() if window_end else nullcontext():",
        says="no_sync() on the window's last micro-step instead of the others: the all-reduce runs before the "
             "window is complete, and the last micro-batch's gradient stays on its rank; the ranks drift apart.",
        kill=(TORCHRUN,), demo=DEMO_DDP),
    Mutant(
        name="hybrid-sampler-pads",
        technique="hybrid",
        file="manual_train/loops/hybrid.py",
        old="env.world_size, env.rank, pad=False)",
        new="env.world_size, env.rank, pad=True)",
        says="DistributedSampler's default padding: on a set the ranks do not divide, a short shard is filled up "
             "with a repeat of another rank's sample, which then trains twice an epoch.",
        report="pytorch/pytorch#25162",
        kill=(UNEVEN,), env=UNEVEN_ENV, demo=DEMO_DDP),
    Mutant(
        name="hybrid-samples-seen-per-rank",
        technique="hybrid",
        file="manual_train/loops/hybrid.py",
        old="            samples_seen += data.window_samples(n_all, micro_batch, 1, micro_step)",
        new="            samples_seen += x.shape[0]",
        says="samples_seen counted as single.py counts it, from this rank's micro-batch: summary.json and the "
             "throughput report 1/N of the samples trained.",
        kill=(UNEVEN,), env=UNEVEN_ENV, demo=DEMO_DDP),
    Mutant(
        name="hybrid-global-batch-per-rank",
        technique="hybrid",
        file="manual_train/loops/hybrid.py",
        old="    global_batch_size = cfg.batch_size * cfg.accumulate * env.world_size",
        new="    global_batch_size = cfg.batch_size * cfg.accumulate",
        says="The global batch without the world size: the banner and summary.json say the per-rank batch, and "
             "--lr-scaling scales the learning rate from it.",
        kill=(UNEVEN,), env=UNEVEN_ENV, demo=DEMO_DDP + ("--lr-scaling", "linear")),
    Mutant(
        name="hybrid-ranks-share-a-gpu",
        technique="hybrid",
        file="manual_train/hybrid.py",
        old="        return [devices[2 * env.local_rank]], [devices[2 * env.local_rank + 1]]",
        new="        return [devices[env.local_rank]], [devices[env.local_rank + 1]]",
        says="Rank r's device pair taken as entries r and r+1 instead of 2r and 2r+1: rank 0's decoder GPU is rank "
             "1's encoder GPU, and the node's last GPUs idle.",
        kill=("tests/test_hybrid.py::test_ddp_mp_each_local_rank_takes_its_own_pair",),
        no_demo="it needs 4 GPUs; on the CPU every rank's pair is cpu,cpu, so both pairings run the same."),
]
