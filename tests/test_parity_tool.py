"""python -m manual_train.parity: equal pairs are reported equal (real launch scripts, torchrun ranks, a resume), seeded
bugs are found at the step and parameter where they begin (also one that begins only in the epoch's last, partial
accumulation window), bad input is one line with exit 2, and runs that could not be equal are refused by flag."""
from __future__ import annotations

import re
import subprocess
import sys

import torch
from conftest import REPO, SUBPROCESS_TIMEOUT_S
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from manual_train import parity
from manual_train.cli import run
from manual_train.loops import single

# a tiny mlp on 100 synthetic 8x8 samples: 24 per step leaves a last micro-batch of 4, which 3 ranks split 2, 1, 1
TINY = ("--dataset synthetic --synthetic-size 100 --synthetic-shape 1,8,8 --model mlp --precision 64-true "
        "--epochs 2 --no-progress")


def parity_tool(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "manual_train.parity", "--quiet", "--work-dir", str(tmp_path / "w"),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=SUBPROCESS_TIMEOUT_S)


def assert_equal_report(proc, steps: str) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(rf"equal within 1e-09 over {steps}: ", proc.stdout), proc.stdout


# ---------------------------------------------------------------------- correct pairs: equal
def test_ddp_three_ranks_equal_single_on_uneven_data(tmp_path):
    """77 samples at a global batch of 15 (3 ranks x 5): each epoch's last window holds 2 samples, so rank 2 steps
    with an empty micro-batch (tests/test_ddp_knobs.py's uneven shards, in-process; here launch/ddp.py under real
    torchrun, held to one process at every step: the CLI pairing of docs/ddp_knobs.md)."""
    uneven = TINY.replace("--synthetic-size 100", "--synthetic-size 77")
    proc = parity_tool(tmp_path, "--a", f"launch/single.py {uneven} --batch-size 15",
                       "--b", f"torchrun --nproc_per_node=3 launch/ddp.py {uneven} --batch-size 5")
    assert_equal_report(proc, r"13 steps \(0-12\)")  # the initial weights and 2 epochs of 6 steps
    assert "global batch 15 = batch 5 x accumulate 1 x world size 3" in (tmp_path / "w" / "b.log").read_text()


def test_zero_fsdp2_equals_single(tmp_path):
    """FSDP2 (stage 3) shards every parameter: the trace gathers the full state as a checkpoint does. Against one
    process (torchrun's DDP on the same data is the test above's: one process is the baseline both are held to, and
    costs one interpreter, not torchrun's three)."""
    proc = parity_tool(tmp_path, "--a", f"launch/single.py {TINY} --batch-size 24",
                       "--b", f"torchrun --nproc_per_node=2 launch/zero.py --stage 3 {TINY} --batch-size 12")
    assert_equal_report(proc, r"11 steps \(0-10\)")


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """The 4-step checkpoint comes from the loop in this process (manual_train/cli.py's run, as launch/single.py calls
    it: one interpreter start less); the tool's two runs are compared in 64-true within 1e-9, so the checkpoint may
    come from another kind of process."""
    flags = f"{TINY} --batch-size 24 --schedule constant --max-steps 8"
    first = [*f"{TINY} --batch-size 24 --schedule constant --max-steps 4".split(), "--out-dir", str(tmp_path / "first")]
    assert run(single.train, script="single", argv=first) == 0
    proc = parity_tool(tmp_path, "--a", f"launch/single.py {flags}",
                       "--b", f"launch/single.py {flags} --resume {tmp_path / 'first' / 'last.pt'}")
    assert_equal_report(proc, r"5 steps \(4-8\)")  # the resumed run's steps: the checkpoint's weights, then 5-8


