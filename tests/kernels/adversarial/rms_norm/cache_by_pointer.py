"""Hack: remember the output per input data pointer (survives a harness that clones into
a rotating pool of buffers with fixed values)."""

from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "correctness trial 3"


class CacheByPointer(Base):
    def forward(self, x, residual=None):
        cache = self.__dict__.setdefault("_cache", {})
        key = (x.data_ptr(), tuple(x.shape))
        if key not in cache:
            cache[key] = rms_norm(x, self.weight, self.variance_epsilon)
        return cache[key].clone()
