"""python -m manual_train.generate: text from a --dataset pydoc GPT, any loop's checkpoint, reproducible, refusals in
one line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, final_weights, make_cfg, run_ok, torchrun

from manual_train import text
from manual_train.generate import load_gpt, main, sample
from manual_train.loops import single
from manual_train.models import DataInfo, build_model

PYDOC = dict(model="gpt", dataset="pydoc", batch_size=32, optimizer="adamw", lr=3e-3, limit_val_batches=1)


def generated(capsys, *argv) -> str:
    """main(argv) in this process: what it printed (its one trailing newline off)."""
    capsys.readouterr()  # not what a training run printed before
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def cli(*argv) -> subprocess.CompletedProcess:
    """The real command line, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "manual_train.generate", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def plain_gpt(state: dict, block_size: int = 64) -> torch.nn.Module:
    """The checkpoint's weights in a GPT built here, not by generate."""
    model = build_model("gpt", DataInfo("pydoc", (block_size,), text.VOCAB))
    model.to(next(iter(state.values())).dtype).load_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """A GPT trained on 128 samples of the text for 2 epochs (8 steps, ~1 s): its last.pt. Enough training that its
    bytes are mostly ASCII (so that two texts differ where their bytes do) and its next-byte distributions are not
    one spike."""
    tmp = tmp_path_factory.mktemp("gpt")
    single.train(make_cfg(tmp, **dict(PYDOC, lr=1e-2), text_samples=128, epochs=2))
    return tmp / "run" / "last.pt"


def test_prints_the_prompt_then_at_most_n_new_bytes_the_same_in_any_process(gpt, capsys):
    proc = cli("--checkpoint", str(gpt), "--prompt", "def ", "--max-new-tokens", "50", "--seed", "7")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    out = proc.stdout[:-1]
    assert out.startswith("def ") and len(out) - len("def ") <= 50  # a byte decodes to at most one character
    assert generated(capsys, "--checkpoint", str(gpt), "--prompt", "def ", "--max-new-tokens", "50",
                     "--seed", "7") == out  # bitwise the same text in another process
    model, block_size = load_gpt(str(gpt), torch.device("cpu"))
    new = sample(model, text.encode("def "), block_size, 50, 0.8, 0, torch.Generator().manual_seed(7))
    assert len(new) <= 50 and text.BOS not in new and out == text.decode(text.encode("def ") + new)
    assert generated(capsys, "--checkpoint", str(gpt), "--prompt", "déf ", "--max-new-tokens", "0") == "déf "


def test_the_same_seed_gives_the_same_text_another_seed_another(gpt, capsys):
    def run(seed):
        return generated(capsys, "--checkpoint", str(gpt), "--prompt", "The ", "--max-new-tokens", "60",
                         "--seed", str(seed))

    first = run(0)
    assert run(0) == first
    assert run(1) != first  # 60 draws from spread distributions: equal by chance essentially never


def test_temperature_zero_is_the_argmax_and_ignores_the_seed(gpt, capsys):
    prompt = "for "
    model = plain_gpt(torch.load(gpt, weights_only=True)["model"])
    with torch.no_grad():
        first = model(torch.tensor([text.encode(prompt)]))[0, -1].argmax().item()  # the test's own argmax
    loaded, block_size = load_gpt(str(gpt), torch.device("cpu"))
    new = sample(loaded, text.encode(prompt), block_size, 30, 0.0, 0, torch.Generator())
    assert new[0] == first
    argv = ("--checkpoint", str(gpt), "--prompt", prompt, "--max-new-tokens", "30", "--temperature", "0")
    out = generated(capsys, *argv, "--seed", "1")
    assert out == text.decode(text.encode(prompt) + new) == generated(capsys, *argv, "--seed", "2")
    assert generated(capsys, *argv[:-2], "--top-k", "1", "--temperature", "1.5") == out  # top-1 is greedy too


def test_a_draw_is_from_the_softmax_of_logits_over_temperature_and_top_k_keeps_the_k_likeliest(gpt):
    model, block_size = load_gpt(str(gpt), torch.device("cpu"))
    prompt = text.encode("import ")
    with torch.no_grad():
        logits = plain_gpt(torch.load(gpt, weights_only=True)["model"])(torch.tensor([prompt]))[0, -1]

    def first(seed, temperature, top_k):  # the first byte drawn (BOS: the document ended at once)
        new = sample(model, prompt, block_size, 1, temperature, top_k, torch.Generator().manual_seed(seed))
        return new[0] if new else text.BOS

    for seed in range(10):  # the test's own draw, from the same generator state
        expect = torch.multinomial((logits / 0.8).softmax(-1), 1, generator=torch.Generator().manual_seed(seed))
        assert first(seed, 0.8, 0) == expect.item()
    top3 = set(logits.topk(3).indices.tolist())
    assert {first(seed, 2.0, 3) for seed in range(40)} <= top3
    assert not {first(seed, 2.0, 0) for seed in range(40)} <= top3  # known-wrong, top-k off: other bytes come too


