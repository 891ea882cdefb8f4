"""Each flag's VALUE is observed: the flags that the generated flag mutants (tests/flag_mutants.py, `make
mutants-flags`) found unchecked, each with a test that fails when the code ignores what the user asked for.

Cheap by design (a one- or two-step mlp run in this process, or a tool's main() with its expensive part replaced by a
recorder): these run in `make test`.
"""
from __future__ import annotations

import csv
import json
import math
import sys
import types

import pytest
import torch
from conftest import as_torchrun_rank, load_model_state, make_cfg

from manual_train import data
from manual_train.config import config_from
from manual_train.loops import single
from manual_train.metrics import model_summary
from manual_train.models import DataInfo, build_model

TINY = dict(model="mlp", limit_val_batches="1", eval_batch_size=64)


def train_rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r["split"] == "train"]


def loaders_built(monkeypatch) -> list:
    """The DataLoaders data.build_loader returns from now on (training's, evaluation's, the evaluate tool's)."""
    loaders = []
    real = data.build_loader

    def recording(*args, **kwargs):
        loaders.append(real(*args, **kwargs))
        return loaders[-1]

    monkeypatch.setattr(data, "build_loader", recording)
    return loaders


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-step mlp run's last.pt (for the evaluate tests)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    single.train(make_cfg(tmp, max_steps=1, **TINY))
    return tmp / "run" / "last.pt"


# ---------------------------------------------------------------------- training flags
def test_summary_depth_sets_the_banners_layer_table(tmp_path, capsys):
    """--summary-depth 2 prints the layers inside the mlp's Sequential; 0 prints no table at all."""
    single.train(make_cfg(tmp_path / "a", max_steps=1, summary_depth=2, **TINY))
    deep = capsys.readouterr().out
    table = model_summary(build_model("mlp", DataInfo("digits", (1, 8, 8), 10)), 2)
    assert table.splitlines()[2] in deep and "net.1" in table  # a depth-2 row, as model_summary writes it
    single.train(make_cfg(tmp_path / "b", max_steps=1, summary_depth=0, **TINY))
    assert "total parameters" not in capsys.readouterr().out


def test_no_train_acc_logs_nan_and_the_default_logs_the_accuracy(tmp_path):
    single.train(make_cfg(tmp_path / "off", max_steps=2, log_every=1, train_acc=False, **TINY))
    single.train(make_cfg(tmp_path / "on", max_steps=2, log_every=1, **TINY))
    off, on = train_rows(tmp_path / "off" / "run"), train_rows(tmp_path / "on" / "run")
    assert len(off) == len(on) == 2
    assert all(math.isnan(float(r["acc"])) for r in off)
    assert all(0 <= float(r["acc"]) <= 1 for r in on)


def test_warmup_steps_ramp_the_logged_lr_linearly(tmp_path):
    """--warmup-steps 4 --schedule constant: the LR of steps 1..4 (logged after each step: the next step's) is
    lr * 2/4, 3/4, 4/4, 4/4."""
    single.train(make_cfg(tmp_path, max_steps=4, log_every=1, warmup_steps=4, schedule="constant", lr=0.1, **TINY))
    lrs = [float(r["lr"]) for r in train_rows(tmp_path / "run")]
    assert lrs == pytest.approx([0.05, 0.075, 0.1, 0.1])


def test_weight_decay_reaches_the_optimizer_and_the_weights(tmp_path):
    single.train(make_cfg(tmp_path / "wd", max_steps=2, weight_decay=0.5, optimizer="adamw", **TINY))
    single.train(make_cfg(tmp_path / "none", max_steps=2, optimizer="adamw", **TINY))
    saved = torch.load(tmp_path / "wd" / "run" / "last.pt", map_location="cpu", weights_only=True)
    assert {g["weight_decay"] for g in saved["optimizer"]["param_groups"]} == {0.5}
    a, b = load_model_state(tmp_path / "wd" / "run"), load_model_state(tmp_path / "none" / "run")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # decoupled decay moved the weights


def test_tensorboard_writes_the_rows_as_scalars(tmp_path, monkeypatch):
    """--tensorboard: every metrics.csv row also goes to a SummaryWriter (recorded here; the tensorboard package
    itself is an optional extra that `make test` does not install)."""
    written = []

    class Writer:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            written.append((tag, step))

        def close(self):
            written.append(("closed", None))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    single.train(make_cfg(tmp_path, max_steps=2, log_every=1, tensorboard=True, **TINY))
    assert written, "--tensorboard: no SummaryWriter was made"
    assert written[0] == ("dir", str(tmp_path / "run" / "tb"))
    assert ("train/loss", 1) in written and ("train/loss", 2) in written and ("val/loss", 2) in written
    assert written[-1] == ("closed", None)


# ---------------------------------------------------------------------- the tools' flags
def test_evaluate_num_workers_reaches_the_loader(checkpoint, monkeypatch, capsys):
    from manual_train import evaluate

    loaders = loaders_built(monkeypatch)
    assert evaluate.main(["--checkpoint", str(checkpoint), "--num-workers", "2", "--json"]) == 0
    assert [loader.num_workers for loader in loaders] == [2]
    assert json.loads(capsys.readouterr().out)["samples"] == 297  # the whole digits validation split


