"""Small torch modules shared by the torch test files (import after their
``pytest.importorskip("torch")``)."""
import weakref

import torch
from torch import nn


class SoftmaxRecorded(nn.Module):
    """Linear then softmax, whose backward saves its own output; keeps a weak
    reference to every output it makes (``outputs``), to see which outlive a
    step: a graph kept alive by a reference cycle keeps them."""

    def __init__(self):
        super().__init__()
        self.lin, self.outputs = nn.Linear(8, 8), []

    def forward(self, x):
        y = self.lin(x).softmax(-1)
        self.outputs.append(weakref.ref(y))
        return y


class Shared(nn.Module):
    """What the blocks of a model share outside their activations (T5 computes
    its position bias in the first block and hands it to the others)."""


class BiasFirst(nn.Module):
    """Makes a learned bias (with autograd history) and hands it on through
    ``ctx``, or a mask without history (``history=False``)."""

    def __init__(self, ctx, d, history=True):
        super().__init__()
        self.ctx, self.history = ctx, history
        self.pos = nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.lin = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, h):
        self.ctx.bias = (self.pos.expand(h.shape[0], -1) if self.history
                         else (h > 0).to(h.dtype))
        return self.lin(h)


class BiasReader(nn.Module):
    def __init__(self, ctx, d):
        super().__init__()
        self.ctx = ctx
        self.lin = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, h):
        return torch.tanh(self.lin(h) + self.ctx.bias)


def bias_model(history=True, holder=Shared):
    """Stage 0 makes the bias, stages 1 and 2 read it from ``ctx``: a submodule
    of every stage (``holder=Shared``), or a plain object (``types.SimpleNamespace``),
    which the stages' module state does not show."""
    ctx = holder()
    return [BiasFirst(ctx, 6, history), BiasReader(ctx, 6), BiasReader(ctx, 6)]
