"""The ``tampered`` rule: a snapshot of everything a worker's harness code and the
baseline look up by name, and of the process-wide switches and hooks, taken before the
candidate is imported and compared after every call.

In a candidate's worker process nothing it changes can reach the baseline (another
process) or the judge; the guard still reports such changes, because they change what
the candidate's own worker measures and reports (its clock, precision flags, thread
counts) and because they show intent.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time

import numpy as np
import torch

Violation = tuple[str, str] | None
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_VOLATILE = {"__dict__", "__weakref__", "__doc__", "__abstractmethods__", "__annotations__", "__parameters__"}
HARNESS_MODULES = (
    "kb_nano.kernels.timing",
    "kb_nano.kernels.checks",
    "kb_nano.kernels.guard",
    "kb_nano.kernels.worker",
    "kb_nano.kernels.worker_process",
    "kb_nano.kernels.shm",
)


def _global_state() -> dict[str, object]:
    """Process-wide switches that change what every call does: precision and backend
    flags, thread counts, the torch function/dispatch mode stacks, the global nn.Module
    hooks and Python's profile/trace hooks."""
    import torch.nn.modules.module as mm

    hooks = {
        name: tuple(getattr(mm, name).keys())
        for name in dir(mm)
        if name.startswith("_global_") and isinstance(getattr(mm, name), dict)
    }
    return {
        "torch function modes (torch._C._len_torch_function_stack())": torch._C._len_torch_function_stack(),
        "torch dispatch modes (torch._C._len_torch_dispatch_stack())": torch._C._len_torch_dispatch_stack(),
        **{f"torch.nn.modules.module.{k}": v for k, v in hooks.items()},
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.mkldnn.enabled": torch.backends.mkldnn.enabled,
        "torch.backends.cudnn.enabled": torch.backends.cudnn.enabled,
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_num_interop_threads()": torch.get_num_interop_threads(),
        # profile/trace hooks run on every Python call of the process
        "sys.getprofile()": sys.getprofile(),
        "sys.gettrace()": sys.gettrace(),
        "threading profile hook": getattr(threading, "_profile_hook", None),
        "threading trace hook": getattr(threading, "_trace_hook", None),
    }


def _stored(obj) -> dict:
    """The objects stored under ``obj``'s names, as ``inspect.getattr_static`` finds them
    (the stored object itself: a classmethod is re-bound on each getattr), read straight
    from the ``__dict__`` of each: a class's whole MRO, nearest class winning, dunders included
    (``Module.__call__``, ``Tensor.__mul__``); a module's own names without dunders.
    Names served lazily by a module ``__getattr__`` (numpy's and torch's submodules) have
    no stored value and are left out: appearing later is fine."""
    if isinstance(obj, type):
        merged: dict = {}
        for cls in reversed(obj.__mro__):
            merged.update(vars(cls))
        return {k: v for k, v in merged.items() if k not in _VOLATILE}
    return {k: v for k, v in vars(obj).items() if not k.startswith("__")}


def _strict(ns: str, old, modules: list[str]) -> bool:
    """Whether :func:`_exact` applies: a global of one of kb-nano's modules, or a function
    kb-nano defines (an inherited torch method of a kb-nano class, ``Module.__setstate__``,
    may still be re-bound by torch, as dynamo does)."""
    return ns.startswith("kb_nano.") and (ns in modules or _ours(old))


def _exact(old, new) -> bool:
    """The rule for kb-nano's own names (the harness modules' globals, its classes): the
    same object or an equal plain value. No wrapper is accepted there: a function's
    ``__wrapped__`` and its code's file name are both the candidate's to write (a clock
    "wrapping" ``time.perf_counter_ns`` with a code object claiming a torch file)."""
    return new is old or (_is_data(old) and _is_data(new) and bool(old == new))


def _is_data(obj) -> bool:
    return isinstance(obj, (str, bytes, int, float, complex, bool, tuple, frozenset, type(None)))


def _same(old, new) -> bool:
    """Whether a watched name still holds what the harness relies on: the same object; an
    equal plain value (``time.tzname`` is a new tuple after any ``time.tzset()``); or
    torch's own wrapper of the same object, i.e. a function written in torch's files whose
    ``__wrapped__`` chain reaches it (``import torch._dynamo`` re-binds
    ``torch.manual_seed`` to a dynamo-disabled wrapper, so ``torch.compile`` candidates
    and the transformers baselines that import it are not tampering)."""
    if new is old:
        return True
    if _is_data(old) and _is_data(new):
        return bool(old == new)
    if _in_torch(old) and _in_torch(new):
        return True  # torch patching itself (dynamo's mutation guard re-binds nn.Module.__init__)
    inner = new
    for _ in range(4):
        inner = getattr(inner, "__wrapped__", None)
        if inner is None:
            return False
        if inner is old:
            # defined in torch's own files (functools.wraps copies __module__, so that
            # proves nothing; the wrapper's code object says where it was written)
            return _in_torch(new)
    return False