def test_bench_list_lists_and_runs_nothing(capsys):
    """--list prints both suites' entries and exits 0 before anything runs (here an unknown --only would refuse)."""
    from manual_train.bench.cli import main

    assert main(["--list", "--only", "no-such-entry"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in out} == {"cpu", "gpu"}


def test_parity_no_floor_skips_the_floor_run(tmp_path, monkeypatch, capsys):
    """--no-floor: run_pair is asked for no third (noise floor) run; without it, it is. --quiet reaches it too."""
    from manual_train import parity

    asked = []

    def run_pair(a, b, work, *, quiet, floor):
        asked.append((floor, quiet))
        raise parity.BadInput("recorded")  # stop here: the runs themselves are tests/test_parity_tool.py's

    monkeypatch.setattr(parity, "run_pair", run_pair)
    for extra in (["--no-floor", "--quiet"], []):
        assert parity.main(["--a", "python launch/single.py", "--b", "python launch/single.py",
                            "--work-dir", str(tmp_path), *extra]) == 2
    assert asked == [(False, True), (True, False)]  # --quiet: run_pair prints no progress lines


def test_parity_trace_floor_is_the_floor_compared_against(tmp_path, monkeypatch, capsys):
    from manual_train import parity

    monkeypatch.setattr(parity, "load_trace", lambda path, flag: {"meta": {}, "path": path})
    monkeypatch.setattr(parity, "refusal", lambda a, b: None)
    floors = []

    def compare(ta, tb, tol, floor):
        floors.append(floor and floor["path"])
        return 0, "compared"

    monkeypatch.setattr(parity, "compare", compare)
    assert parity.main(["--trace-a", "A", "--trace-b", "B", "--trace-floor", "F"]) == 0
    assert parity.main(["--trace-a", "A", "--trace-b", "B"]) == 0
    assert floors == ["F", None]


def test_lr_scaling_scales_lr_by_the_global_over_the_base_batch(tmp_path):
    """--lr 0.1 tuned at --base-batch-size 16, trained at 32: linear doubles it, sqrt multiplies it by sqrt(2)."""
    for rule, factor in (("linear", 2.0), ("sqrt", math.sqrt(2))):
        single.train(make_cfg(tmp_path / rule, max_steps=1, log_every=1, schedule="constant", lr=0.1, batch_size=32,
                              base_batch_size=16, lr_scaling=rule, **TINY))
        assert [float(r["lr"]) for r in train_rows(tmp_path / rule / "run")] == pytest.approx([0.1 * factor])


def recorded_during_training(monkeypatch, cfg, probe) -> tuple[list, list]:
    """single.train(cfg) with probe() recorded at each training loss call and at each evaluation loss call."""
    train, val = [], []
    real = single.loss_fn

    def recording(logits, y, **kw):
        (val if kw.get("reduction") == "sum" else train).append(probe())  # evaluation sums; training: the mean
        return real(logits, y, **kw)

    monkeypatch.setattr(single, "loss_fn", recording)
    single.train(cfg)
    return train, val


def test_detect_anomaly_is_on_while_training_and_off_by_default(tmp_path, monkeypatch):
    on, _ = recorded_during_training(monkeypatch, make_cfg(tmp_path / "a", max_steps=1, detect_anomaly=True, **TINY),
                                     torch.is_anomaly_enabled)
    off, _ = recorded_during_training(monkeypatch, make_cfg(tmp_path / "b", max_steps=1, **TINY),
                                      torch.is_anomaly_enabled)
    assert on[0] and not off[0], (on, off)  # the first training step's forward, with anomaly detection on / off


def test_deterministic_turns_on_torchs_deterministic_algorithms(tmp_path, monkeypatch):
    try:
        off, _ = recorded_during_training(monkeypatch, make_cfg(tmp_path / "b", max_steps=1, **TINY),
                                          torch.are_deterministic_algorithms_enabled)
        on, _ = recorded_during_training(monkeypatch, make_cfg(tmp_path / "a", max_steps=1, deterministic=True,
                                                               **TINY), torch.are_deterministic_algorithms_enabled)
    finally:
        torch.use_deterministic_algorithms(False)
    assert on[0] and not off[0], (on, off)  # the first training step's forward


def test_eval_mode_inference_evaluates_under_inference_mode(tmp_path, monkeypatch):
    _, inference = recorded_during_training(monkeypatch, make_cfg(tmp_path / "a", max_steps=1, eval_mode="inference",
                                                                  **TINY), torch.is_inference_mode_enabled)
    _, no_grad = recorded_during_training(monkeypatch, make_cfg(tmp_path / "b", max_steps=1, **TINY),
                                          torch.is_inference_mode_enabled)
    assert inference[0] and not no_grad[0], (inference, no_grad)  # the first evaluation's batch


def test_loss_scale_flags_set_the_scalers_start_and_growth(tmp_path):
    """16-mixed, --loss-scale-init 1024 --loss-scale-growth-interval 1: the scale doubles after each clean step."""
    single.train(make_cfg(tmp_path, max_steps=2, precision="16-mixed", loss_scale_init=1024,
                          loss_scale_growth_interval=1, **TINY))
    scaler = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)["scaler"]["scaler"]
    assert scaler["growth_interval"] == 1
    assert scaler["scale"] == 4096.0  # 1024, doubled after each of the two steps (no overflow at this scale)


