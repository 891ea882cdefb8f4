"""Models: plain nn.Modules, unmodified by any technique.

Parallelism and precision are applied to these by functions elsewhere (wrap in DDP, split the
encoder and decoder over devices, cast for O2), so the same model definition serves every loop.
Dropout is off unless --dropout asks for it (nn.Dropout(0) draws no random numbers), so parity tests compare
deterministic computations; `cnn` and `mlp`
have no BatchNorm either (BatchNorm statistics are per micro-batch, which accumulation and
DataParallel change). `resnet18` keeps its BatchNorm layers: it is the model for the 16-o2
"BatchNorm stays fp32" rule and for the GPU benchmarks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from manual_train.errors import UsageError


@dataclass
class DataInfo:
    """What a model needs to know about the data."""

    name: str
    input_shape: tuple  # per sample, e.g. (1, 8, 8); (2, L) token ids for reverse
    num_classes: int  # classes, or vocabulary size for token tasks
    predict: Optional[int] = None  # gpt: the positions at the end of x that have targets (None: every one)


class MLP(nn.Module):
    def __init__(self, input_shape: tuple, num_classes: int, hidden: int = 128, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout),  # input dropout (pixels), as in Hinton et al.'s MLPs
            nn.Linear(math.prod(input_shape), hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


class AvgPoolTo2x2(nn.Module):
    """nn.AdaptiveAvgPool2d(2), with a deterministic backward on CUDA too (no parameters; the same averages).

    AdaptiveAvgPool2d's CUDA backward adds into the input gradient with atomics, which
    torch.use_deterministic_algorithms(True) (--deterministic) refuses. When both sides are even, its four
    windows are the tiles of avg_pool2d with kernel = stride = half the side (digits' 4x4 map, MNIST's 14x14,
    CIFAR's 16x16), whose backward writes every input gradient once: that runs on CUDA. The CPU keeps the adaptive
    kernel: it divides the window sum by the height and then the width, avg_pool2d by their product, which can
    differ in the last bit (14x14 -> 7x7 windows), and CPU parity runs must not move. Odd sides keep the adaptive
    kernel everywhere (its windows overlap there).
    """

    def forward(self, x):
        h, w = x.shape[-2:]
        if x.is_cuda and h % 2 == 0 and w % 2 == 0:
            return F.avg_pool2d(x, (h // 2, w // 2))
        return F.adaptive_avg_pool2d(x, 2)


class SmallCNN(nn.Module):
    """Three 3x3 convolutions and a two-layer head; ~90k parameters, any input size >= 2x2."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(),
            AvgPoolTo2x2(),  # nn.AdaptiveAvgPool2d(2), deterministic on CUDA too
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(8 * width, 128), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )

    def forward(self, x):
        return self.head(self.features(x))


