"""Anti-cheat rules of a Tier-1 measurement (issue 7). Each rule returns ``None`` when
the candidate complies, else ``(status, message)``; :func:`kb_nano.bench.measure` turns
the first violation into the row.

=================  ==================================================================
status             rule
=================  ==================================================================
``tampered``       the candidate replaced a function or flag the harness or the baseline
                   relies on: ``time``, ``torch``, ``torch.Tensor``,
                   ``torch.nn.functional``, ``torch.cuda`` (``Event``, ``synchronize``),
                   numpy's statistics, kb-nano's timing/check modules, or the TF32 /
                   matmul-precision settings (:class:`Namespaces`). Checked after import,
                   after every correctness trial, after the timing loop and at the end.
``invalid_output`` an output is not a plain dense tensor: a ``torch.Tensor`` subclass (a
                   lazy or wrapper tensor that computes on access), a non-strided layout
                   (sparse), a lazily conjugated/negated view, or on another device
                   (:func:`invalid_outputs`).
``output_aliased`` an output shares memory with an input the operator's contract does not
                   let it write, with another output, or with an output of the previous
                   call (a reused static buffer) (:func:`aliased_outputs`).
``input_mutated``  an input the contract does not let the operator write changed during
                   the call (:func:`mutated_inputs`; contract:
                   ``Operator.mutable_inputs``, e.g. ``fused_add_rms_norm`` may write
                   ``x`` and ``residual`` as vLLM's kernel does).
``unsynced_work``  work the call left running after it returned, so the timing missed
                   it: the output changed after the call returned
                   (:func:`changed_after_return`), a Python thread it left running used
                   CPU or finished afterwards (:class:`ThreadWatch`), or on CUDA the
                   device-wide timing exceeds the event timing
                   (:func:`kb_nano.timing.hidden_work_ms`).
=================  ==================================================================

Caching on input identity, pointer or content is defeated by fresh input values (the
second and later correctness trials reuse the first trial's buffers with new values; the
timing loop writes new values before every call) and fails as ``incorrect``; so does a
candidate that is right at first and wrong after the timing loop (the check is repeated
after it). Limits (documented in the README): candidates run in the harness's process,
so a candidate that edits the harness's memory through ``ctypes``/``gc`` or starts native
threads is outside what these rules see.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time

import numpy as np
import torch

from kb_nano import timing

Violation = tuple[str, str] | None
_MISSING = object()
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_VOLATILE = {"__dict__", "__weakref__", "__doc__", "__abstractmethods__", "__annotations__", "__parameters__"}


def flatten_outputs(out) -> list:
    """A call's outputs as a list (a tensor, or a tuple/list of tensors and None)."""
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def _global_state() -> dict[str, object]:
    """Process-wide switches that change what every call does: precision flags, the
    torch function/dispatch mode stacks, and the global nn.Module hooks (a candidate can
    slow the baseline down through any of them)."""
    import torch.nn.modules.module as mm

    hooks = {name: tuple(getattr(mm, name).keys()) for name in dir(mm)
             if name.startswith("_global_") and isinstance(getattr(mm, name), dict)}
    return {
        "torch function modes (torch._C._len_torch_function_stack())": torch._C._len_torch_function_stack(),
        "torch dispatch modes (torch._C._len_torch_dispatch_stack())": torch._C._len_torch_dispatch_stack(),
        **{f"torch.nn.modules.module.{k}": v for k, v in hooks.items()},
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    }