def test_loader_flags_reach_the_dataloader(tmp_path, monkeypatch):
    """--num-workers 2 --persistent-workers --prefetch-factor 3, --batch-size 16 and --eval-batch-size 100: the
    training and validation loaders have them."""
    loaders = loaders_built(monkeypatch)
    flags = dict(TINY, eval_batch_size=100)
    single.train(make_cfg(tmp_path, max_steps=1, num_workers=2, persistent_workers=True, prefetch_factor=3,
                          batch_size=16, **flags))
    assert [(d.num_workers, d.persistent_workers, d.prefetch_factor) for d in loaders] == [(2, True, 3)] * 2
    assert [d.batch_size for d in loaders] == [16, 100]


def test_limit_val_batches_validates_on_that_many_batches(tmp_path, capsys):
    """--limit-val-batches 2 of --eval-batch-size 64: 128 validation samples; without it all 297."""
    single.train(make_cfg(tmp_path / "a", max_steps=1, model="mlp", eval_batch_size=64, limit_val_batches="2"))
    assert "(1500 train / 128 val)" in capsys.readouterr().out
    single.train(make_cfg(tmp_path / "b", max_steps=1, model="mlp", eval_batch_size=64))
    assert "(1500 train / 297 val)" in capsys.readouterr().out


def test_progress_flag_decides_the_bar(tmp_path, monkeypatch):
    """--no-progress asks for no bar; the default asks for one (tqdm shows it on a terminal: not here)."""
    from manual_train import run

    asked = []
    real = run.progress_bar
    monkeypatch.setattr(run, "progress_bar", lambda total, initial, enabled: asked.append(enabled) or
                        real(total, initial, enabled))
    single.train(make_cfg(tmp_path / "off", max_steps=1, **TINY))  # make_cfg: progress=False
    single.train(make_cfg(tmp_path / "on", max_steps=1, progress=True, **TINY))
    assert asked == [False, True]


def test_trace_dir_gets_the_runs_trace(tmp_path):
    single.train(make_cfg(tmp_path, max_steps=2, trace_dir=str(tmp_path / "trace"), **TINY))
    assert sorted(p.name for p in (tmp_path / "trace").iterdir())  # the trace python -m manual_train.parity reads


def test_save_on_signal_catches_the_signals_named(tmp_path, monkeypatch):
    """--save-on-signal USR2: while training, SIGUSR2 has the run's handler (the default TERM,USR1 leaves it alone)."""
    import signal

    def usr2_caught():
        return signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None)

    asked, _ = recorded_during_training(monkeypatch, make_cfg(tmp_path / "a", max_steps=1, save_on_signal="USR2",
                                                              **TINY), usr2_caught)
    default, _ = recorded_during_training(monkeypatch, make_cfg(tmp_path / "b", max_steps=1, **TINY), usr2_caught)
    assert asked[0] and not default[0], (asked, default)


def test_loss_scale_max_caps_the_o2_scale(tmp_path):
    """launch/apex_o2.py --precision 16-o2: the scale starts at 1024 and doubles after each clean step, up to
    --loss-scale-max 2048."""
    from manual_train.apex_o2 import ApexO2Config
    from manual_train.loops import apex_o2

    apex_o2.train(make_cfg(tmp_path, ApexO2Config, max_steps=3, precision="16-o2", loss_scale_init=1024,
                           loss_scale_max=2048, loss_scale_growth_interval=1, **TINY))
    saved = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)["scaler"]
    assert saved["scaler"]["scale"] == 2048.0, saved  # uncapped: 1024 * 2**3 = 8192


def test_parity_tol_is_the_bound_compared_with(monkeypatch, capsys):
    from manual_train import parity

    monkeypatch.setattr(parity, "load_trace", lambda path, flag: {"meta": {}, "path": path})
    monkeypatch.setattr(parity, "refusal", lambda a, b: None)
    tols = []
    monkeypatch.setattr(parity, "compare", lambda ta, tb, tol, floor: tols.append(tol) or (0, "compared"))
    assert parity.main(["--trace-a", "A", "--trace-b", "B", "--tol", "0.001"]) == 0
    assert tols == [0.001]


def test_find_batch_size_search_flags(monkeypatch, capsys):
    """The CPU search with each trial's peak faked as 1000 bytes per sample (the trials themselves are
    tests/test_batch_size.py's): --start is the first size tried, --max-batch-size caps the answer, and
    --memory-budget-bytes decides it."""
    from manual_train import find_batch_size

    tried = []

    def trial(cmd, **kwargs):
        size = int(next(a for a in cmd if a.startswith("--trial=")).split("=")[1])
        tried.append(size)
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({"batch_size": size, "peak_bytes": 1000 * size}),
                                     stderr="")

    monkeypatch.setattr(find_batch_size.subprocess, "run", trial)
    base = ["--device", "cpu", "--memory-budget-bytes", "30500"]
    assert find_batch_size.main([*base, "--start", "4", "--max-batch-size", "20"]) == 0
    assert tried[0] == 4 and capsys.readouterr().out.strip() == "largest batch size that fits: 20 (the limit)"
    assert find_batch_size.main([*base, "--max-batch-size", "40"]) == 0
    assert capsys.readouterr().out.strip() == "largest batch size that fits: 30"


