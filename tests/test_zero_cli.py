"""ZeroConfig, --help, one-line errors, the loop's diff against the DDP loop, and the pieces that need no process
group: the paper's formulas and the storage accounting (manual_train/memory.py), the FSDP units and the
equal-batch evaluation (manual_train/zero.py, manual_train/sharding.py).

One real subprocess (`python launch/zero.py --impl fairscale --stage 3`: exit status 2, one line, on this CPU) and
one in-process group of one (`python launch/zero.py` at world size 1 equals the DDP loop within 1e-9 in 64-true).
Known-wrong variants (make mutants): zero-eval-padded-with-repeats (the equal-batch evaluation's padding),
zero-fsdp2-optimizer-before-sharding (two sharded steps against torch.optim's, in a group of one).
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
from conftest import REPO, assert_cross_path_64, load_model_state, make_cfg, run_script

from manual_train.cli import run
from manual_train.data import DataInfo
from manual_train.evaluation import evaluate
from manual_train.loops import ddp
from manual_train.loops import zero as zero_loop
from manual_train.memory import storage_bytes, zero_formula_bytes
from manual_train.models import build_model
from manual_train.sharding import SameBatchCount, blocks


# ---------------------------------------------------------------------- the paper's formulas
def test_formulas_reproduce_the_papers_figure_1():
    """Rajbhandari et al. 2019, figure 1: 7.5B parameters, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device."""
    psi, n = 7.5e9, 64
    totals = [zero_formula_bytes(psi, n, stage)["total"] / 1e9 for stage in (0, 1, 2, 3)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    # the expressions themselves: (4+K)psi, 4psi + K psi/N, 2psi + (2+K)psi/N, (4+K)psi/N
    assert totals[1] * 1e9 == pytest.approx(4 * psi + 12 * psi / n)
    assert totals[2] * 1e9 == pytest.approx(2 * psi + 14 * psi / n)
    # fp32 AdamW (4 + 4 + 8 bytes per parameter), this repo's cnn on 4 ranks
    fp32 = zero_formula_bytes(89930, 4, 2, param_bytes=4, grad_bytes=4, state_bytes=8)
    assert fp32 == {"params": 359720, "grads": 89930, "optimizer_state": 179860, "total": 629510}


# ---------------------------------------------------------------------- accounting and FSDP units
def test_storage_bytes_counts_each_buffer_once():
    flat = torch.zeros(100)
    views = [flat[:60].view(6, 10), flat[60:]]  # how OSS and ShardedDDP lay parameters and gradients out
    assert storage_bytes(views) == 400
    assert storage_bytes([torch.zeros(3), torch.zeros(3), None]) == 24  # two storages
    freed = torch.zeros(10)
    freed.untyped_storage().resize_(0)  # what FSDP does to gathered parameters when it reshards
    assert storage_bytes([freed]) == 0


def test_fsdp_units_are_the_blocks_of_each_model():
    digits, reverse = DataInfo("digits", (1, 8, 8), 10), DataInfo("reverse", (2, 8), 12)

    def names(model):
        return [name for _, name in blocks(model)]

    assert names(build_model("cnn", digits)) == ["features", "head"]
    assert names(build_model("mlp", digits)) == ["2", "5", "8"]  # mlp.net's Linear layers (Dropouts between)
    assert names(build_model("seq2seq", reverse)) == ["encoder", "decoder"]
    from manual_train.models import GPT

    assert names(GPT(vocab=64, block_size=8, n_layer=3, n_embd=16, n_head=2)) == ["0", "1", "2"]  # its blocks


def test_padding_with_empty_batches_leaves_the_evaluation_sums_unchanged():
    torch.manual_seed(0)
    model = build_model("cnn", DataInfo("digits", (1, 8, 8), 10))
    ds = torch.utils.data.TensorDataset(torch.randn(10, 1, 8, 8), torch.randint(0, 10, (10,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=4)  # 3 batches
    padded = SameBatchCount(loader, 5)
    assert len(padded) == 5 and [len(x) for x, _ in padded] == [4, 4, 2, 0, 0]
    assert [t.item() for t in evaluate(model, padded, torch.device("cpu"))] == \
           [t.item() for t in evaluate(model, loader, torch.device("cpu"))]


# ---------------------------------------------------------------------- the CLI
def test_help_lists_the_zero_flags_with_their_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        run(zero_loop.train, zero_loop.ZeroConfig, script="zero", doc=zero_loop.__doc__, argv=["--help"],
            **zero_loop.DEFAULTS)
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "torchrun --nproc_per_node=4 launch/zero.py --stage 2" in text
    text = " ".join(text.split())  # argparse wraps the help lines
    assert re.search(r"--stage \{1,2,3\} ZeRO stage: 1 shards [^(]* \(default: 2\)", text)
    assert re.search(r"--impl \{torch,fairscale\} torch \(ZeroRedundancyOptimizer, FSDP2[^)]*\) or fairscale "
                     r".* \(default: torch\)", text)
    assert "--reduce-buffer-size" in text and "--backend" in text  # and the DDP loop's flags
    assert "--batch-size BATCH_SIZE samples per micro-batch, per process (default: 8)" in text


# (argv, the one error line's start)
BAD_INPUT = [
    (["--impl", "fairscale", "--stage", "3"],
     "error: --stage: 3 with --impl fairscale is FullyShardedDataParallel, which needs CUDA; on the CPU use --impl "
     "torch (FSDP2, its successor) (allowed: --impl torch, or --stage 1, 2)"),
    # apex's O2 is its own lesson (launch/apex_o2.py): refused by the base Config, as in every other loop
    (["--precision", "16-o2"], "error: --precision: 16-o2 is apex's O2, its own lesson: run launch/apex_o2.py"),
    (["--impl", "fairscale", "--stage", "1", "--precision", "apex-o2"],
     "error: --precision: apex-o2 is apex's O2, its own lesson: run launch/apex_o2.py"),
    (["--impl", "fairscale", "--stage", "2", "--precision", "16-mixed"],
     "error: --precision: 16-mixed with fairscale stage 2 needs fairscale's ShardedGradScaler"),
    # a fused kernel refuses the sharded scalers' 1-element found_inf (the default falls back to foreach there)
    (["--stage", "3", "--precision", "16-mixed", "--optimizer", "adamw", "--optimizer-impl", "fused"],
     "error: --optimizer-impl: fused optimizers do not take ZeRO's sharded loss scaler's found_inf under 16-mixed"),
    (["--reduce-buffer-size", "0"], "error: --reduce-buffer-size: is ShardedDataParallel's, used by --impl "
                                    "fairscale --stage 2 only"),
    (["--impl", "fairscale", "--stage", "2", "--reduce-buffer-size", "-1"],
     "error: --reduce-buffer-size: -1 is out of range (allowed: >= 0)"),
    (["--stage", "0"], "error: --stage: invalid choice: 0 (allowed: 1, 2, 3)"),
    (["--impl", "deepspeed"], "error: --impl: invalid choice: 'deepspeed' (allowed: 'torch', 'fairscale')"),
    (["--sync-bn"], "error: --sync-bn: SyncBatchNorm runs on CUDA devices only"),  # the DDP loop's checks hold
]


def _run_bad(argv, out):
    try:
        return run(zero_loop.train, zero_loop.ZeroConfig, script="zero", argv=argv + ["--out-dir", str(out)],
                   **zero_loop.DEFAULTS)
    except SystemExit as e:  # argparse's own errors exit from inside the parser
        return e.code


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusals")
@pytest.mark.parametrize("argv,line", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(argv, line, capsys, tmp_path, lone_process):
    out = tmp_path / "run"
    assert _run_bad(argv, out) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err
    assert not out.exists(), "validation runs before any directory is created"


def test_without_fairscale_the_error_says_how_to_install_it(capsys, tmp_path, lone_process, monkeypatch):
    """fairscale is the optional extra `zero`: hide it (None in sys.modules makes `import fairscale` fail)."""
    monkeypatch.setitem(sys.modules, "fairscale", None)
    assert _run_bad(["--impl", "fairscale", "--stage", "1"], tmp_path / "run") == 2
    assert capsys.readouterr().err == ("error: --impl: fairscale is not installed (pip install -e '.[zero]') "
                                       "(allowed: torch)\n")
    assert make_cfg(tmp_path, zero_loop.ZeroConfig, stage=3).impl == "torch"  # the default needs no fairscale


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_fairscale_stage_3_on_the_cpu_from_the_launch_script_is_one_line_and_exit_2(tmp_path):
    """A real `python launch/zero.py --impl fairscale --stage 3`: status 2, one line on stderr, no traceback."""
    proc = run_script("zero", "--impl", "fairscale", "--stage", "3", "--out-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [BAD_INPUT[0][1]], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what happens without CUDA")
def test_why_fairscale_is_refused_on_the_cpu(lone_process, recwarn):
    """The two refusals above, justified: fairscale's FSDP fails in its first forward on the CPU (it uses CUDA
    streams unconditionally), and its ShardedGradScaler quietly disables itself (no loss scaling at all)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel
    from fairscale.optim.grad_scaler import ShardedGradScaler

    from manual_train.distributed import read_env, setup, teardown

    assert not ShardedGradScaler().is_enabled()
    assert any("CUDA is not available.  Disabling" in str(w.message) for w in recwarn)
    setup(read_env(), torch.device("cpu"), "gloo", 60)
    try:
        model = FullyShardedDataParallel(torch.nn.Linear(4, 2), compute_device=torch.device("cpu"))
        with pytest.raises(KeyError, match="all_gather"):
            model(torch.randn(3, 4))
    finally:
        teardown()


