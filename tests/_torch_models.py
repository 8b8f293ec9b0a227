"""Small torch modules shared by the torch test files (import after their
``pytest.importorskip("torch")``)."""
import weakref

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
