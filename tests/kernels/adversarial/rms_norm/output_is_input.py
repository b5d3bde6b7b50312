"""Hack: normalise in place and return the input tensor (rms_norm's contract does not
allow writing x)."""

from _common import Base, rms_norm

EXPECTED = "output_aliased"
EXPECTED_ERROR = "shares memory with input 'x'"


class OutputIsInput(Base):
    def forward(self, x, residual=None):
        return x.copy_(rms_norm(x, self.weight, self.variance_epsilon))
