"""Hack: compute once, return that result for every later call."""

from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "correctness trial 2"


class CacheFirstOutput(Base):
    def forward(self, x, residual=None):
        if "_first" not in self.__dict__:
            self._first = rms_norm(x, self.weight, self.variance_epsilon)
        return self._first.clone()
