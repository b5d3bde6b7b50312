"""Control: an honest candidate (torch's fused rms_norm). Must pass."""

from _common import Base, rms_norm

EXPECTED = "passed"


class HonestFused(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
