"""Sample text from a GPT trained on --dataset pydoc: autoregressive decoding, written out (docs/gpt.md).

    python -m manual_train.generate --checkpoint runs/single-<time>/best.pt --prompt "def " --max-new-tokens 200
    python -m manual_train.generate --checkpoint runs/zero-<time>/last.dcp --prompt "The " --temperature 0  # greedy
    python -m manual_train.generate --checkpoint runs/ddp-<time>/last.pt --top-k 40 --seed 1

Any loop's checkpoint (last.pt or best.pt of any launch script, or a last.dcp/best.dcp folder, read whole) holds the
unwrapped model's full state_dict, so one plain GPT loads it: rebuilt from the checkpoint's own config (its
--block-size is the context length), in its own dtype (float64 for 64-true). The tokens are the text's UTF-8 bytes
and BOS (manual_train/text.py): the prompt becomes BOS + its bytes, as every document starts. Each step feeds the
last block_size tokens, takes the last position's logits, divides them by --temperature (0: argmax, greedy), keeps
the --top-k largest (0: all of them) and draws the next byte from their softmax with a torch.Generator of its own,
seeded by --seed: the same flags print the same text, bit for bit (on the same device). A BOS drawn means the
document ended: generation stops there. Prints the prompt and what follows it. There is no KV cache: every step
recomputes the whole context (at most block_size tokens), simple and fast enough for this small model.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn

from manual_train import text
from manual_train.checkpoint import check_checkpoint_arg, first_line, load_checkpoint, saved_config
from manual_train.config import arg, parse_config
from manual_train.distributed import pick_device, read_env
from manual_train.errors import UsageError
from manual_train.models import DataInfo, build_model
from manual_train.precision import param_dtype


@dataclass
class GenerateArgs:
    """The flags of python -m manual_train.generate."""

    checkpoint: Optional[str] = arg(None, "a --model gpt --dataset pydoc checkpoint: last.pt or best.pt of any launch "
                                          "script, or a last.dcp/best.dcp folder (read whole)", metavar="PATH")
    prompt: str = arg("", "the text to continue (default: none, a document's start: BOS alone)", metavar="TEXT")
    max_new_tokens: int = arg(200, "bytes to generate (fewer when the model ends the document)", min=0)
    temperature: float = arg(0.8, "divides the logits: < 1 sharper, > 1 flatter; 0 takes the argmax (greedy)", min=0)
    top_k: int = arg(0, "draw from the k likeliest bytes only (0: from all of them)", min=0)
    seed: int = arg(0, "seed of the sampling's own torch.Generator", min=0, max=2 ** 64 - 1)
    device: str = arg("auto", "auto, cpu, cuda or cuda:N", metavar="{auto,cpu,cuda,cuda:N}")

    def validate(self) -> None:
        check_checkpoint_arg(self.checkpoint)


def load_gpt(path: str, device: torch.device) -> tuple[nn.Module, int]:
    """(the checkpoint's GPT in eval mode on `device`, its block_size); anything else is refused in one line."""
    ckpt = load_checkpoint(Path(path), flag="--checkpoint")
    cfg = saved_config(ckpt)
    if cfg.model != "gpt" or cfg.dataset != "pydoc":
        what = ("a GPT of the digit-reversal task (a vocabulary of 11 tokens), not of text" if cfg.model == "gpt"
                else f"a {cfg.model}, not a GPT")
        raise UsageError("--checkpoint", f"{path} holds {what} (--model {cfg.model} --dataset {cfg.dataset}): "
                                         "generate reads --model gpt --dataset pydoc checkpoints")
    model = build_model("gpt", DataInfo("pydoc", (cfg.block_size,), text.VOCAB)).to(param_dtype(cfg.precision))
    try:
        model.load_state_dict(ckpt["model"])
    except Exception as e:  # a state of other shapes or names than its own config's GPT
        raise UsageError("--checkpoint", f"{path}: its weights do not fit the GPT of its own config "
                                         f"({first_line(e)})") from None
    return model.to(device).eval(), cfg.block_size


@torch.inference_mode()
def sample(model: nn.Module, tokens: list[int], block_size: int, max_new_tokens: int, temperature: float,
           top_k: int, generator: torch.Generator) -> list[int]:
    """The new tokens after `tokens`, one forward each, at most max_new_tokens (fewer when BOS is drawn)."""
    device = next(model.parameters()).device
    context = torch.tensor([tokens[-block_size:]], device=device)  # (1, T): a batch of one, T <= block_size
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(context)[0, -1]  # (V,): the scores of the byte after the context's last token
        if temperature == 0:
            token = logits.argmax()  # greedy: the likeliest byte (the first of ties)
        else:
            logits = logits / temperature
            if top_k:  # every logit below the k-th largest can never be drawn
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
        if token.item() == text.BOS:  # the model ended the document
            break
        new.append(int(token))
        context = torch.cat([context, token.view(1, 1)], dim=1)[:, -block_size:]  # the window slides
    return new


def prompt_tokens(prompt: str) -> list[int]:
    try:
        return text.encode(prompt)
    except UnicodeEncodeError:  # a byte that is not UTF-8 in argv arrives as a lone surrogate
        raise UsageError("--prompt", "is not valid UTF-8 text") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status 0, or 2 with one `error: --flag: ...` line for bad input (nothing printed to stdout)."""
    try:
        args = parse_config(GenerateArgs, argv, prog="python -m manual_train.generate", description=__doc__)
        prompt = prompt_tokens(args.prompt)
        device = pick_device(args.device, read_env())
        model, block_size = load_gpt(args.checkpoint, device)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        new = sample(model, prompt, block_size, args.max_new_tokens, args.temperature, args.top_k, generator)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0), or a bad flag already printed as one line (2)
        return int(e.code or 0)
    print(text.decode(prompt + new))  # decoded at once: a character of several bytes is never cut between steps
    return 0


if __name__ == "__main__":
    sys.exit(main())
