"""DDPConfig, --help, one-line errors, the sampler and the loop's diff, in this process (no new processes).

`python launch/ddp.py` is a process group of one: the world-size-1 test runs that code path here (the group
joined and left in this process) and finds it equal to the baseline loop within 1e-9 in 64-true.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import assert_cross_path_64, load_model_state, make_cfg

from manual_train import data
from manual_train.cli import run
from manual_train.config import Config
from manual_train.loops import ddp, single



def test_plain_python_is_a_group_of_one_equal_to_the_baseline(tmp_path, lone_process):
    flags = dict(max_steps=10, batch_size=32, log_every=5, precision="64-true")  # two loops: 64-true, not fp32 bits
    summary = ddp.train(make_cfg(tmp_path / "ddp", ddp.DDPConfig, **flags))
    single.train(make_cfg(tmp_path / "single", Config, **flags))
    assert not torch.distributed.is_initialized(), "the group was left (destroy_process_group)"
    assert summary["world_size"] == 1 and summary["global_batch_size"] == 32 and summary["script"] == "ddp"
    assert_cross_path_64(load_model_state(tmp_path / "ddp" / "run"), load_model_state(tmp_path / "single" / "run"),
                         "the DDP loop (group of one) vs single.py")


def test_help_lists_the_ddp_flags_and_the_torchrun_commands(capsys):
    with pytest.raises(SystemExit) as e:
        run(ddp.train, ddp.DDPConfig, script="ddp", doc=ddp.__doc__, argv=["--help"], **ddp.DEFAULTS)
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--backend", "--dist-timeout-s", "--sync-bn"):
        assert flag in text
    assert "FOR TESTING" not in text and "--fail-at-step" not in text  # fault injection lives in tests/faults.py
    assert "torchrun --nproc_per_node=4 launch/ddp.py" in text
    # the multi-node and Slurm recipes live in docs/ddp.md (the lesson's docstring stays short)
    assert "docs/ddp.md" in text and "srun" not in text and "--rdzv-endpoint" not in text
    ddp_md = (Path(__file__).resolve().parents[1] / "docs" / "ddp.md").read_text()
    assert "--rdzv-endpoint" in ddp_md and "does not honour `--node-rank`" in ddp_md
    assert re.search(r"--batch-size BATCH_SIZE\s+samples per micro-batch, per process \(default: 8\)", text)


# (argv, the one error line's start)
BAD_INPUT = [
    (["--sync-bn"], "error: --sync-bn: SyncBatchNorm runs on CUDA devices only"),
    (["--backend", "nccl"], "error: --backend: nccl needs CUDA devices"),
    (["--backend", "mpi"], "error: --backend: invalid choice: 'mpi' (allowed: 'auto', 'nccl', 'gloo')"),
    (["--dist-timeout-s", "0"], "error: --dist-timeout-s: 0.0 is out of range (allowed: > 0 and <= 1e+07)"),
    (["--device", "cuda"], "error: --device: cuda requested but CUDA is not available"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusals")
@pytest.mark.parametrize("argv,line", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(argv, line, capsys, tmp_path, lone_process):
    out = tmp_path / "run"
    try:
        status = run(ddp.train, ddp.DDPConfig, script="ddp", argv=argv + ["--out-dir", str(out)], **ddp.DEFAULTS)
    except SystemExit as e:  # argparse's own errors exit from inside the parser
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err
    assert not out.exists()


def test_sampler_gives_each_epoch_a_new_order_split_disjointly_over_the_ranks():
    train_ds, _ = data.load_digits_split()
    for world_size in (1, 2, 4):
        orders = []
        for epoch in (0, 1):
            shards = []
            for rank in range(world_size):
                sampler = data.train_sampler(train_ds, seed=0, world_size=world_size, rank=rank)
                sampler.set_epoch(epoch)
                shards.append(list(sampler))
            assert sorted(i for s in shards for i in s) == list(range(1500))  # disjoint, complete, no padding
            # rank r's k-th sample is the single process's (k*N + r)-th: the N ranks' k-th batches of b are
            # together the single process's k-th batch of N*b
            orders.append([shards[k % world_size][k // world_size] for k in range(1500)])
        assert orders[0] != orders[1], "set_epoch changes the permutation"
        single_order = data.train_sampler(train_ds, seed=0)
        single_order.set_epoch(1)
        assert orders[1] == list(single_order)


