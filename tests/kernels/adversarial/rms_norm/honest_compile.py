"""Control: the reference computation wrapped in ``torch.compile`` (the CPU Inductor
backend: it generates C++ and compiles it with the host's C compiler, caching under the
candidate's own cache directory). The first call compiles (measured on a 2-core CPU:
~13 s with a cold cache, ~5.5 s with a warm one); later calls run the generated kernel.
Importing ``torch._dynamo`` re-binds some torch functions to torch's own wrappers, which
the guard accepts. Must pass."""

import torch
from _common import Base, rms_norm

EXPECTED = "passed"

_compiled = torch.compile(rms_norm, dynamic=False)


class HonestCompile(Base):
    def forward(self, x, residual=None):
        return _compiled(x, self.weight, self.variance_epsilon)