def test_find_batch_size_trial_runs_one_trial_only(monkeypatch, capsys):
    from manual_train import find_batch_size

    monkeypatch.setattr(find_batch_size, "_cpu_trial", lambda cfg: 123 * cfg.trial)
    monkeypatch.setattr(find_batch_size.subprocess, "run", lambda *a, **k: pytest.fail("--trial ran a search"))
    assert find_batch_size.main(["--device", "cpu", "--trial", "3"]) == 0
    assert json.loads(capsys.readouterr().out) == {"batch_size": 3, "peak_bytes": 369}


def test_max_steps_stops_the_run_there(tmp_path):
    """--max-steps 3 over 2 epochs of 5 batches: 3 optimizer steps, not 10."""
    summary = single.train(make_cfg(tmp_path, max_steps=3, epochs=2, limit_train_batches="5", **TINY))
    assert summary["optimizer_steps"] == 3


def test_model_is_the_one_trained(tmp_path):
    """--model mlp: the checkpoint holds the mlp's weights (the default is the cnn)."""
    single.train(make_cfg(tmp_path, max_steps=1, **TINY))
    assert load_model_state(tmp_path / "run").keys() == build_model("mlp", DataInfo("digits", (1, 8, 8), 10)
                                                                    ).state_dict().keys()


def test_eval_every_evaluates_every_n_epochs_and_after_the_last(tmp_path):
    single.train(make_cfg(tmp_path, epochs=3, eval_every=2, limit_train_batches="2", **TINY))
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert [r["epoch"] for r in csv.DictReader(f) if r["split"] == "val"] == ["2", "3"]


def test_download_is_passed_to_torchvision(tmp_path, monkeypatch):
    """--download: torchvision is asked to download (here it cannot: its error becomes the --download line)."""
    import torchvision

    from manual_train.errors import UsageError

    asked = []

    def no_network(root, train, download, transform):
        asked.append(download)
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets, "MNIST", no_network)
    with pytest.raises(UsageError, match="--download: could not download mnist"):
        data.build_datasets(make_cfg(tmp_path, dataset="mnist", data_root=str(tmp_path), download=True, **TINY))
    assert asked == [True]


# ---------------------------------------------------------------------- DDP's knobs, on a group of one (gloo)
def ddp_as_built(tmp_path, monkeypatch, **flags) -> dict:
    """launch/ddp.py's loop as a group of one, in this process: the DDP module's settings and the comm hook
    registered on it, as the loop built them."""
    from manual_train.distributed import DDPConfig
    from manual_train.loops import ddp

    built = {}
    real = ddp.with_comm_hook

    def recording(model, cfg):
        def register(state, hook):  # state: distributed.CommCount, which wraps torch's hook and its state
            built["hook"] = (state.hook.__name__, getattr(state.state, "matrix_approximation_rank", None),
                             getattr(state.state, "start_powerSGD_iter", None))
            return type(model).register_comm_hook(model, state, hook)

        model.register_comm_hook = register
        built.update(gradient_as_bucket_view=model.gradient_as_bucket_view, static_graph=model.static_graph,
                     find_unused_parameters=model.find_unused_parameters, bucket_bytes_cap=model.bucket_bytes_cap)
        return real(model, cfg)

    monkeypatch.setattr(ddp, "with_comm_hook", recording)
    ddp.train(make_cfg(tmp_path, DDPConfig, max_steps=1, **TINY, **flags))
    return built


def test_ddp_knobs_reach_the_ddp_module(tmp_path, monkeypatch, lone_process):
    built = ddp_as_built(tmp_path / "a", monkeypatch, gradient_as_bucket_view=True, static_graph=True,
                         find_unused_parameters=True, bucket_cap_mb=1, comm_hook="fp16")
    assert built == dict(gradient_as_bucket_view=True, static_graph=True, find_unused_parameters=True,
                         bucket_bytes_cap=2 ** 20, hook=("fp16_compress_hook", None, None))


def test_powersgd_rank_and_start_reach_the_hooks_state(tmp_path, monkeypatch, lone_process):
    built = ddp_as_built(tmp_path, monkeypatch, comm_hook="powersgd", powersgd_rank=2, powersgd_start=3)
    assert built["hook"] == ("powerSGD_hook", 2, 3)


def test_tune_flags_reach_the_tuners_job(tmp_path):
    """python -m manual_train.tune's own flags, as prepare() hands them to the search and the report (the search
    itself, on a fake clock: tests/test_tune.py)."""
    from manual_train.tune.cli import prepare

    job = prepare(["--budget-s", "30", "--out", str(tmp_path / "t"), "--allow-changes", "--rounds", "3",
                   "--trial-s", "0.5", "--levers", "loader", "--no-progress", "--model", "mlp"])
    assert (job.flags.budget_s, job.flags.allow_changes, job.flags.rounds, job.flags.trial_s, job.flags.levers,
            job.flags.progress) == (30.0, True, 3, 0.5, "loader", False)
    assert job.out == tmp_path / "t" and job.cfg.model == "mlp"


# ---------------------------------------------------------------------- the end of a run: --stop-at, --restore-best
def test_stop_at_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path):
    """--stop-at 100 --monitor val_loss: the first evaluation (epoch 1) is below it, so 1 of 3 epochs runs."""
    summary = single.train(make_cfg(tmp_path, epochs=3, limit_train_batches="2", monitor="val_loss", stop_at=100,
                                    **TINY))
    assert (summary["epochs_run"], summary["optimizer_steps"], summary["stopped_early"]) == (1, 2, True), summary
    assert summary["stop_reason"].startswith("target reached: val_loss")


