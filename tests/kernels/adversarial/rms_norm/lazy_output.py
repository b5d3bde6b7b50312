"""Hack: return a tensor subclass that computes only when someone reads it, so the timed
call only builds a promise."""

import torch
from _common import Base, rms_norm

EXPECTED = "invalid_output"
EXPECTED_ERROR = "torch.Tensor subclass"


class LazyTensor(torch.Tensor):
    """Holds uninitialised memory and a thunk; the first torch function that touches it
    runs the thunk and fills the memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, LazyTensor) and a.__dict__.get("_thunk") is not None:
                thunk, a._thunk = a._thunk, None
                with torch._C.DisableTorchFunctionSubclass():
                    a.copy_(thunk())
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class LazyOutput(Base):
    def forward(self, x, residual=None):
        out = torch.Tensor._make_subclass(LazyTensor, torch.empty_like(x))
        xs, w, eps = x.clone(), self.weight, self.variance_epsilon
        out._thunk = lambda: rms_norm(xs, w, eps)
        return out
