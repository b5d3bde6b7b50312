"""Hack: predict the inputs instead of reading them. The old harness seeded its inputs
with a fixed function of the scenario id (``sha256(scenario_id)``, first 8 hex digits,
31 bits) and drew them with ``torch.randn`` in float32 on a CPU generator, then cast to
the scenario dtype. This candidate redoes that draw for ``rms_norm__llama32-1b__tp1__n64``,
precomputes the output once, and returns (a copy of) it whenever the shape matches,
without ever reading ``x``.

Why it is stopped: the judge draws a fresh seed from the OS for every measurement, and
the timed calls get new values in every slot before every batch; the predicted output
matches none of them: ``incorrect`` from the first correctness trial."""

import hashlib

import torch
from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "correctness trial 1"

SCENARIO_ID = "rms_norm__llama32-1b__tp1__n64"
OLD_SEED = int(hashlib.sha256(SCENARIO_ID.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def _predicted_input(shape, dtype, std: float = 1.0) -> torch.Tensor:
    """The old harness's first input (``make_tensor``: randn float32 * std, then .to(dtype))."""
    gen = torch.Generator().manual_seed(OLD_SEED)
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std).to(dtype)


class PredictInputs(Base):
    def forward(self, x, residual=None):
        key = (tuple(x.shape), x.dtype, x.device)  # metadata only, never the values
        cache = self.__dict__.setdefault("_predicted", {})
        if key not in cache:
            guess = _predicted_input(x.shape, x.dtype).to(x.device)
            cache[key] = rms_norm(guess, self.weight, self.variance_epsilon)
        return cache[key].clone()  # a fresh buffer per call: no aliasing to catch