class Namespaces:
    """A snapshot of every object a baseline or the harness looks up by name, to detect a
    candidate that replaces one (``tampered``). Taken before the candidate is imported.

    Watched: the attributes (inherited ones too) of ``time``, ``torch``, ``torch.Tensor``,
    ``torch.nn.functional``, ``torch.nn.Module``, ``torch.cuda``, ``torch.cuda.Event``,
    ``numpy``, ``builtins``, the harness's check classes; the module globals (and their
    functions' code objects) of :mod:`kb_nano.timing`, :mod:`kb_nano.checks`,
    :mod:`kb_nano.bench`, :mod:`kb_nano.roofline`, :mod:`kb_nano.schema`; ``baseline``'s
    class attributes (its whole MRO) and its module's globals; the TF32 /
    matmul-precision flags, the torch function and dispatch mode stacks and the global
    ``nn.Module`` hooks. Names that appear later (lazily imported submodules) are
    allowed; replaced or deleted ones are not."""

    def __init__(self, baseline: type | None = None) -> None:
        import torch.nn.functional as F

        import builtins

        from kb_nano import bench

        self._objects = {
            "time": time, "torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": F,
            "torch.nn.Module": torch.nn.Module, "torch.cuda": torch.cuda, "torch.cuda.Event": torch.cuda.Event,
            "numpy": np, "builtins": builtins,
            # the harness's own classes (a replaced method would switch a check off)
            "kb_nano.checks.Namespaces": Namespaces, "kb_nano.checks.ThreadWatch": ThreadWatch,
            "kb_nano.bench._Trial": bench._Trial, "kb_nano.bench._SampledCalls": bench._SampledCalls,
        }
        self._modules = ["kb_nano.timing", "kb_nano.checks", "kb_nano.bench", "kb_nano.roofline", "kb_nano.schema"]
        if baseline is not None:
            for cls in baseline.__mro__:
                if cls is not object:
                    self._objects[f"{cls.__module__}.{cls.__qualname__}"] = cls
            self._modules.append(baseline.__module__)
        self._before = self._take()

    def _take(self) -> dict[str, dict]:
        snap = {}
        for name, obj in self._objects.items():
            # getattr_static: the stored object itself (a classmethod is re-bound on each
            # getattr). Classes: dunders too (Module.__call__, Tensor.__mul__).
            keep = (lambda k: k not in _VOLATILE) if isinstance(obj, type) else (lambda k: not k.startswith("__"))
            # Names dir() lists without a stored value (numpy's and torch's lazily imported
            # submodules, served by a module __getattr__) are left out: appearing later is fine.
            values = {k: inspect.getattr_static(obj, k, _MISSING) for k in dir(obj) if keep(k)}
            snap[name] = {k: v for k, v in values.items() if v is not _MISSING}
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

    def changed(self, _take=_take) -> list[str]:
        """Names whose object (or flag value) differs from the snapshot. (Methods are
        bound through default arguments when the class is created, before any
        candidate: replacing ``Namespaces._take``/``changed`` does not blind the guard.)"""
        now = _take(self)
        out = []
        for ns, names in self._before.items():
            cur = now.get(ns, {})
            for k, v in names.items():
                if ns == "precision":
                    if cur.get(k) != v:
                        out.append(f"{k} ({v!r} -> {cur.get(k)!r})")
                elif k not in cur or not _same(v, cur[k]):
                    out.append(f"{ns}.{k}")
        return out

    def check(self, when: str, _changed=changed) -> Violation:
        """``("tampered", message)`` when anything changed since the snapshot."""
        changed = _changed(self)
        if not changed:
            return None
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return "tampered", (f"{when}, the candidate changed {', '.join(changed[:3])}{more}: the harness's timer, "
                            "statistics, precision settings and the baseline's functions must stay as they were")


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


