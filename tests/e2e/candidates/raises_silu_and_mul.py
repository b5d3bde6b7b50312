"""A silu_and_mul that raises inside the engine (on its first forward call)."""

from torch import nn


class RaisingSiluAndMul(nn.Module):
    def forward(self, x):
        raise RuntimeError("kb-nano test: deliberate failure inside the engine")