def test_fp32_pair_within_the_measured_noise_floor(tmp_path):
    """32-true: the tool runs A a third time with its initial weights one ulp up and holds B to 10 such floors."""
    fp32 = TINY.replace("--precision 64-true", "--precision 32-true")
    proc = parity_tool(tmp_path, "--a", f"launch/single.py {fp32} --batch-size 24",
                       "--b", f"launch/single.py {fp32} --batch-size 8 --accumulate 3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("equal within 10 x the fp32 noise floor over 11 steps (0-10)"), proc.stdout
    # the floor run, and only it, starts one ulp up from A's (and B's) initial weights
    a, b, floor = (parity.load_trace(tmp_path / "w" / name, "--a") for name in ("a", "b", "floor"))
    a0, b0, floor0 = (torch.load(t["full"][0], weights_only=True) for t in (a, b, floor))
    for k, w in a0.items():  # (a trace keeps float64 copies: the fp32 weights' ulp is taken in float32)
        up = torch.nextafter(w.float(), torch.full_like(w.float(), float("inf")))
        assert torch.equal(w, b0[k]) and torch.equal(floor0[k].float(), up), k


# ---------------------------------------------------------------------- seeded bugs: the first step and parameter
def hand_loop(out_dir, *, epochs=1, batch_size=4, accumulate=4, divide_by_k=False, stray_edit_at=None) -> None:
    """A plain loop with record(): 50 samples, 13 micro-batches an epoch (the last of 2 samples), windows of
    `accumulate`. divide_by_k: each micro-batch's loss / K (the epoch's last window holds 1 micro-batch, so its
    gradient shrinks 4x; the full windows' micro-batches hold 4 samples each, where / K is right). stray_edit_at:
    from that step on, the head's bias is moved by 1e-6 after the step (a stray in-place update)."""
    torch.manual_seed(0)
    x, y = torch.randn(50, 6, dtype=torch.float64), torch.randint(0, 3, (50,))
    dataset = TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    parity.record(model, 0, out_dir)
    step, n_micro, window_loss = 0, len(loader), 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            window = range(i - i % accumulate, min(i - i % accumulate + accumulate, n_micro))
            window_samples = sum(min(batch_size, len(dataset) - j * batch_size) for j in window)
            weight = 1 / accumulate if divide_by_k else len(xb) / window_samples
            loss = nn.functional.cross_entropy(model(xb), yb)
            (loss * weight).backward()
            window_loss += loss.detach() * weight  # the window's mean loss, as one big batch's
            if i == window[-1]:  # the window's last micro-batch
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if stray_edit_at is not None and step >= stray_edit_at:
                    with torch.no_grad():
                        model[2].bias.add_(1e-6)
                parity.record(model, step, out_dir, loss=window_loss)
                window_loss = 0.0


def compare_dirs(a, b) -> tuple[int, str]:
    return parity.compare(parity.load_trace(a, "--trace-a"), parity.load_trace(b, "--trace-b"))


def test_a_stray_update_is_found_at_its_step_and_parameter(tmp_path):
    hand_loop(tmp_path / "a", epochs=2)
    hand_loop(tmp_path / "b", epochs=2, stray_edit_at=5)
    status, report = compare_dirs(tmp_path / "a", tmp_path / "b")
    assert status == 1
    assert report.startswith("parted at optimizer step 5: first parameter 2.bias, distance 1e-06 > 1e-09"), report
    assert "(equal within 1e-09 up to step 4)" in report


def test_the_last_partial_window_divided_by_k_is_found_there_not_earlier(tmp_path):
    """Lightning's ÷K: right in every full window (4 micro-batches of 4), wrong only in the epoch's last window
    (1 micro-batch of 2 samples): step 4, the epoch's last; steps 1-3 are bit-equal."""
    hand_loop(tmp_path / "a", epochs=2)
    hand_loop(tmp_path / "b", epochs=2, divide_by_k=True)
    status, report = compare_dirs(tmp_path / "a", tmp_path / "b")
    assert status == 1
    assert report.startswith("parted at optimizer step 4: first parameter 0.weight"), report
    assert "(equal within 1e-09 up to step 3)" in report
    rows = [line.split() for line in report.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [int(r[0]) for r in rows][:3] == [4, 5, 6]  # it grows over the next steps


def test_an_accumulated_hand_loop_equals_one_big_batch(tmp_path):
    hand_loop(tmp_path / "a", batch_size=4, accumulate=4)
    hand_loop(tmp_path / "b", batch_size=16, accumulate=1)
    status, report = compare_dirs(tmp_path / "a", tmp_path / "b")
    assert status == 0 and report.startswith("equal within 1e-09 over 5 steps (0-4)"), report


def test_record_drops_the_wrappers_prefixes(tmp_path):
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    inner = nn.Linear(2, 2)
    parity.record(Wrapper(inner), 0, tmp_path / "t")
    assert set(parity.load_trace(tmp_path / "t", "--trace-a")["steps"][0]["checksums"]) == {"weight", "bias"}


# ---------------------------------------------------------------------- bad input and incompatible runs
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in ([], ["--trace-a", str(tmp_path / "none"), "--trace-b", str(tmp_path / "none")],
                 ["--a", "rm -rf x", "--b", "launch/single.py"], ["--a", "launch/nope.py", "--b", "launch/single.py"],
                 ["--a", "launch/single.py --trace-dir x", "--b", "launch/single.py"], ["--a", "launch/single.py"],
                 ["--tol", "nan", "--a", "launch/single.py", "--b", "launch/single.py"], ["--bogus"]):
        proc = parity_tool(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)


def test_runs_that_could_not_be_equal_are_refused_naming_the_flag(tmp_path):
    proc = parity_tool(tmp_path / "seed", "--a", f"launch/single.py {TINY} --batch-size 24",
                       "--b", f"launch/single.py {TINY} --batch-size 24 --seed 1")
    assert proc.returncode == 2 and proc.stderr.startswith("error: refused: "), proc.stderr
    assert "--seed differs: 0 (A) vs 1 (B)" in proc.stderr and len(proc.stderr.splitlines()) == 1
    # the global batch, on what two runs' meta.json say: 24 in one process = 3 ranks x 4 x accumulate 2, not 8 x 2
    same = dict(precision="64-true", seed=0, dataset="digits", model="mlp", epochs=2)
    a = dict(global_batch_size=24, replicas=1, total_steps=126, config=dict(same, batch_size=24, accumulate=1))
    b = dict(global_batch_size=24, replicas=3, total_steps=126, config=dict(same, batch_size=4, accumulate=2))
    assert parity.refusal(a, b) is None
    b = dict(global_batch_size=16, replicas=1, total_steps=126, config=dict(same, batch_size=8, accumulate=2))
    assert parity.refusal(a, b) == ("the global batch (--batch-size x world size x --accumulate) differs: "
                                    "24 x 1 x 1 = 24 (A) vs 8 x 1 x 2 = 16 (B)")
    b = dict(a, total_steps=63, config=dict(a["config"], epochs=1))
    assert parity.refusal(a, b) == ("the number of optimizer steps differs: 126 (A) vs 63 (B) "
                                    "(--epochs 2 (A) vs 1 (B))")