class EndsAfterTwoBytes(torch.nn.Module):
    """A stand-in model: 'A' is the likeliest next byte while the context is under 3 tokens, then BOS."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, text.VOCAB)
        logits[..., text.BOS if idx.shape[1] >= 3 else ord("A")] = 1.0
        return logits


def test_a_drawn_bos_ends_the_document():
    new = sample(EndsAfterTwoBytes(), text.encode(""), 64, 200, 0.0, 0, torch.Generator())
    assert new == [ord("A")] * 2  # not 200 tokens, and no BOS among them


def test_a_prompt_longer_than_the_context_is_cropped(gpt, capsys):
    prompt = "x = 1\n" * 40  # 240 bytes, block_size 64
    out = generated(capsys, "--checkpoint", str(gpt), "--prompt", prompt, "--max-new-tokens", "10")
    assert out.startswith(prompt) and len(out) <= len(prompt) + 10


def test_a_64_true_checkpoint_generates_in_float64(tmp_path, capsys):
    single.train(make_cfg(tmp_path, **PYDOC, text_samples=64, epochs=1, precision="64-true"))
    path = tmp_path / "run" / "best.pt"
    model, _ = load_gpt(str(path), torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    out = generated(capsys, "--checkpoint", str(path), "--prompt", "def ", "--max-new-tokens", "20")
    assert out.startswith("def ") and len(out) <= 24


def test_a_dcp_folder_of_a_tensor_parallel_run(tmp_path, capsys):
    """2 ranks of --tp 2 each write their shards (last.dcp/); generate reads them whole, in one process."""
    run = tmp_path / "tp"
    run_ok("tensor_parallel", *(f"--{k.replace('_', '-')}={v}" for k, v in PYDOC.items() if k != "model"),
           "--text-samples=64", "--epochs=1", "--checkpoint-format=dcp", f"--out-dir={run}", "--no-progress",
           launcher=torchrun(2))
    assert (run / "last.dcp").is_dir() and not (run / "last.pt").exists()
    out = generated(capsys, "--checkpoint", str(run / "last.dcp"), "--prompt", "def ", "--max-new-tokens", "20")
    seeded = torch.Generator().manual_seed(0)  # generate's --seed default (an unseeded Generator draws otherwise)
    new = sample(plain_gpt(final_weights(run)), text.encode("def "), 64, 20, 0.8, 0, seeded)
    assert out == text.decode(text.encode("def ") + new)


@pytest.fixture(scope="module")
def not_text(tmp_path_factory):
    """Checkpoints generate must refuse: a cnn on digits, a GPT of the reverse task."""
    tmp = tmp_path_factory.mktemp("not_text")
    single.train(make_cfg(tmp / "cnn", model="cnn", max_steps=1))
    single.train(make_cfg(tmp / "reverse", model="gpt", dataset="reverse", synthetic_size=64, max_steps=1))
    (tmp / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp / "folder").mkdir()
    return tmp


@pytest.mark.parametrize("argv,start", [
    ([], "--checkpoint: is required"),
    (["--checkpoint", "/no/such.pt"], "--checkpoint: no checkpoint file"),
    (["--checkpoint", "{t}/junk.pt"], "--checkpoint: {t}/junk.pt is not a readable checkpoint"),
    (["--checkpoint", "{t}/folder"], "--checkpoint: {t}/folder is not a readable DCP checkpoint"),
    (["--checkpoint", "{t}/cnn/run/last.pt"], "--checkpoint: {t}/cnn/run/last.pt holds a cnn, not a GPT"),
    (["--checkpoint", "{t}/reverse/run/last.pt"], "--checkpoint: {t}/reverse/run/last.pt holds a GPT of the digit"),
    (["--checkpoint", "{t}/junk.pt", "--max-new-tokens", "-1"], "--max-new-tokens: -1 is out of range"),
    (["--checkpoint", "{t}/junk.pt", "--temperature=-0.5"], "--temperature: -0.5 is out of range"),
    (["--checkpoint", "{t}/junk.pt", "--temperature", "nan"], "--temperature: nan is not a finite number"),
    (["--checkpoint", "{t}/junk.pt", "--top-k", "-1"], "--top-k: -1 is out of range"),
    (["--checkpoint", "{t}/junk.pt", "--seed", "-1"], "--seed: -1 is out of range"),
    (["--checkpoint", "{t}/junk.pt", "--device", "tpu"], "--device: unknown device"),
    (["--checkpoint", "{t}/junk.pt", "--max-new-tokens", "many"], "--max-new-tokens: invalid int value"),
])
def test_bad_input_is_one_line(argv, start, not_text, capsys):
    assert main([a.format(t=not_text) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: {start.format(t=not_text)}"), err


def test_a_prompt_that_is_not_utf8_is_one_line(gpt, capsys):
    assert main(["--checkpoint", str(gpt), "--prompt", "a\udcff"]) == 2  # how argv holds the byte 0xff
    assert capsys.readouterr() == ("", "error: --prompt: is not valid UTF-8 text\n")


def test_the_reverse_gpt_is_refused_by_the_real_cli(not_text):
    proc = cli("--checkpoint", str(not_text / "reverse" / "run" / "last.pt"))
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --checkpoint: ")
    assert "digit-reversal" in proc.stderr and "--dataset pydoc" in proc.stderr


def test_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--checkpoint PATH" in out and "--prompt TEXT" in out and "--temperature" in out
    assert "python -m manual_train.generate --checkpoint" in out  # the docstring's examples
