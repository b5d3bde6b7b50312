"""Control: splits the rows over a thread pool and waits for every part before returning.
Its pool threads stay alive but idle between calls. Must pass."""

from concurrent.futures import ThreadPoolExecutor

import torch
from _common import Base, rms_norm

EXPECTED = "passed"


class HonestThreadPool(Base):
    def forward(self, x, residual=None):
        pool = self.__dict__.setdefault("_pool", ThreadPoolExecutor(max_workers=2, thread_name_prefix="honest"))
        out = torch.empty_like(x)
        half = (x.shape[0] + 1) // 2

        def part(rows):
            with torch.inference_mode():  # thread-local: the harness (like vLLM) runs calls in it
                out[rows].copy_(rms_norm(x[rows], self.weight, self.variance_epsilon))

        list(pool.map(part, [slice(0, half), slice(half, None)]))
        return out
