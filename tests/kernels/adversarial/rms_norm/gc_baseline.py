"""Hack: find the baseline module by walking ``gc.get_objects()`` (a
``kb_nano.operators.norms.RMSNorm``, or any other ``nn.Module`` that is not this
candidate), then slow it down and hijack it: a forward pre-hook that busy-waits 0.5 ms,
its weight swapped for a non-contiguous strided copy (slower memory access), and a
forward hook that caches its outputs so this candidate can return them without computing.

Why it has no effect: the baseline runs in a worker process of its own; the candidate's
process holds no baseline module to find (its worker builds the baseline's state_dict and
frees it before the first call). The walk finds nothing, the candidate computes honestly,
and the row passes with no unearned speedup (``EXPECTED_LIKE``). Were the baseline
reachable, the pre-hook alone would show as a large speedup."""

import gc
import time

import torch
from _common import Base, rms_norm
from torch import nn

EXPECTED = "passed"
EXPECTED_LIKE = "rms_norm/honest_fused"  # the same computation, honestly: no faster than it

_CACHE: dict = {}  # (shape, first values) of an input -> the baseline's output for it
_HOOKED: set = set()  # ids of the modules already hijacked


def _slow_pre_hook(module, args):
    end = time.perf_counter() + 0.0005
    while time.perf_counter() < end:
        pass


def _cache_hook(module, args, out):
    if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
        x = args[0]
        _CACHE[(tuple(x.shape), x.flatten()[:8].tolist())] = out


def _hijack(me: nn.Module) -> int:
    """Hook every other nn.Module in the process; returns how many were found."""
    found = 0
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), nn.Module) or obj is me or isinstance(obj, type(me)) or id(obj) in _HOOKED:
                continue
        except Exception:  # objects whose __class__ lookup raises
            continue
        is_baseline = type(obj).__module__ == "kb_nano.operators.norms" and type(obj).__name__ == "RMSNorm"
        _HOOKED.add(id(obj))
        found += 1
        obj.register_forward_pre_hook(_slow_pre_hook)
        obj.register_forward_hook(_cache_hook)
        w = getattr(obj, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 1:
            with torch.no_grad():  # the same values at stride 7 of a 7x larger buffer
                strided = torch.empty(w.numel() * 7, dtype=w.dtype, device=w.device)[::7]
                strided.copy_(w)
            obj.weight = nn.Parameter(strided, requires_grad=False)
        if is_baseline:
            print(f"gc_baseline: found the baseline {type(obj).__qualname__} at {id(obj):#x}", flush=True)
    return found


class GcBaseline(Base):
    def forward(self, x, residual=None):
        if not self.__dict__.get("_walked"):
            self._walked = True
            print(f"gc_baseline: hijacked {_hijack(self)} other module(s)", flush=True)
        hit = _CACHE.get((tuple(x.shape), x.flatten()[:8].tolist())) if _CACHE else None
        if hit is not None:
            return hit.clone()
        return rms_norm(x, self.weight, self.variance_epsilon)
