"""Hack: remember the output per input tensor object; a harness that times the same
tensor over and over measures a dictionary lookup."""

from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "correctness trial 3"


class CacheByIdentity(Base):
    def forward(self, x, residual=None):
        cache = self.__dict__.setdefault("_cache", {})
        if id(x) not in cache:
            cache[id(x)] = rms_norm(x, self.weight, self.variance_epsilon)
        return cache[id(x)].clone()
