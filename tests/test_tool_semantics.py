"""The tools on their semantics, not their exit codes (issue 39, item 3): generate's temperature, top-k and greedy
draws, parity's verdict on degenerate traces, the tuner's keep/drop rule at the noise boundary, evaluate's split and
limits. Each is checked on the value the flag decides, with a known-wrong value that must fail the same check."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import make_cfg
from torch.utils.data import DataLoader, Subset

from manual_train import data, parity, text
from manual_train.evaluate import EvalArgs, evaluate_checkpoint
from manual_train.evaluation import evaluate
from manual_train.generate import sample
from manual_train.loops import single
from manual_train.models import build_model
from manual_train.tune import search
from manual_train.tune.search import Trial, decide


# ---------------------------------------------------------------------- generate: the distribution a draw comes from
BYTES = [65, 66, 67, 68, 69, 70]  # the only bytes with a finite logit (BOS never: a draw never ends the document)
SCORES = torch.tensor([3.0, 2.2, 1.5, 1.0, 0.2, -0.5], dtype=torch.float64)


class FixedLogits(torch.nn.Module):
    """The same next-byte logits after any context: every draw is from one known distribution."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))
        logits = torch.full((text.VOCAB,), float("-inf"), dtype=torch.float64)
        logits[BYTES] = SCORES
        self.logits = logits

    def forward(self, idx):
        return self.logits.expand(idx.shape[0], idx.shape[1], -1)