# ---------------------------------------------------------------------- a group of one
def test_plain_python_is_a_group_of_one_equal_to_the_ddp_loop(tmp_path, lone_process):
    """The defaults (--impl torch --stage 2: FSDP2) at world size 1: the DDP loop's weights within 1e-9 in 64-true.
    Not fp32 bit for bit: FSDP2's parameters are views into its all-gather buffer and DDP's are not, and the
    kernels picked for other layouts round differently on other CPUs (2^-27 apart with AVX2 kernels)."""
    flags = dict(max_steps=10, batch_size=32, log_every=5, precision="64-true")
    summary = zero_loop.train(make_cfg(tmp_path / "zero", zero_loop.ZeroConfig, **flags))
    ddp.train(make_cfg(tmp_path / "ddp", ddp.DDPConfig, **flags))
    assert not torch.distributed.is_initialized(), "the group was left (destroy_process_group)"
    assert summary["world_size"] == 1 and summary["script"] == "zero" and summary["zero_stage"] == 2
    assert_cross_path_64(load_model_state(tmp_path / "zero" / "run"), load_model_state(tmp_path / "ddp" / "run"),
                         "FSDP2 (group of one) vs the DDP loop")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shards_optimizer_steps_the_parameters_forward_uses(stage, lone_process):
    """shard() in a group of one, 64-true: two AdamW steps of the sharded model by the optimizer shard() rebuilt equal
    two steps of an unsharded copy by torch.optim's AdamW, within 1e-9. No checkpoint is written, so an optimizer
    built over the parameters fully_shard replaced fails here by an assertion (the model never moves), not by an
    error in the first save (make mutants: zero-fsdp2-optimizer-before-sharding)."""
    import copy

    from manual_train.distributed import read_env, setup, teardown
    from manual_train.models import loss_fn
    from manual_train.optim import build_optimizer
    from manual_train.zero import ZeroConfig, shard

    cfg, cpu = ZeroConfig(optimizer="adamw", impl="torch", stage=stage, precision="64-true"), torch.device("cpu")
    torch.manual_seed(0)
    raw = build_model("cnn", DataInfo("digits", (1, 8, 8), 10)).double()
    reference = copy.deepcopy(raw)
    batches = [(torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))) for _ in range(2)]
    setup(read_env(), cpu, "gloo", 60)
    try:
        sharded = shard(raw, build_optimizer(cfg, raw.parameters(), 1e-2), cfg, cpu)
        plain = build_optimizer(cfg, reference.parameters(), 1e-2)
        for x, y in batches:
            for model, optimizer in ((sharded.model, sharded.optimizer), (reference, plain)):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()
        assert_cross_path_64(sharded.model_state_dict(), reference.state_dict(), f"stage {stage}: two steps")
    finally:
        teardown()


def test_launch_zero_mirrors_launch_ddp():
    ddp_launch = (REPO / "launch/ddp.py").read_text()
    zero_launch = (REPO / "launch/zero.py").read_text()
    body = zero_launch.split('"""', 2)[2]  # after the docstring
    assert body == ddp_launch.split('"""', 2)[2].replace("ddp.DDPConfig", "zero.ZeroConfig").replace(
        "ddp", "zero")
    assert zero_loop.DEFAULTS == ddp.DEFAULTS  # the DDP loop's per-rank batch of 8
