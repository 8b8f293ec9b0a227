"""Reference models written as sequences of blocks, for the demo, tests and benches.

Each builder returns an ``nn.Sequential`` whose children are the chain's stages
(rotor-style: a stage may be a whole transformer or residual block) and a loss
function ``loss_fn(output, target) -> scalar``. They mirror the analytic chains
of :mod:`rtmem.planners.profiles` (same structure, same names). Weight counts
too, with one switch: :func:`~rtmem.planners.profiles.gpt2` counts GPT-2's LM
head as tied to the token embedding, as ``gpt2_model(tie_weights=True)`` builds
it; the default untied head has ``vocab x hidden`` parameters more (163M instead
of GPT-2 small's 124M).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Set

import torch
import torch.nn.functional as F
from torch import nn

from rtmem.planners._validation import check_int

__all__ = ["gpt2_model", "resnet_model", "GPTEmbedding", "GPTBlock", "GPTHead",
           "BasicBlock", "Bottleneck"]


def _check_ints(*checks) -> None:
    """Each ``(name, value, low)``: ``value`` must be an integer >= ``low``
    (ValueError otherwise)."""
    for name, value, low in checks:
        check_int(name, value, low=low, error=ValueError)


def _check_dropout(dropout) -> None:
    """``dropout`` must be a real number in [0, 1) (ValueError otherwise): a
    string failed in a comparison with a bare TypeError, and 1 drops everything."""
    if (isinstance(dropout, bool) or not isinstance(dropout, numbers.Real)
            or not 0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")


class GPTEmbedding(nn.Module):
    """Token + learned position embedding, then dropout: (batch, seq) int64 ->
    (batch, seq, hidden). ``seq`` is the most tokens per sequence it takes (one
    learned position each); a longer input raises ValueError."""

    def __init__(self, vocab: int, hidden: int, seq: int, dropout: float = 0.0):
        super().__init__()
        _check_ints(("vocab", vocab, 1), ("hidden", hidden, 1), ("seq", seq, 1))
        _check_dropout(dropout)
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        if idx.dim() != 2:
            raise ValueError(f"GPTEmbedding takes token ids of shape (batch, seq), got a "
                             f"tensor of shape {tuple(idx.shape)}; add the batch dimension "
                             f"(idx.unsqueeze(0)) or flatten the extra ones")
        seq = self.pos.num_embeddings
        if idx.shape[1] > seq:
            # the position table has seq rows: torch said only "index out of range"
            raise ValueError(f"got sequences of {idx.shape[1]} tokens, more than seq = {seq} "
                             f"positions the model was built with; build it with seq >= "
                             f"{idx.shape[1]} (gpt2_model(seq=...)) or pass at most {seq} "
                             f"tokens per sequence")
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class GPTBlock(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention and a 4x MLP, both residual."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        _check_ints(("hidden", hidden, 1), ("heads", heads, 1))
        _check_dropout(dropout)
        if hidden % heads:
            raise ValueError(f"hidden = {hidden} must be a multiple of heads = {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = F.dropout(att.masked_fill(~mask, float("-inf")).softmax(-1), self.p,
                        self.training)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPTHead(nn.Module):
    """Final LayerNorm and the language-model head: -> (batch, seq, vocab) logits.
    The head's ``out.weight`` (vocab, hidden) is its own; :func:`gpt2_model`
    with ``tie_weights=True`` replaces it with the embedding's ``tok.weight``."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        _check_ints(("hidden", hidden, 1), ("vocab", vocab, 1))
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def _lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def gpt2_model(layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 32,
               vocab: int = 128, dropout: float = 0.0, tie_weights: bool = False):
    """A GPT-2-style model as ``nn.Sequential(embedding, block * layers, head)``.

    ``tie_weights=True`` ties the LM head's weight to the token embedding, as
    GPT-2 does: one (vocab, hidden) parameter used by the first and the last
    stage, initialised as GPT-2's (normal, std 0.02; ``nn.Embedding``'s std 1
    made the initial logits' std about sqrt(hidden)). Its parameter count is
    the weight count of :func:`rtmem.planners.profiles.gpt2` at the same sizes
    (``weight_bytes`` per parameter). A schedule may not move (``w_offload``,
    ``w_delete``) the weights of those two stages (NOTE [ Executor ] rule 5).
    The default, untied, gives the head a (vocab, hidden) matrix of its own.

    Returns ``(model, loss_fn, make_batch)`` where ``make_batch(batch, generator)``
    draws random token ids and next-token targets (int64 tensors of shape
    (batch, seq)).
    """
    _check_ints(("layers", layers, 0), ("hidden", hidden, 1), ("heads", heads, 1),
                ("seq", seq, 1), ("vocab", vocab, 1))
    if hidden % heads:
        raise ValueError(f"hidden = {hidden} must be a multiple of heads = {heads}")
    _check_dropout(dropout)
    if not isinstance(tie_weights, bool):
        raise ValueError(f"tie_weights must be True or False, got {tie_weights!r}")
    model = nn.Sequential(GPTEmbedding(vocab, hidden, seq, dropout),
                          *[GPTBlock(hidden, heads, dropout) for _ in range(layers)],
                          GPTHead(hidden, vocab))
    if tie_weights:
        # drawn last, so every other parameter is the untied model's for one seed
        nn.init.normal_(model[0].tok.weight, std=0.02)
        model[-1].out.weight = model[0].tok.weight

    def make_batch(batch: int, generator=None, device="cpu"):
        tokens = torch.randint(vocab, (batch, seq + 1), generator=generator)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    return model, _lm_loss, make_batch


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        _check_ints(("c_in", c_in, 1), ("c_out", c_out, 1), ("stride", stride, 1))
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True), nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c_out))
        self.short = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return F.relu(self.body(x) + self.short(x))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 (4x wider) convolutions with a residual connection."""

    def __init__(self, c_in: int, width: int, stride: int = 1):
        super().__init__()
        _check_ints(("c_in", c_in, 1), ("width", width, 1), ("stride", stride, 1))
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(True), nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.short = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return F.relu(self.body(x) + self.short(x))


def resnet_model(blocks=(1, 1), width: int = 8, bottleneck: bool = False,
                 image: int = 32, classes: int = 10):
    """A ResNet-style CNN as ``nn.Sequential(stem, block, ..., head)``.

    ``blocks[g]`` residual blocks in group ``g`` (the first of each group after the
    first downsamples by 2), base width ``width`` doubling per group. Returns
    ``(model, loss_fn, make_batch)``; ``make_batch(batch, generator)`` draws
    images (batch, 3, image, image) and class labels.
    """
    # a dict or a set iterates its keys, unordered: {1: 2} built one group of one block
    if (isinstance(blocks, (str, bytes, Mapping, Set)) or not hasattr(blocks, "__len__")
            or not len(blocks)):
        raise ValueError(f"blocks must be a non-empty sequence of block counts per group, "
                         f"e.g. (2, 2), got {blocks!r}")
    _check_ints(*((f"blocks[{g}]", n, 1) for g, n in enumerate(blocks)),
                ("width", width, 1), ("image", image, 1), ("classes", classes, 1))
    if not isinstance(bottleneck, bool):
        raise ValueError(f"bottleneck must be True or False, got {bottleneck!r}")
    stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(True))
    stages, c_in = [stem], width
    for g, n in enumerate(blocks):
        w = width * 2**g
        for k in range(n):
            stride = 2 if (k == 0 and g > 0) else 1
            if bottleneck:
                stages.append(Bottleneck(c_in, w, stride))
                c_in = 4 * w
            else:
                stages.append(BasicBlock(c_in, w, stride))
                c_in = w
    stages.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)))
    model = nn.Sequential(*stages)

    def make_batch(batch: int, generator=None, device="cpu"):
        x = torch.randn(batch, 3, image, image, generator=generator)
        y = torch.randint(classes, (batch,), generator=generator)
        return x.to(device), y.to(device)

    return model, F.cross_entropy, make_batch