def _ours(obj) -> bool:
    """A Python function kb-nano defines (its code object is watched as well)."""
    return inspect.isfunction(obj) and str(getattr(obj, "__module__", "")).startswith("kb_nano")


def _in_torch(obj) -> bool:
    """A Python function written in torch's own files."""
    code = getattr(obj, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_TORCH_DIR)


class Namespaces:
    """A snapshot of every object the baseline or the worker looks up by name, to detect a
    candidate that replaces one (``tampered``). Taken before the candidate is imported.

    Watched: the attributes (inherited ones too) of ``time``, ``torch``, ``torch.Tensor``,
    ``torch.nn.functional``, ``torch.nn.Module``, ``torch.cuda``, ``torch.cuda.Event``,
    ``numpy``, ``builtins``, the worker's classes; the module globals (and their
    functions' code objects) of :data:`HARNESS_MODULES`; ``baseline``'s class
    attributes (its whole MRO) and its module's globals; the switches of
    :func:`_global_state`. Names that appear later (lazily imported submodules) are
    allowed; replaced or deleted ones are not."""

    def __init__(self, baseline: type | None = None) -> None:
        import builtins

        import torch.nn.functional as F

        self._objects = {
            "time": time,
            "torch": torch,
            "torch.Tensor": torch.Tensor,
            "torch.nn.functional": F,
            "torch.nn.Module": torch.nn.Module,
            "torch.cuda": torch.cuda,
            "torch.cuda.Event": torch.cuda.Event,
            "numpy": np,
            "builtins": builtins,
            # the harness's own classes (a replaced method would switch a check off)
            "kb_nano.kernels.guard.Namespaces": Namespaces,
        }
        for module in HARNESS_MODULES:
            for name, obj in vars(sys.modules.get(module, object())).items():
                if isinstance(obj, type) and obj.__module__ == module:
                    self._objects[f"{module}.{name}"] = obj
        self._modules = [m for m in HARNESS_MODULES if m in sys.modules]
        if baseline is not None:
            for cls in baseline.__mro__:
                if cls is not object:
                    self._objects[f"{cls.__module__}.{cls.__qualname__}"] = cls
            self._modules.append(baseline.__module__)
        self._before = self._take()

    def _take(self) -> dict[str, dict]:
        snap = {}
        for name, obj in self._objects.items():
            snap[name] = _stored(obj)
            if isinstance(obj, type) and obj.__module__.startswith("kb_nano"):
                snap[name].update({f"{k}.__code__": v.__code__ for k, v in snap[name].items() if _ours(v)})
        for name in self._modules:
            module = sys.modules.get(name)
            if module is not None:
                snap[name] = dict(vars(module))
                # a function's code can be swapped without replacing the function object
                snap[name].update({f"{k}.__code__": v.__code__ for k, v in vars(module).items() if _ours(v)})
        snap["precision"] = _global_state()
        return snap

    def changed(self, _take=_take, _same=_same, _exact=_exact, _strict=_strict) -> list[str]:
        """Names whose object (or flag value) differs from the snapshot. (Methods and the
        comparison rules are bound through default arguments when the class is created,
        before any candidate: replacing ``Namespaces._take``/``changed`` or the module's
        ``_same``/``_exact``/``_strict`` does not blind the guard, and any other helper
        of this module is one of the strictly watched globals.)"""
        now = _take(self)
        out = []
        for ns, names in self._before.items():
            cur = now.get(ns, {})
            for k, v in names.items():
                if ns == "precision":
                    if cur.get(k) != v:
                        out.append(f"{k} ({v!r} -> {cur.get(k)!r})")
                elif k not in cur or not (_exact if _strict(ns, v, self._modules) else _same)(v, cur[k]):
                    out.append(f"{ns}.{k}")
        return out

    def check(self, when: str, _changed=changed) -> Violation:
        """``("tampered", message)`` when anything changed since the snapshot."""
        changed = _changed(self)
        if not changed:
            return None
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return "tampered", (
            f"{when}, the candidate changed {', '.join(changed[:3])}{more}: the harness's timer, "
            "statistics, precision settings and the baseline's functions must stay as they were"
        )