def test_restore_best_ends_with_the_best_epochs_weights(tmp_path):
    """--restore-best: epoch 1 is the best (nothing improves val_acc by 0.9 after it), so the run ends with epoch 1's
    weights and val_loss, not epoch 2's."""
    summary = single.train(make_cfg(tmp_path, epochs=2, limit_train_batches="3", monitor="val_acc",
                                    early_stop_min_delta=0.9, restore_best=True, **TINY))
    with open(tmp_path / "run" / "metrics.csv") as f:
        val_losses = [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "val"]
    assert len(val_losses) == 2 and val_losses[0] != val_losses[1]  # two evaluations, two different weights
    assert summary["best_epoch"] == 1 and summary["final_val_loss"] == pytest.approx(val_losses[0], rel=1e-6)


# ---------------------------------------------------------------------- python -m manual_train.evaluate
def test_evaluate_batch_size_and_mode_reach_the_evaluation(checkpoint, monkeypatch, capsys):
    """--eval-batch-size 100 (the checkpoint's: 64) batches the loader; --eval-mode no_grad (default inference)
    evaluates outside inference mode."""
    from manual_train import evaluate

    loaders, modes = loaders_built(monkeypatch), []
    real = evaluate.loss_fn
    monkeypatch.setattr(evaluate, "loss_fn", lambda *a, **kw: modes.append(torch.is_inference_mode_enabled()) or
                        real(*a, **kw))
    assert evaluate.main(["--checkpoint", str(checkpoint), "--eval-batch-size", "100", "--eval-mode", "no_grad",
                          "--json"]) == 0
    assert [loader.batch_size for loader in loaders] == [100] and len(modes) == 3  # 297 samples: 100 + 100 + 97
    assert not any(modes), modes
    assert evaluate.main(["--checkpoint", str(checkpoint), "--json"]) == 0
    assert loaders[-1].batch_size == 64 and modes[-1], modes  # the defaults: the checkpoint's, inference mode


def test_evaluate_data_root_is_where_the_data_is_read(tmp_path, capsys):
    """A run trained on mnist in A (64 test images), evaluated with --data-root B (32): B's images are evaluated."""
    from idx import write_tiny_mnist

    from manual_train import evaluate

    write_tiny_mnist(tmp_path / "A")
    write_tiny_mnist(tmp_path / "B", n_train=64, n_test=32)
    single.train(make_cfg(tmp_path, dataset="mnist", data_root=str(tmp_path / "A"), max_steps=1, **TINY))
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(tmp_path / "run" / "last.pt"), "--data-root", str(tmp_path / "B"),
                          "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 32  # the checkpoint's own root holds 64


# ---------------------------------------------------------------------- python -m manual_train.generate
def test_generate_top_k_draws_from_the_k_likeliest_only(tmp_path, monkeypatch, capsys):
    """--top-k 1 at --temperature 1, tests/test_generate.py's stand-in model: every byte drawn is the likeliest, 'A',
    'A', then BOS, which ends the text; drawn from all 257 (the default, top-k off) 'A' has ~1% of each draw."""
    from test_generate import EndsAfterTwoBytes

    from manual_train import generate

    monkeypatch.setattr(generate, "load_gpt", lambda path, device: (EndsAfterTwoBytes(), 64))
    (tmp_path / "stand-in.pt").touch()  # a file, as --checkpoint's check asks (load_gpt, replaced, never reads it)
    argv = ["--checkpoint", str(tmp_path / "stand-in.pt"), "--max-new-tokens", "20", "--temperature", "1", "--seed",
            "3"]
    assert generate.main([*argv, "--top-k", "1"]) == 0
    assert capsys.readouterr().out == "AA\n"
    assert generate.main(argv) == 0
    assert capsys.readouterr().out != "AA\n"  # known-wrong: top-k off


# ---------------------------------------------------------------------- python -m manual_train.bench
def test_bench_flags_reach_the_run(tmp_path, monkeypatch):
    """Stand-in entries (the real ones: tests/test_bench.py), each recording what it was given: --only b runs b
    alone, with --repeats 3 (the entry's own default here: 5; --quick: 2), --threads 2 (default 1) and --suite gpu
    (default cpu; CUDA faked present), and bench.json goes to --out."""
    from manual_train.bench import cli, harness

    ran, suites = [], []

    def entry(bench):
        ran.append((bench.entry, bench.repeats(quick=2, full=5), bench.threads))
        return harness.Outcome()

    def suite_entries(suite):
        suites.append(suite)
        return {"a": (entry, "A"), "b": (entry, "B")}

    monkeypatch.setattr(cli, "suite_entries", suite_entries)
    monkeypatch.setattr(cli, "_probe_cuda", lambda: {"available": True, "name": "stand-in"})
    monkeypatch.chdir(tmp_path)  # the default --out, bench-out/, would be made here
    assert cli.main(["--only", "b", "--out", str(tmp_path / "out"), "--repeats", "3", "--threads", "2"]) == 0
    assert ran == [("b", 3, 2)]
    assert (tmp_path / "out" / "bench.json").is_file() and not (tmp_path / "bench-out").exists()
    assert [r["name"] for r in json.loads((tmp_path / "out" / "bench.json").read_text())["entries"]] == ["b"]
    assert cli.main(["--only", "a", "--out", str(tmp_path / "quick"), "--quick", "--suite", "gpu"]) == 0
    assert ran[-1] == ("a", 2, None) and suites == ["cpu", "gpu"]  # the gpu suite's children pick their threads