def resnet18(in_channels: int, num_classes: int) -> nn.Module:
    """torchvision's resnet18 with a CIFAR-style stem: a 3x3 stride-1 first conv and no max-pool,
    so 32x32 (or 8x8) inputs are not shrunk to 1x1 before the last stage."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class Encoder(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, hidden, batch_first=True)  # GRU, not LSTM: LSTM fails under CPU autocast

    def forward(self, src):  # (B, L) -> final hidden state (1, B, H)
        _, h = self.rnn(self.embed(src))
        return h


class Decoder(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, dec_in, h):  # teacher forcing: (B, L) inputs, (1, B, H) state -> (B, L, V) logits
        y, _ = self.rnn(self.embed(dec_in), h)
        return self.out(y)


class Seq2Seq(nn.Module):
    """GRU encoder and GRU decoder, trained with teacher forcing.

    The input is one (B, 2, L) tensor (source row, decoder-input row) so that every loop can call
    model(x) and scatter x along the batch dimension. Model parallelism replaces forward (see
    manual_train/model_parallel.py) and keeps these two submodules.
    """

    def __init__(self, vocab: int, emb: int = 64, hidden: int = 128):
        super().__init__()
        self.encoder = Encoder(vocab, emb, hidden)
        self.decoder = Decoder(vocab, emb, hidden)

    def forward(self, x):
        h = self.encoder(x[:, 0])
        return self.decoder(x[:, 1], h)


class CausalSelfAttention(nn.Module):
    """q, k and v are three Linears (torchtitan's wq, wk, wv), not one fused qkv: tensor parallelism's column split
    (manual_train/tensor_parallel.py) then gives each rank whole heads of each, and every state dict, sharded or
    not, holds the same layout at any --tp. The views count heads with -1: n_head here, n_head/tp on a TP rank."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.n_head = n_head
        # drawn as nanoGPT's fused (3C, C) Linear, then split: the seed gives the weights it gave before the split
        fused = nn.Linear(n_embd, 3 * n_embd)
        self.q, self.k, self.v = (nn.utils.skip_init(nn.Linear, n_embd, n_embd) for _ in range(3))  # no draws
        with torch.no_grad():
            for linear, weight, bias in zip((self.q, self.k, self.v), fused.weight.chunk(3), fused.bias.chunk(3)):
                linear.weight.copy_(weight), linear.bias.copy_(bias)
        self.proj = nn.Linear(n_embd, n_embd)
        self.drop = nn.Dropout(dropout)  # on the residual branch, as nanoGPT's resid_dropout

    def forward(self, x):
        head_size = x.shape[-1] // self.n_head  # (B, T, heads x head_size): this rank's heads under TP; B may be 0
        q, k, v = (lin(x).unflatten(-1, (-1, head_size)).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).flatten(2)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small nanoGPT-style decoder (pre-LayerNorm blocks, tied embeddings): `--model gpt` on the reverse task
    (docs/gpt.md), the model that pipeline parallelism splits, and the GPU benchmark's model.

    n_predict: logits for the last n positions only (None: every position). The reverse task's targets are the
    answer's tokens, so the prompt's positions get no logits, no loss and no head FLOPs.
    """

    def __init__(self, vocab: int = 8192, block_size: int = 256, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 256, *, n_predict: Optional[int] = None, dropout: float = 0.0):
        super().__init__()
        self.n_predict = n_predict
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's embedding scale: nn.Embedding draws N(0, 1), and a tied head of that size makes the untrained
        # logits huge (a first loss of 20-30 nats on 257 bytes, not ln 257 = 5.5). Scaling in place keeps the RNG
        # stream, so every other parameter gets the values it had before.
        with torch.no_grad():
            self.tok.weight.mul_(0.02)
            self.pos.weight.mul_(0.02)

    def forward(self, idx):  # (B, T) token ids -> (B, T, V) logits (T = n_predict when set)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    # forward's first and last parts, named so that a pipeline stage (manual_train/pipeline.py) runs the same code
    def embed(self, idx):  # (B, T) token ids -> (B, T, C)
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))

    def logits(self, x):  # (B, T, C) -> (B, n_predict or T, V)
        if self.n_predict is not None:
            x = x[:, -self.n_predict:]
        return self.head(self.ln_f(x))


CHECKPOINTED_MODELS = ("gpt", "resnet18")  # the models built of repeated blocks
# selective: the outputs of these ops are kept, everything between them (LayerNorm, GELU, softmax-free
# attention's bookkeeping, BatchNorm, ReLU, the residual adds) is recomputed in backward. They are the costly
# ops to redo (O(n^3) FLOPs against the O(n^2) of the element-wise rest), so most of the saving costs little time.
_SAVED_OPS = ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention")


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    saved = any(op is getattr(torch.ops.aten, name).default for name in _SAVED_OPS if hasattr(torch.ops.aten, name))
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


class Recomputed:
    """Mixin: forward runs under torch.utils.checkpoint (non-reentrant), activations recomputed in backward.

    Swapped in as the class of each block (`checkpoint_blocks`), so parameter names, state_dict and every caller
    (pipeline stages, DataParallel replicas) stay the same. Training mode only: evaluation saves nothing anyway.
    BatchNorm would update its running statistics twice (forward and recompute), so the recompute runs with momentum 0
    and no batch count (its running update is then `1 * running + 0 * batch`, bitwise the old value): the same
    output, the buffers updated once. (Cloning the buffers instead would be an extra op inside the recompute,
    which selective checkpointing refuses.)
    """

    checkpointing = "full"

    def forward(self, *args):
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(*args)
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        calls = []

        def run(*inputs):
            calls.append(None)
            if len(calls) == 1:
                return super(Recomputed, self).forward(*inputs)
            norms = [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            kept = [(m, m.momentum, m.num_batches_tracked) for m in norms]
            for m in norms:  # momentum 0: running = 1 * running + 0 * batch, bitwise; no count to add 1 to
                m.momentum, m.num_batches_tracked = 0.0, None
            try:
                return super(Recomputed, self).forward(*inputs)
            finally:
                for m, momentum, count in kept:
                    m.momentum, m.num_batches_tracked = momentum, count

        context = {"context_fn": lambda: create_selective_checkpoint_contexts(_keep_matmuls)}
        return checkpoint(run, *args, use_reentrant=False, **(context if self.checkpointing == "selective" else {}))


_RECOMPUTED: dict = {}


def checkpoint_blocks(blocks, mode: str) -> None:
    """--activation-checkpointing: each block of `blocks` recomputes its activations in backward (full) or all
    but its matmul and attention outputs (selective); "none" leaves them as they are."""
    for block in blocks if mode != "none" else ():
        cls = type(block)
        if cls not in _RECOMPUTED:
            _RECOMPUTED[cls] = type(f"Recomputed{cls.__name__}", (Recomputed, cls), {})
        block.__class__ = _RECOMPUTED[cls]
        block.checkpointing = mode


def build_model(name: str, info: DataInfo, dropout: float = 0.0, activation_checkpointing: str = "none") -> nn.Module:
    """The model called `name`, sized for the data in `info`; `dropout` (--dropout) for mlp, cnn and gpt;
    `activation_checkpointing` (--activation-checkpointing) for gpt and resnet18 (docs/levers.md)."""
    model = _build_model(name, info, dropout)
    if name in CHECKPOINTED_MODELS:
        checkpoint_blocks(blocks_of(name, model), activation_checkpointing)
    elif activation_checkpointing != "none":
        raise UsageError("--activation-checkpointing", f"--model {name} has no repeated blocks to checkpoint",
                         "none, or --model " + " or ".join(CHECKPOINTED_MODELS))
    return model


def blocks_of(name: str, model: nn.Module) -> list:
    """The repeated blocks of a CHECKPOINTED_MODELS model: the GPT's transformer blocks, resnet18's BasicBlocks."""
    if name == "gpt":
        return list(model.blocks)
    return [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]


def compile_model(name: str, model: nn.Module, mode: str) -> nn.Module:
    """--compile (docs/levers.md): torch.compile the whole model's forward ("model") or each block's ("blocks").

    In place (nn.Module.compile): the module and its parameter names stay the same, so state_dict, checkpoints,
    CastInputs and DDP see the plain model. Called before any wrapper, which is the order that captures graphs:
    torch.compile(DDP(model)) breaks the graph at DDP's forward. Nothing is compiled here; the first forward traces
    and compiles (tens of seconds on a CPU), and a new input shape or eval mode compiles again.
    """
    if mode == "model":
        model.compile()
    for block in blocks_of(name, model) if mode == "blocks" else ():
        compile_forward(block, fullgraph=True)
    return model


def compile_forward(module: nn.Module, fullgraph: bool = False) -> None:
    """torch.compile `module`'s forward, in place (an instance attribute; names and state_dict unchanged). Hooks
    that run around forward, such as FSDP2's all-gather and reshard, stay outside the graph. Every loop compiles
    blocks this way, so a block's graph is the same under single, DDP, FSDP2 and the pipeline (one cache entry)."""
    module.forward = torch.compile(module.forward, fullgraph=fullgraph)


def build_model_from(cfg, info: DataInfo) -> nn.Module:
    """build_model with the run's model flags (--model, --dropout, --activation-checkpointing, --compile): the
    loops' call, before any wrapper."""
    model = build_model(cfg.model, info, cfg.dropout, cfg.activation_checkpointing)
    # FSDP2, tensor parallelism and the pipeline's stages compile after sharding or splitting (their configs'
    # compile_after_wrapping: zero.compile_sharded, pipeline.Pipeline)
    return compile_model(cfg.model, model, "none" if cfg.compile_after_wrapping else cfg.compile)


def _build_model(name: str, info: DataInfo, dropout: float) -> nn.Module:
    if ":" in name:  # --model PACKAGE.MODULE:CALLABLE, your own (manual_train/plugins.py, docs/your-model.md)
        from manual_train import plugins

        return plugins.build_model(name, info)
    if name == "mlp":
        return MLP(info.input_shape, info.num_classes, dropout=dropout)
    if name == "cnn":
        return SmallCNN(info.input_shape[0], info.num_classes, dropout=dropout)
    if name == "resnet18":
        return resnet18(info.input_shape[0], info.num_classes)
    if name == "seq2seq":
        return Seq2Seq(info.num_classes)
    if name == "gpt":  # ~200k parameters: the reverse task in about a minute on 2 CPU cores (docs/gpt.md)
        return GPT(info.num_classes, block_size=info.input_shape[0], n_layer=GPT_LAYERS, n_head=4, n_embd=64,
                   n_predict=info.predict, dropout=dropout)
    raise ValueError(f"unknown model {name!r}")


IGNORE = -100  # a target that is none (a text's padding): F.cross_entropy's ignore_index


def loss_fn(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean cross-entropy over every target: (B, C) vs (B,) for images, (B, L, V) vs (B, L) for tokens (IGNORE: none);
    reduction="sum": their sum (evaluation's). A --loss of yours replaces it (plugins.build_loss)."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE, reduction=reduction)


def correct_count(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Number of correct predictions, as a device tensor (no host sync). Every training step calls it: eq_ writes
    into argmax's fresh int64 result instead of allocating a bool tensor (one allocation less per step)."""
    return logits.argmax(-1).eq_(y).sum()


def log_sums(losses: list, predictions: list, labels: list, device: torch.device) -> tuple:
    """A log row's sums from what the loop kept since the last row, on the device (no host sync): the micro-steps'
    detached, weighted losses summed (every micro-step adds one: never empty at a row), and their argmax predictions'
    matches with the labels (NaN without --train-acc). Two or three tensor ops per row instead of six per micro-step
    (docs/loop_overhead.md)."""
    loss_sum = torch.stack(losses).sum()
    if not predictions:
        return loss_sum, torch.full((), math.nan, device=device)
    flat = torch.cat([p.flatten() for p in predictions]), torch.cat([t.flatten() for t in labels])  # text: any length
    return loss_sum, flat[0].eq_(flat[1]).sum()


IMAGE_MODELS = ("mlp", "cnn", "resnet18")
TOKEN_MODELS = ("seq2seq", "gpt")  # inputs are int64 token ids
GPT_LAYERS = 4  # --model gpt's blocks: what --stages must divide (loops/pipeline.py)


def _forward_error(name: str, info: DataInfo, device: str):
    """The RuntimeError that one eval-mode forward of a single zero sample raises on `device`, or None."""
    try:
        with torch.device(device):
            model = build_model(name, info)
            x = torch.zeros((1, *info.input_shape), dtype=torch.int64 if name in TOKEN_MODELS else torch.float32)
        with torch.no_grad():
            model.eval()(x)
    except RuntimeError as e:
        return e
    return None


def _input_error(name: str, info: DataInfo):
    """Shape inference on the meta device (no memory, no arithmetic); what fails there is confirmed by a real
    forward on the CPU, so an operator without a meta kernel never refuses a model that runs."""
    return _forward_error(name, info, "meta") and _forward_error(name, info, "cpu")


def check_input_fits(name: str, info: DataInfo, flag: str = "--synthetic-shape") -> None:
    """Refuse, as one UsageError line naming `flag`, a model that cannot run on samples of info.input_shape
    (cnn's 2x2 max-pool on a 1x1 image): before the banner, not a traceback at the first step.

    Builds throwaway copies of the model inside torch.random.fork_rng, so the global RNG is left exactly as it
    was: the loops' torch.manual_seed(seed) right before build_model keeps giving the same initial weights.
    """
    with torch.random.fork_rng(devices=[]):
        error = _input_error(name, info)
        if error is None:
            return
        shape = ",".join(map(str, info.input_shape))
        what, allowed = f"{shape} does not fit --model {name}", None
        if len(info.input_shape) == 3 and name in IMAGE_MODELS:  # images: say what would run instead
            c, h, w = info.input_shape
            side = next((s for s in range(1, 65)
                         if _input_error(name, DataInfo(info.name, (c, s, s), info.num_classes)) is None), None)
            others = [m for m in IMAGE_MODELS if m != name and _input_error(m, info) is None]
            if side is not None and min(h, w) < side:
                what = f"{shape} is too small for --model {name}"
            hints = ([f"H and W >= {side} for --model {name}"] if side is not None else [])
            hints += [f"--model {m}" for m in others]
            allowed = ", or ".join(hints) or None
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise UsageError(flag, f"{what} (one forward pass fails: {reason})", allowed)