def expected(temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the k largest (all for k = 0): the distribution over BYTES a draw must follow."""
    scores = SCORES / temperature
    if top_k:
        scores = scores.masked_fill(scores < scores.topk(top_k).values[-1], float("-inf"))
    return scores.softmax(-1)


def empirical(temperature: float, top_k: int, n: int = 4000, seed: int = 0) -> torch.Tensor:
    new = sample(FixedLogits(), [65], 8, n, temperature, top_k, torch.Generator().manual_seed(seed))
    assert len(new) == n and set(new) <= set(BYTES)
    counts = torch.tensor([new.count(b) for b in BYTES], dtype=torch.float64)
    return counts / n


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


# Total variation bound for 4000 draws over 6 outcomes. Bretagnolle-Huber-Carol: P(TV >= eps) <= 2^6 exp(-2 n eps^2)
# = 64 exp(-20) = 1.3e-7 at eps = 0.05: the right sampler passes with any seed (this one is fixed), and a sampler
# whose distribution is 2 eps or more from the right one (every wrong one below) would pass only if its own draws
# strayed eps from it: probability < 1.3e-7 too.
EPS = 0.05


@pytest.mark.parametrize("temperature,top_k", [(0.5, 0), (1.0, 0), (2.0, 0), (1.5, 2), (3.0, 4)])
def test_a_draw_follows_softmax_of_logits_over_temperature_within_the_top_k(temperature, top_k):
    right = expected(temperature, top_k)
    got = empirical(temperature, top_k)
    assert tv(got, right) < EPS
    # the wrong samplers this check must refuse, each far from the right distribution so the same draws cannot pass
    # for them: without top-k, another temperature (none, T's inverse, T off by 2x either way); with top-k, k off
    # by one either way or ignored
    if top_k:
        wrong = [expected(temperature, top_k - 1), expected(temperature, top_k + 1), expected(temperature, 0)]
    else:
        wrong = [expected(1.0, 0), expected(1 / temperature, 0), expected(2 * temperature, 0),
                 expected(temperature / 2, 0)]
    far = [w for w in wrong if tv(w, right) > 1e-12]  # (T = 1 is its own inverse)
    assert far and all(tv(w, right) >= 2 * EPS for w in far), [round(tv(w, right), 3) for w in far]
    assert all(tv(got, w) > EPS for w in far)


def test_top_k_never_draws_outside_the_k_likeliest_and_all_k_come():
    for k in (1, 2, 3):
        new = sample(FixedLogits(), [65], 8, 600, 3.0, k, torch.Generator().manual_seed(1))
        assert set(new) == set(BYTES[:k])


def test_greedy_is_the_argmax_at_every_step_and_draws_nothing():
    torch.manual_seed(0)
    table = torch.randn(text.VOCAB, text.VOCAB)
    table[:, text.BOS] = float("-inf")

    class Bigram(torch.nn.Module):  # the next byte's logits depend on the last one: a chain to follow
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx):
            return table[idx]

    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    new = sample(Bigram(), [72], 4, 40, 0.0, 0, generator)
    chain, last = [], 72
    for _ in range(40):
        last = int(table[last].argmax())
        chain.append(last)
    assert new == chain and len(set(new)) > 3
    assert torch.equal(generator.get_state(), state)  # greedy draws no random number
    # top-1 at any temperature is the argmax too; a temperature above 0 without top-k is not
    assert sample(Bigram(), [72], 4, 40, 1.7, 1, torch.Generator().manual_seed(5)) == chain
    assert sample(Bigram(), [72], 4, 40, 1.7, 0, torch.Generator().manual_seed(5)) != chain


# ---------------------------------------------------------------------- parity: the verdict on degenerate traces
def trace(values: dict, losses: dict | None = None, precision: str = "64-true") -> dict:
    """A loaded trace as parity.load_trace returns it: one tensor `w` whose checksums at step s are values[s]."""
    losses = losses or {}
    steps = {s: {"step": s, "loss": losses.get(s, 1.0), "checksums": {"w": list(v)}} for s, v in values.items()}
    return {"dir": None, "meta": {"precision": precision}, "steps": steps, "full": {}}


def same(n: int, start: int = 0) -> dict:
    return {s: [0.5, 0.25, 1.0, 0.5, -0.5, 0.75, 1.0] for s in range(start, start + n)}


def with_value(values: dict, step: int, i: int, x: float) -> dict:
    out = {s: list(v) for s, v in values.items()}
    out[step][i] = x
    return out


def test_a_zero_tolerance_takes_bitwise_equal_traces_and_refuses_one_ulp():
    a = same(6)
    assert parity.compare(trace(a), trace(same(6)), tol=0.0)[0] == 0
    ulp = with_value(a, 3, 5, math.nextafter(0.75, 1.0))
    status, report = parity.compare(trace(a), trace(ulp), tol=0.0)
    assert status == 1 and report.startswith("parted at optimizer step 3: first parameter w")
    assert "(equal within 0 up to step 2)" in report.splitlines()[0]


def test_a_difference_exactly_at_the_tolerance_is_within_it():
    a = same(4)
    b = with_value(a, 2, 0, 0.5 + 2.0 ** -30)
    assert parity.compare(trace(a), trace(b), tol=2.0 ** -30)[0] == 0  # within: d <= tol
    assert parity.compare(trace(a), trace(b), tol=2.0 ** -31)[0] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("position", [0, 1, 4])
def test_a_non_finite_weight_parts_the_runs_at_its_step(bad, position):
    a = same(5)
    status, report = parity.compare(trace(a), trace(with_value(a, 2, position, bad)))
    assert status == 1 and report.startswith("parted at optimizer step 2: first parameter w")
    # in both runs alike it is no proof either: inf - inf and nan - nan are nan, never within a bound
    status, _ = parity.compare(trace(with_value(a, 2, position, bad)), trace(with_value(a, 2, position, bad)))
    assert status == 1


def test_a_non_finite_loss_in_one_run_parts_them_and_in_both_does_not():
    a = same(4)
    status, report = parity.compare(trace(a, {2: 1.0}), trace(a, {2: float("nan")}))
    assert status == 1 and report.startswith("parted at optimizer step 2: the loss, 1 (A) vs nan (B)")
    assert parity.compare(trace(a, {2: float("inf")}), trace(a, {2: float("inf")}))[0] == 0
    assert parity.compare(trace(a, {2: float("nan")}), trace(a, {2: float("nan")}))[0] == 0
    assert parity.compare(trace(a, {2: float("inf")}), trace(a, {2: float("-inf")}))[0] == 1


def test_a_missing_step_is_left_out_and_the_step_before_it_is_named():
    a = same(6)
    b = {s: v for s, v in same(6).items() if s != 3}  # B recorded no step 3
    status, report = parity.compare(trace(a), trace(b))
    assert status == 0 and "over 5 steps (0-5)" in report
    b = with_value(b, 4, 2, 1.5)
    status, report = parity.compare(trace(a), trace(b))
    assert status == 1 and report.startswith("parted at optimizer step 4") and "up to step 2)" in report


def test_traces_of_different_lengths_are_compared_on_the_steps_both_hold():
    a, b = same(10), same(4, start=3)  # B: a resumed run that recorded steps 3-6
    status, report = parity.compare(trace(a), trace(b))
    assert status == 0 and "over 4 steps (3-6)" in report
    status, report = parity.compare(trace(a), trace(with_value(b, 6, 1, 0.0)))
    assert status == 1 and report.startswith("parted at optimizer step 6")
    with pytest.raises(parity.BadInput, match="share no step"):
        parity.compare(trace(same(3)), trace(same(3, start=3)))


def test_a_step_with_a_single_recorded_step_and_no_verdict_outside_64_and_32():
    status, report = parity.compare(trace(same(1)), trace(same(1)))
    assert status == 0 and "over 1 step (0)" in report
    status, report = parity.compare(trace(same(3), precision="bf16-mixed"),
                                    trace(with_value(same(3), 1, 0, 9.0), precision="bf16-mixed"))
    assert status == 0 and report.startswith("no verdict (bf16-mixed)")


# ---------------------------------------------------------------------- tune: keep or drop at the noise boundary
def trials(*values, noise=0.0, compile_s=0.0):
    return [Trial(ok=True, sample_s=v, noise=noise, compile_s=compile_s) for v in values]


def test_a_candidate_exactly_at_the_noise_floor_is_dropped_and_one_just_past_it_kept():
    # one round, no spread: the noise is the floor, log(1 / (1 - 0.03)); a candidate at 0.97x is exactly at it
    assert -math.log(1 - search.MIN_NOISE) == -math.log(0.97)
    winner, verdicts = decide(trials(1.0), {"a": trials(0.97)})
    assert winner is None and verdicts["a"]["verdict"] == "within noise"
    winner, verdicts = decide(trials(1.0), {"a": trials(0.97 * (1 - 1e-9))})
    assert winner == "a" and verdicts["a"]["verdict"] == "kept"
    # the slower side, at a noise of log(1.1) (the trials' spread): exactly 1.1x is within it, past it is slower
    noise = math.log(1.1)
    assert decide(trials(1.0, noise=noise), {"a": trials(1.1, noise=noise)})[1]["a"]["verdict"] == "within noise"
    assert decide(trials(1.0, noise=noise), {"a": trials(1.1 * (1 + 1e-9), noise=noise)})[1]["a"]["verdict"] == \
        "slower"


def test_the_spread_inside_the_trials_is_the_boundary_when_it_is_larger():
    noise = -math.log(0.9)  # ~10% step-to-step spread on both sides: the boundary moves to 0.9x
    winner, _ = decide(trials(1.0, noise=noise), {"a": trials(0.9, noise=noise)})
    assert winner is None
    winner, _ = decide(trials(1.0, noise=noise), {"a": trials(0.9 * (1 - 1e-9), noise=noise)})
    assert winner == "a"
    winner, _ = decide(trials(1.0, noise=noise), {"a": trials(0.9 * (1 - 1e-9))})  # the reference's spread alone
    assert winner == "a"
    # the median over rounds decides, not the best round
    winner, _ = decide(trials(1.0, 1.0, 1.0), {"a": trials(0.5, 0.99, 1.0)})
    assert winner is None


def test_a_compile_that_saves_exactly_its_cost_is_not_kept():
    ref = trials(1.0)
    # 0.5 s saved per sample over 100 samples: 50 s, against a one-time 50 s (not kept) or 49.9 s (kept)
    _, verdicts = decide(ref, {"c": trials(0.5, compile_s=50.0)}, pays_once=True, run_samples=100)
    assert verdicts["c"]["verdict"] == "does not pay back" and verdicts["c"]["saved_s"] == 50.0
    winner, verdicts = decide(ref, {"c": trials(0.5, compile_s=49.9)}, pays_once=True, run_samples=100)
    assert winner == "c" and verdicts["c"]["verdict"] == "kept"


def test_the_fastest_of_several_is_kept_and_the_budget_boundary_fits():
    winner, verdicts = decide(trials(1.0), {"a": trials(0.8), "b": trials(0.6), "c": trials(0.7)})
    assert winner == "b" and [verdicts[k]["verdict"] for k in "abc"] == ["faster", "kept", "faster"]
    assert search.fit_budget(1.0, [1.0, 1.0], 6.0, 2) == (2, 2)  # 2 rounds x 3 s: exactly the budget
    assert search.fit_budget(1.0, [1.0, 1.0], 5.999, 2) == (1, 2)
    assert search.fit_budget(1.0, [1.0, 1.0], 2.0, 2) == (1, 1)
    assert search.fit_budget(1.0, [1.0, 1.0], 1.999, 2) == (0, 0)


# ---------------------------------------------------------------------- evaluate: the split and the limits
@pytest.fixture(scope="module")
def limited_run(tmp_path_factory):
    """A 64-true mlp run on digits that validated on 2 batches of 50 (--limit-val-batches 2)."""
    tmp = tmp_path_factory.mktemp("limited")
    summary = single.train(make_cfg(tmp, model="mlp", max_steps=4, precision="64-true", eval_batch_size=50,
                                    limit_val_batches="2"))
    return tmp / "run" / "last.pt", summary


def reference_sums(path, dataset) -> tuple:
    cfg = make_cfg(path.parent, out_dir=str(path.parent / "unused"), model="mlp")
    _, _, info = data.build_datasets(cfg)
    model = build_model("mlp", info).double()
    model.load_state_dict(torch.load(path, weights_only=True)["model"])

    class Double(torch.nn.Module):
        def forward(self, x):
            return model(x.double())

    loss, correct, count = evaluate(Double(), DataLoader(dataset, batch_size=64), torch.device("cpu"))
    return (loss / count).item(), (correct / count).item(), int(count.item())


def test_evaluate_takes_the_whole_val_split_not_the_runs_limit(limited_run):
    path, summary = limited_run
    result = evaluate_checkpoint(EvalArgs(checkpoint=str(path), eval_batch_size=40))
    cfg = make_cfg(path.parent, out_dir=str(path.parent / "unused"), model="mlp")
    _, val_ds, _ = data.build_datasets(cfg)
    loss, acc, count = reference_sums(path, val_ds)
    assert result["split"] == "val" and result["samples"] == count == 297
    assert result["loss"] == pytest.approx(loss, abs=1e-12) and result["acc"] == acc
    # the run itself validated on the first 100 samples only: another number
    first, _, n = reference_sums(path, Subset(val_ds, range(100)))
    assert n == 100 and summary["final_val_loss"] == pytest.approx(first, abs=1e-9)
    assert abs(result["loss"] - first) > 1e-6


@pytest.mark.parametrize("limit,batch,kept", [("2", 50, 100), ("1", 297, 297), ("0.5", 50, 150), ("7", 50, 297),
                                              ("0.34", 100, 100)])
def test_limit_val_batches_keeps_exactly_the_first_batches(tmp_path, limit, batch, kept):
    _, val_ds, _ = data.build_datasets(make_cfg(tmp_path, model="mlp"))
    cfg = make_cfg(tmp_path, model="mlp", eval_batch_size=batch, limit_val_batches=limit)
    limited = data.limit_val(val_ds, cfg)
    assert len(limited) == kept and list(limited.indices) == list(range(kept))
    assert [y for _, y in data.build_datasets(cfg)[1]] == [y for _, y in limited]  # what every loop validates on


@pytest.mark.parametrize("limit,batch,kept", [("3", 16, 48), ("0.5", 16, 752), ("1000", 16, 1500), ("0.25", 100, 300),
                                              ("1", 1500, 1500)])
def test_limit_train_batches_keeps_exactly_the_first_micro_batches(tmp_path, limit, batch, kept):
    cfg = make_cfg(tmp_path, model="mlp", batch_size=batch, limit_train_batches=limit)
    assert data.limit_train(1500, cfg) == kept


def test_eval_shards_are_every_nth_sample_from_the_rank():
    ds = list(range(11))
    shards = [list(data.eval_shard(ds, 3, r)) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert data.eval_shard(ds, 1, 0) is ds