def invalid_outputs(out, device: torch.device) -> Violation:
    """``invalid_output`` when an output is not a plain dense ``torch.Tensor`` on
    ``device`` (subclass, sparse or other non-strided layout, lazy conj/neg bit, meta
    tensor). Must run before anything reads the output's values, which would let a lazy
    tensor compute then."""
    for i, o in enumerate(flatten_outputs(out)):
        if o is None:
            continue
        if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor:
            return "invalid_output", f"output {i} is a {type(o).__module__}.{type(o).__qualname__}, a torch.Tensor subclass; return plain dense tensors"
        if not isinstance(o, torch.Tensor):
            continue  # compare() reports non-tensor outputs as incorrect_shape
        if o.layout != torch.strided:
            return "invalid_output", f"output {i} has layout {o.layout}; return a dense (strided) tensor"
        if o.is_conj() or o.is_neg():
            return "invalid_output", f"output {i} is a lazy {'conjugate' if o.is_conj() else 'negative'} view; materialize it"
        if o.device.type != device.type:
            return "invalid_output", f"output {i} is on {o.device}, the run is on {device}"
    return None


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` a tensor can touch (from its storage offset and strides)."""
    if t.numel() == 0:
        return None
    lo = t.data_ptr()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return lo, lo + extent * t.element_size()


EXACT_OVERLAP_LIMIT = 1 << 24  # elements: above this, overlapping spans count as overlap


def _addresses(t: torch.Tensor) -> torch.Tensor:
    """Byte addresses of every element of ``t`` (CPU int64)."""
    idx = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return (idx.flatten() * t.element_size() + t.data_ptr()).unique()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share a byte: their spans overlap and (for strided views, e.g.
    interleaved column slices of one buffer) some element addresses coincide."""
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None or not (sa[0] < sb[1] and sb[0] < sa[1]):
        return False
    if (a.is_contiguous() and b.is_contiguous()) or a.numel() + b.numel() > EXACT_OVERLAP_LIMIT:
        return True
    lo_a, lo_b = _addresses(a), _addresses(b)
    width = max(a.element_size(), b.element_size())
    # element i of a overlaps element j of b when |addr_a - addr_b| < element size
    pos = torch.searchsorted(lo_b, lo_a)
    near = [lo_b[pos.clamp(max=len(lo_b) - 1)], lo_b[(pos - 1).clamp(min=0)]]
    return bool(any(((n - lo_a).abs() < width).any() for n in near))


def aliased_outputs(out, inputs: dict[str, torch.Tensor], allowed: tuple[str, ...], previous=None) -> Violation:
    """``output_aliased`` when an output's memory overlaps an input not named in
    ``allowed`` (the operator's ``mutable_inputs``), another output, or an output of an
    earlier call (``previous``: one call's output, or a list of several calls' outputs).
    ``inputs`` maps input names to the tensors the call received."""
    outs = [o for o in flatten_outputs(out) if isinstance(o, torch.Tensor)]
    for i, o in enumerate(outs):
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor) and name not in allowed and _overlap(o, t):
                return "output_aliased", f"output {i} shares memory with input {name!r}, which this operator does not write"
        for j in range(i):
            if _overlap(o, outs[j]):
                return "output_aliased", f"outputs {j} and {i} share memory"
    prev = []
    for p in (previous if isinstance(previous, list) else [previous]):
        prev += [t for t in flatten_outputs(p) if isinstance(t, torch.Tensor)] if p is not None else []
    # an earlier output that is a view of an input the operator may write (vLLM's
    # in-place kernels return their inputs) shares memory with this call's output only
    # because the harness reuses input buffers across calls
    writable = [t for name, t in inputs.items() if name in allowed and isinstance(t, torch.Tensor)]
    prev = [p for p in prev if not any(_overlap(p, w) for w in writable)]
    for i, o in enumerate(outs):
        for j, p in enumerate(prev):
            if _overlap(o, p):
                return "output_aliased", (f"output {i} shares memory with an output of an earlier call: a reused "
                                          "buffer is overwritten by the next call")
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors of the same shape and dtype hold identical bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def mutated_inputs(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], allowed: tuple[str, ...]) -> Violation:
    """``input_mutated`` when an input not in ``allowed`` holds other bytes after the call
    than the copy taken before it."""
    for name, b in before.items():
        if name not in allowed and not same_bits(b, after[name]):
            n = int((b.contiguous().view(torch.uint8) != after[name].contiguous().view(torch.uint8)).sum()) if b.numel() else 0
            may = f"it may write only {', '.join(allowed)}" if allowed else "this operator writes no input"
            return "input_mutated", f"the call changed input {name!r} ({n} bytes differ); {may}"
    return None


def snapshot(out) -> list:
    """Copies of a call's tensor outputs, taken right after it returned (on CUDA queued on
    the current stream, with no synchronize)."""
    return [o.clone() if isinstance(o, torch.Tensor) else None for o in flatten_outputs(out)]


def changed_after_return(out, snap: list, device: torch.device, wait_s: float) -> Violation:
    """``unsynced_work`` when an output's bytes differ between the copy taken right after
    the call returned and now, after a device-wide synchronize (CUDA) or ``wait_s``
    seconds (CPU): something was still writing it."""
    if device.type == "cuda":
        timing._synchronize(device)
    else:
        timing.wait_briefly(wait_s)
    for i, (o, s) in enumerate(zip(flatten_outputs(out), snap)):
        if isinstance(o, torch.Tensor) and s is not None and not same_bits(o, s):
            return "unsynced_work", (f"output {i} changed after the call returned: work ran on another "
                                     f"{'stream' if device.type == 'cuda' else 'thread'}, outside the timing")
    return None


def thread_idents() -> set[int]:
    """Native ids of this process's live threads (``/proc/self/task``; Python threads,
    ``_thread`` threads and threads started by C code alike). Falls back to the Python
    threads' ``native_id`` where ``/proc`` is missing."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def _cpu_ns(tid: int) -> int | None:
    """CPU time of thread ``tid`` in ns (``/proc/self/task/{tid}/schedstat``, else
    ``stat``'s utime + stime in clock ticks); None once the thread is gone."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _thread_name(tid: int) -> str:
    for t in threading.enumerate():
        if t.native_id == tid:
            return t.name
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f"{f.read().strip()} (native thread {tid})"
    except OSError:
        return f"native thread {tid}"


class ThreadWatch:
    """The threads a call left running, watched from the moment it returned.

    Create it right after the call returns, with :func:`thread_idents` from before the
    call. Every thread of the process is seen (``/proc/self/task``): Python threads,
    ``_thread`` threads and threads C code started. :meth:`check` polls the new threads'
    CPU clocks for a short window and reports ``unsynced_work`` when one used more than
    ``min_cpu_s`` of CPU after the return (still running, or seen working before it
    ended). Threads of an idle pool (alive, blocked) pass; so do threads that were only
    exiting (a thread the call joined can linger for microseconds with no CPU use). The
    harness creates the OpenMP/BLAS pools before any candidate runs, so a candidate's
    first parallel op starts no new pool thread."""

    def __init__(self, before: set[int]) -> None:
        start = {tid: _cpu_ns(tid) for tid in thread_idents() - before}
        self.start = {tid: ns for tid, ns in start.items() if ns is not None}
        self.names = {tid: _thread_name(tid) for tid in self.start}

    def check(self, window_s: float = 0.02, min_cpu_s: float = 5e-5) -> Violation:
        """Poll for ``window_s`` seconds (every millisecond; at once when the call left no
        thread) and return the violation, if any (see the class docstring)."""
        if not self.start:
            return None
        used = dict.fromkeys(self.start, 0)
        ended: set[int] = set()
        deadline = time.monotonic() + window_s
        while True:
            for tid, ns0 in self.start.items():
                if tid in ended:
                    continue
                ns = _cpu_ns(tid)
                if ns is None:
                    ended.add(tid)
                else:
                    used[tid] = ns - ns0
            if time.monotonic() >= deadline or len(ended) == len(self.start):
                break
            timing.wait_briefly(0.001)
        for tid, ns in used.items():
            if ns > min_cpu_s * 1e9:
                how = "finished its work later" if tid in ended else f"used {ns / 1e6:.2f} ms of CPU after the call returned"
                return "unsynced_work", f"thread {self.names[tid]!r}, running when the call returned, {how}: work outside the timing"
        return None