# ---------------------------------------------------------------------- the sharded loops, as a group of one (gloo)
def test_pipeline_schedule_1f1b_runs_a_backward_between_forwards(tmp_path, monkeypatch, lone_process):
    """--impl torch, one stage, --microbatches 2 (default 4): 1F1B starts each micro-batch's backward before the
    next forward ('BF' in the order of the last stage's loss calls F and backward passes B); GPipe, the default,
    runs every forward of the step first, then the 2 backward passes."""
    import manual_train.pipeline
    from manual_train.loops import pipeline

    order = []
    real = manual_train.pipeline.share

    def share(logits, y, targets):
        order.append("F")
        logits.register_hook(lambda grad: order.append("B"))
        return real(logits, y, targets)

    monkeypatch.setattr(manual_train.pipeline, "share", share)
    flags = dict(model="gpt", dataset="reverse", synthetic_size=64, batch_size=8, impl="torch", microbatches=2,
                 max_steps=1, limit_val_batches="1", eval_batch_size=8)
    pipeline.train(make_cfg(tmp_path / "a", pipeline.PipelineConfig, pipeline_schedule="1f1b", **flags))
    one_f_one_b, order[:] = "".join(order), []
    pipeline.train(make_cfg(tmp_path / "b", pipeline.PipelineConfig, **flags))
    gpipe = "".join(order)
    assert "BF" in one_f_one_b and "BF" not in gpipe and gpipe.count("B") == 2, (one_f_one_b, gpipe)


def test_sequence_parallel_splits_the_layernorms_input_along_the_sequence(tmp_path, monkeypatch, lone_process):
    """--tp 1 --sequence-parallel: the blocks' LayerNorms take their input as a DTensor sharded on dim 1 (the
    sequence). Without it (the flag mutant, `make mutants-flags`) they take it replicated: (Replicate(),)."""
    from torch.distributed.tensor import DTensor, Shard

    from manual_train import tensor_parallel as tp
    from manual_train.loops import tensor_parallel

    layouts = []
    real = tp.shard_blocks

    def recording(raw_model, mesh, sequence=False):
        real(raw_model, mesh, sequence)
        raw_model.blocks[0].ln1.register_forward_hook(lambda m, inputs, out: layouts.append(
            tuple(inputs[0].placements) if isinstance(inputs[0], DTensor) else "plain"))

    monkeypatch.setattr(tp, "shard_blocks", recording)
    tensor_parallel.train(make_cfg(tmp_path, tensor_parallel.TensorParallelConfig, sequence_parallel=True,
                                   model="gpt", dataset="reverse", synthetic_size=32, batch_size=8, max_steps=1,
                                   limit_val_batches="1", eval_batch_size=8))
    assert layouts and all(p == (Shard(1),) for p in layouts), layouts  # training's forward and evaluation's


def test_async_checkpoint_saves_in_the_background(tmp_path, monkeypatch, lone_process):
    """--checkpoint-format dcp --async-checkpoint: each save hands back a future (the shards written in a thread,
    waited for at the next save or at the end). Without it (the flag mutant) the save is done when it returns: no
    future."""
    from manual_train import run as run_module
    from manual_train.loops import zero as zero_loop

    futures = []
    real = run_module.save_sharded

    def recording(*args, **kwargs):
        rest, future = real(*args, **kwargs)
        futures.append(future is not None)
        return rest, future

    monkeypatch.setattr(run_module, "save_sharded", recording)
    zero_loop.train(make_cfg(tmp_path, zero_loop.ZeroConfig, impl="torch", stage=2, checkpoint_format="dcp",
                             async_checkpoint=True, max_steps=1, **TINY))
    assert futures and all(futures), futures
    assert (tmp_path / "run" / "last.dcp").is_symlink()  # linked once the background write was done


def test_reduce_buffer_size_reaches_shardeddps_buckets(tmp_path, monkeypatch, lone_process):
    """--impl fairscale --stage 2 --reduce-buffer-size 0: ShardedDataParallel is built with no reduce buffers (the
    default, None, leaves fairscale's 2**23). In a group of one fairscale buckets nothing anyway: what the buffers
    change across ranks is tests/test_zero_parity.py's (per-rank gradient bytes)."""
    from manual_train import zero_fairscale
    from manual_train.loops import zero as zero_loop

    built = []

    class Recording(zero_fairscale.ShardedDataParallel):
        def __init__(self, module, optimizer, **kwargs):
            built.append(kwargs.get("reduce_buffer_size", "fairscale's default"))
            super().__init__(module, optimizer, **kwargs)

    monkeypatch.setattr(zero_fairscale, "ShardedDataParallel", Recording)
    flags = dict(impl="fairscale", stage=2, max_steps=1, **TINY)
    zero_loop.train(make_cfg(tmp_path / "a", zero_loop.ZeroConfig, reduce_buffer_size=0, **flags))
    zero_loop.train(make_cfg(tmp_path / "b", zero_loop.ZeroConfig, **flags))
    assert built == [0, "fairscale's default"]


