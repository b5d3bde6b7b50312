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
import sys
import threading
import time

import numpy as np
import torch

from kb_nano import timing

_pthread_getcpuclockid = getattr(time, "pthread_getcpuclockid", None)
_clock_gettime = time.clock_gettime
Violation = tuple[str, str] | None
_MISSING = object()
_VOLATILE = {"__dict__", "__weakref__", "__doc__", "__abstractmethods__", "__annotations__", "__parameters__"}


def _flatten(out) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def _precision_flags() -> dict[str, object]:
    return {
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
    ``numpy``; the module globals of :mod:`kb_nano.timing`, :mod:`kb_nano.checks`,
    :mod:`kb_nano.bench`; ``baseline``'s class attributes (its whole MRO) and its
    module's globals; and the TF32 / matmul-precision flags. Names that appear later
    (lazily imported submodules) are allowed; replaced or deleted ones are not."""

    def __init__(self, baseline: type | None = None) -> None:
        import torch.nn.functional as F

        self._objects = {
            "time": time, "torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": F,
            "torch.nn.Module": torch.nn.Module, "torch.cuda": torch.cuda, "torch.cuda.Event": torch.cuda.Event,
            "numpy": np,
        }
        self._modules = ["kb_nano.timing", "kb_nano.checks", "kb_nano.bench"]
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
        for name in self._modules:
            module = sys.modules.get(name)
            if module is not None:
                snap[name] = dict(vars(module))
        snap["precision"] = _precision_flags()
        return snap

    def changed(self) -> list[str]:
        """Names whose object (or flag value) differs from the snapshot."""
        now = self._take()
        out = []
        for ns, names in self._before.items():
            cur = now.get(ns, {})
            for k, v in names.items():
                if ns == "precision":
                    if cur.get(k) != v:
                        out.append(f"{k} ({v!r} -> {cur.get(k)!r})")
                elif k not in cur or cur[k] is not v:
                    out.append(f"{ns}.{k}")
        return out

    def check(self, when: str) -> Violation:
        """``("tampered", message)`` when anything changed since the snapshot."""
        changed = self.changed()
        if not changed:
            return None
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return "tampered", (f"{when}, the candidate changed {', '.join(changed[:3])}{more}: the harness's timer, "
                            "statistics, precision settings and the baseline's functions must stay as they were")


def invalid_outputs(out, device: torch.device) -> Violation:
    """``invalid_output`` when an output is not a plain dense ``torch.Tensor`` on
    ``device`` (subclass, sparse or other non-strided layout, lazy conj/neg bit, meta
    tensor). Must run before anything reads the output's values, which would let a lazy
    tensor compute then."""
    for i, o in enumerate(_flatten(out)):
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


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = _span(a), _span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def aliased_outputs(out, inputs: dict[str, torch.Tensor], allowed: tuple[str, ...], previous=None) -> Violation:
    """``output_aliased`` when an output's memory overlaps an input not named in
    ``allowed`` (the operator's ``mutable_inputs``), another output, or an output of the
    ``previous`` call. ``inputs`` maps input names to the tensors the call received."""
    outs = [o for o in _flatten(out) if isinstance(o, torch.Tensor)]
    for i, o in enumerate(outs):
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor) and name not in allowed and _overlap(o, t):
                return "output_aliased", f"output {i} shares memory with input {name!r}, which this operator does not write"
        for j in range(i):
            if _overlap(o, outs[j]):
                return "output_aliased", f"outputs {j} and {i} share memory"
    prev = [p for p in _flatten(previous) if isinstance(p, torch.Tensor)] if previous is not None else []
    for i, o in enumerate(outs):
        for j, p in enumerate(prev):
            if _overlap(o, p):
                return "output_aliased", (f"output {i} shares memory with output {j} of the previous call: a reused "
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
    return [o.clone() if isinstance(o, torch.Tensor) else None for o in _flatten(out)]


def changed_after_return(out, snap: list, device: torch.device, wait_s: float) -> Violation:
    """``unsynced_work`` when an output's bytes differ between the copy taken right after
    the call returned and now, after a device-wide synchronize (CUDA) or ``wait_s``
    seconds (CPU): something was still writing it."""
    if device.type == "cuda":
        timing._synchronize(device)
    else:
        timing.wait_briefly(wait_s)
    for i, (o, s) in enumerate(zip(_flatten(out), snap)):
        if isinstance(o, torch.Tensor) and s is not None and not same_bits(o, s):
            return "unsynced_work", (f"output {i} changed after the call returned: work ran on another "
                                     f"{'stream' if device.type == 'cuda' else 'thread'}, outside the timing")
    return None


def thread_idents() -> set[int]:
    """Idents of the live Python threads."""
    return {t.ident for t in threading.enumerate() if t.ident is not None}


class ThreadWatch:
    """The Python threads a call left alive, watched from the moment it returned.

    Create it right after the call returns, with the thread idents from before the call.
    :meth:`check` then reports ``unsynced_work`` when one of those threads, during the
    window since, used more than ``min_cpu_s`` of CPU (per-thread CPU clocks,
    ``pthread_getcpuclockid``) or ended (it was doing something, not waiting for work).
    Threads of an idle pool (alive, blocked) pass; threads the call joined are not alive
    at return and are not watched."""

    def __init__(self, before: set[int]) -> None:
        self.clocks: dict[str, tuple[threading.Thread, int | None, float | None]] = {}
        for t in threading.enumerate():
            if t.ident is None or t.ident in before or not t.is_alive():
                continue
            clk = start = None
            if _pthread_getcpuclockid is not None:
                try:
                    clk = _pthread_getcpuclockid(t.ident)
                    start = _clock_gettime(clk)
                except (OSError, ValueError):
                    clk = start = None
            self.clocks[t.name] = (t, clk, start)

    def check(self, min_cpu_s: float = 5e-5) -> Violation:
        """The violation, if any (see the class docstring); call after a wait."""
        for name, (t, clk, start) in self.clocks.items():
            if not t.is_alive():
                return "unsynced_work", (f"thread {name!r}, running when the call returned, finished its work later: "
                                         "work outside the timing")
            if clk is None:
                continue
            try:
                used = _clock_gettime(clk) - start
            except OSError:
                continue
            if used > min_cpu_s:
                return "unsynced_work", (f"thread {name!r} started by the candidate used {used * 1e3:.2f} ms of CPU after "
                                         "the call returned: work outside the timing")
        return None