# ---------------------------------------------------------------------- the run's data, model and step
def initial_mlp_state(seed: int = 0) -> dict:
    """The mlp's initial weights on the digits, as every loop builds them: torch.manual_seed(--seed) right before."""
    torch.manual_seed(seed)
    return build_model("mlp", DataInfo("digits", (1, 8, 8), 10)).state_dict()


def test_seed_sets_the_initial_weights(tmp_path):
    """--seed 5: one SGD step moves the weights by lr x gradient (~0.05), far less than the init draws differ by."""
    single.train(make_cfg(tmp_path, max_steps=1, seed=5, **TINY))
    trained = load_model_state(tmp_path / "run")
    near = {seed: max((trained[k] - w).abs().max().item() for k, w in initial_mlp_state(seed).items())
            for seed in (5, 0)}
    assert near[5] < 0.1 < near[0], near  # the default seed 0's weights are not where this run started


def test_grad_clip_bounds_the_first_steps_move(tmp_path):
    """--grad-clip 0.01, SGD at lr 0.05: the first step (momentum buffer = the gradient) moves the weights by
    lr x the clipped gradient, whose norm is 0.01 (the gradient's own is far larger)."""
    single.train(make_cfg(tmp_path, max_steps=1, grad_clip=0.01, schedule="constant", lr=0.05, **TINY))
    trained, start = load_model_state(tmp_path / "run"), initial_mlp_state()
    moved = math.sqrt(sum(((trained[k].double() - w.double()) ** 2).sum().item() for k, w in start.items()))
    assert moved == pytest.approx(0.05 * 0.01, rel=1e-4)


def test_loss_plugin_is_the_loss_trained_and_evaluated_with(tmp_path, monkeypatch):
    """--loss manual_train.examples.focal_loss:focal_loss: training (the mean) and evaluation (reduction="sum") call
    it; the default is the cross-entropy (tests/test_plugins.py checks its numbers)."""
    from manual_train.examples import focal_loss

    calls = []
    real = focal_loss.focal_loss
    monkeypatch.setattr(focal_loss, "focal_loss", lambda logits, y, reduction="mean": calls.append(reduction) or
                        real(logits, y, reduction))
    single.train(make_cfg(tmp_path, max_steps=1, loss="manual_train.examples.focal_loss:focal_loss", **TINY))
    assert "mean" in calls and "sum" in calls, calls


def test_synthetic_flags_shape_the_data_and_the_model(tmp_path, capsys):
    """--dataset synthetic --synthetic-size 40 --synthetic-shape 1,6,6 --synthetic-classes 3: 40 training images
    (and 40 // 4 to validate), the mlp takes 36 pixels and has 3 outputs."""
    single.train(make_cfg(tmp_path, dataset="synthetic", synthetic_size=40, synthetic_shape="1,6,6",
                          synthetic_classes=3, max_steps=1, **TINY))
    assert "(40 train / 10 val)" in capsys.readouterr().out
    shapes = [tuple(w.shape) for k, w in load_model_state(tmp_path / "run").items() if k.endswith("weight")]
    assert shapes[0] == (128, 36) and shapes[-1] == (3, 128), shapes


def test_block_size_and_text_samples_cut_the_text(tmp_path, capsys):
    """--dataset pydoc --block-size 16 --text-samples 24: samples of 16 bytes (the GPT's context: 16 positions),
    24 of them to train on."""
    single.train(make_cfg(tmp_path, model="gpt", dataset="pydoc", block_size=16, text_samples=24, batch_size=8,
                          max_steps=1, limit_val_batches="1"))
    assert "(24 train / " in capsys.readouterr().out
    assert load_model_state(tmp_path / "run")["pos.weight"].shape[0] == 16


# ---------------------------------------------------------------------- data and model parallelism in one process
def forward_rows(monkeypatch, cls) -> list:
    """The batch sizes cls.forward is called with in training from now on (by the module itself and by every
    replica; not the one-sample probe of the model summary, nor evaluation, which run without gradients)."""
    rows = []
    real = cls.forward

    def recording(self, x, *args):
        if torch.is_grad_enabled():
            rows.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(cls, "forward", recording)
    return rows


def test_data_parallel_impl_and_devices_split_the_batch(tmp_path, monkeypatch, lone_process):
    """launch/data_parallel.py --impl explicit --devices cpu,cpu,cpu, batch 12: the mlp's first forward takes a
    chunk of 4 rows, one per device (--impl torch, the default, is nn.DataParallel, which on the CPU runs the module
    on the whole batch: 12; --devices auto is cpu,cpu here: 6)."""
    from manual_train.loops import data_parallel
    from manual_train.models import MLP

    rows = forward_rows(monkeypatch, MLP)
    data_parallel.train(make_cfg(tmp_path, data_parallel.DataParallelConfig, impl="explicit", devices="cpu,cpu,cpu",
                                 batch_size=12, max_steps=1, **dict(TINY, eval_batch_size=12)))
    assert rows == [4, 4, 4], rows


def test_hybrid_impl_and_devices_split_the_encoders_batch(tmp_path, monkeypatch, lone_process):
    """launch/hybrid.py dp-mp --impl explicit --devices cpu x 6: the encoder, data-parallel over the first 3, takes
    the batch of 8 in chunks of 3, 3, 2 (--impl torch: 8 at once; --devices auto, cpu x 4: 4 and 4)."""
    from manual_train.loops import hybrid
    from manual_train.models import Encoder

    rows = forward_rows(monkeypatch, Encoder)
    hybrid.train(make_cfg(tmp_path, hybrid.HybridConfig, impl="explicit", devices=",".join(["cpu"] * 6),
                          model="seq2seq", dataset="reverse", synthetic_size=32, batch_size=8, max_steps=1,
                          limit_val_batches="1", eval_batch_size=8))
    assert rows == [3, 3, 2], rows


def test_model_parallel_microbatches_cut_the_batch(tmp_path, monkeypatch, lone_process):
    """launch/model_parallel.py --microbatches 2, batch 8: the encoder takes 4 rows at a time (the default, 1: 8)."""
    from manual_train.loops import model_parallel
    from manual_train.models import Encoder

    rows = forward_rows(monkeypatch, Encoder)
    model_parallel.train(make_cfg(tmp_path, model_parallel.ModelParallelConfig, microbatches=2, model="seq2seq",
                                  dataset="reverse", synthetic_size=32, batch_size=8, max_steps=1,
                                  limit_val_batches="1", eval_batch_size=8))
    assert rows == [4, 4], rows


def test_tensor_parallel_dp_shapes_the_mesh(monkeypatch):
    """launch/tensor_parallel.py --dp 2 at 4 ranks (torchrun's environment, as the flags are checked there): the mesh
    is 2 replicas x tp 2, not 1 x 4 (--dp 1, the default, with --tp 0). The 4-rank runs themselves:
    tests/test_tensor_parallel.py."""
    from manual_train.loops import tensor_parallel

    as_torchrun_rank(monkeypatch, world_size=4)
    cfg = config_from(tensor_parallel.TensorParallelConfig, model="gpt", dataset="reverse", dp=2)
    assert cfg.mesh_shape(4) == (2, 2)


def test_hybrid_mode_ddp_mp_runs_each_half_on_its_own_device(tmp_path, monkeypatch, lone_process):
    """--mode ddp-mp --devices cpu,cpu (a group of one; its 2-rank runs: tests/test_hybrid.py): DDP over the plain
    split, each half the model's own module; dp-mp, the default, wraps each half in data parallelism
    (nn.DataParallel, --impl torch)."""
    from manual_train.loops import hybrid
    from manual_train.models import Decoder, Encoder

    halves = []
    real = hybrid.split_model

    def recording(*args):
        split = real(*args)
        halves.append((type(split.encoder), type(split.decoder)))
        return split

    monkeypatch.setattr(hybrid, "split_model", recording)
    hybrid.train(make_cfg(tmp_path, hybrid.HybridConfig, mode="ddp-mp", devices="cpu,cpu", model="seq2seq",
                          dataset="reverse", synthetic_size=32, batch_size=8, max_steps=1, limit_val_batches="1",
                          eval_batch_size=8))
    assert halves == [(Encoder, Decoder)], halves


def test_evaluate_precision_is_the_evaluations_dtype(checkpoint, monkeypatch, capsys):
    """--precision 64-true on a 32-true run's checkpoint: the model evaluates in float64 (its logits too)."""
    from manual_train import evaluate

    dtypes = []
    real = evaluate.loss_fn
    monkeypatch.setattr(evaluate, "loss_fn", lambda logits, *a, **kw: dtypes.append(logits.dtype) or
                        real(logits, *a, **kw))
    assert evaluate.main(["--checkpoint", str(checkpoint), "--precision", "64-true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "64-true"
    assert dtypes and set(dtypes) == {torch.float64}, dtypes


def test_zero_stage_3_reshards_after_forward(tmp_path, monkeypatch, lone_process):
    """--impl torch --stage 3 (FSDP2, a group of one): when the loss is computed (forward done, backward not
    begun) the GPT's blocks hold their sharded parameters again (DTensors); stage 2, the default, keeps the gathered
    ones (plain tensors) until backward."""
    from torch.distributed.tensor import DTensor

    from manual_train.loops import zero as zero_loop

    sharded, resharded = [], []
    real_shard, real_loss = zero_loop.shard, zero_loop.loss_fn
    monkeypatch.setattr(zero_loop, "shard", lambda *args: sharded.append(real_shard(*args)) or sharded[-1])

    def loss_fn(logits, y, **kw):
        if torch.is_grad_enabled():  # training: the forward's end
            resharded.append(isinstance(sharded[-1].raw_model.blocks[0].attn.q.weight, DTensor))
        return real_loss(logits, y, **kw)

    monkeypatch.setattr(zero_loop, "loss_fn", loss_fn)
    flags = dict(model="gpt", dataset="reverse", synthetic_size=32, batch_size=8, max_steps=1, limit_val_batches="1",
                 eval_batch_size=8, impl="torch")
    zero_loop.train(make_cfg(tmp_path / "a", zero_loop.ZeroConfig, stage=3, **flags))
    zero_loop.train(make_cfg(tmp_path / "b", zero_loop.ZeroConfig, **flags))
    assert resharded == [True, False], resharded
