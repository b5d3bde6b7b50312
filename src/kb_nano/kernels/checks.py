"""Anti-cheat rules a worker applies to its own calls. Each rule returns ``None`` when the
call complies, else ``(status, message)``; the worker reports the first violation and the
judge (:mod:`kb_nano.kernels.judge`) turns it into the row.

=================  ==================================================================
status             rule
=================  ==================================================================
``invalid_output`` an output is not a plain dense tensor: a ``torch.Tensor`` subclass (a
                   lazy or wrapper tensor that computes on access), a non-strided layout
                   (sparse), a lazily conjugated/negated view, or on another device
                   (:func:`invalid_outputs`).
``output_aliased`` an output shares memory with an input the operator's contract does not
                   let it write, with another output, or with an output of an earlier
                   call that the worker still holds (:func:`aliased_outputs`; the worker
                   holds every output of a measurement up to a memory budget).
``input_mutated``  an input the contract does not let the operator write changed during
                   the call (:func:`mutated_inputs`; the judge also compares the
                   candidate's input slots with its own copy after every batch).
``unsynced_work``  work the call left running after it returned: the output changed after
                   the call returned (:func:`changed_after_return`), or a thread it left
                   running used CPU or finished afterwards (:class:`ThreadWatch`).
=================  ==================================================================

``tampered`` (replaced functions, flags and hooks) is :mod:`kb_nano.kernels.guard`.
These rules run inside the candidate's process, so a candidate that attacks its own
worker can switch them off; what no candidate can switch off is checked by the judge in
its own process (every output's values, the input slots, the clock around each batch,
the candidate process's CPU time while the baseline runs).
"""

from __future__ import annotations

import os
import threading
import time

import torch

from kb_nano.kernels import timing

Violation = tuple[str, str] | None


def flatten_outputs(out) -> list:
    """A call's outputs as a list (a tensor, or a tuple/list of tensors and None). A
    subclass of tuple or list (a namedtuple) counts as one, its items read through the
    base class's own iterator (a subclass's ``__iter__``/``__len__`` could answer each
    rule differently)."""
    if isinstance(out, tuple):
        return list(tuple.__iter__(out))
    if isinstance(out, list):
        return list(list.__iter__(out))
    return [out]


def dense_outputs(out):
    """``out`` with every plain strided tensor that is not contiguous replaced by its
    contiguous copy (a tensor, or a tuple/list of tensors and None; anything else, and
    tensor subclasses, unchanged for :func:`invalid_outputs` to judge). The workers call it
    inside each timed call, on both sides: the judge's output slots are row-major, as every
    baseline returns them, so an output in another layout (a transposed or strided view)
    costs the copy a model's next op would need, in the candidate's own time rather than
    in the untimed copy to the slot, which the judge's clock would take for hidden work.
    The check is ``is_contiguous()`` per output, a no-op for row-major outputs. A tuple or
    list, subclasses included (a namedtuple), comes back as a plain tuple or list
    (:func:`flatten_outputs`), so every later rule walks the same items."""

    def dense(o):
        if type(o) is torch.Tensor and o.layout == torch.strided and not o.is_contiguous():
            return o.contiguous()
        return o

    if isinstance(out, (tuple, list)):
        items = [dense(o) for o in flatten_outputs(out)]
        return tuple(items) if isinstance(out, tuple) else items
    return dense(out)


def invalid_outputs(out, device: torch.device) -> Violation:
    """``invalid_output`` when an output is not a plain dense ``torch.Tensor`` on
    ``device`` (subclass, sparse or other non-strided layout, lazy conj/neg bit, meta
    tensor). Must run before anything reads the output's values, which would let a lazy
    tensor compute then."""
    for i, o in enumerate(flatten_outputs(out)):
        if o is None:
            continue
        if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor:
            return (
                "invalid_output",
                f"output {i} is a {type(o).__module__}.{type(o).__qualname__}, a torch.Tensor subclass; return plain dense tensors",
            )
        if not isinstance(o, torch.Tensor):
            continue  # compare() reports non-tensor outputs as incorrect_shape
        if o.layout != torch.strided:
            return "invalid_output", f"output {i} has layout {o.layout}; return a dense (strided) tensor"
        if o.is_conj() or o.is_neg():
            return (
                "invalid_output",
                f"output {i} is a lazy {'conjugate' if o.is_conj() else 'negative'} view; materialize it",
            )
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
                return (
                    "output_aliased",
                    f"output {i} shares memory with input {name!r}, which this operator does not write",
                )
        for j in range(i):
            if _overlap(o, outs[j]):
                return "output_aliased", f"outputs {j} and {i} share memory"
    prev = []
    for p in previous if isinstance(previous, list) else [previous]:
        prev += [t for t in flatten_outputs(p) if isinstance(t, torch.Tensor)] if p is not None else []
    # an earlier output that is a view of an input the operator may write (vLLM's
    # in-place kernels return their inputs) shares memory with this call's output only
    # because the harness reuses input buffers across calls
    writable = [t for name, t in inputs.items() if name in allowed and isinstance(t, torch.Tensor)]
    prev = [p for p in prev if not any(_overlap(p, w) for w in writable)]
    for i, o in enumerate(outs):
        for p in prev:
            if _overlap(o, p):
                return "output_aliased", (
                    f"output {i} shares memory with an output of an earlier call: a reused "
                    "buffer is overwritten by the next call"
                )
    return None


def first_overlap(new: list[torch.Tensor], older: list[torch.Tensor]) -> tuple[int, int] | None:
    """A pair of tensors that share memory, at least one of them from ``new`` (indices
    into ``older + new``), or None. Sorts the byte spans (O(n log n)), then confirms a
    span overlap with :func:`_overlap` (exact for strided views)."""
    items = older + new
    spans = sorted((sp[0], sp[1], i) for i, t in enumerate(items) if (sp := _span(t)) is not None)
    reach, holder = -1, -1
    for lo, hi, i in spans:
        if lo < reach and (i >= len(older) or holder >= len(older)) and _overlap(items[i], items[holder]):
            return holder, i
        if hi > reach:
            reach, holder = hi, i
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors of the same shape and dtype hold identical bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def mutated_inputs(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], allowed: tuple[str, ...]
) -> Violation:
    """``input_mutated`` when an input not in ``allowed`` holds other bytes after the call
    than the copy taken before it."""
    for name, b in before.items():
        if name not in allowed and not same_bits(b, after[name]):
            n = (
                int((b.contiguous().view(torch.uint8) != after[name].contiguous().view(torch.uint8)).sum())
                if b.numel()
                else 0
            )
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
            return "unsynced_work", (
                f"output {i} changed after the call returned: work ran on another "
                f"{'stream' if device.type == 'cuda' else 'thread'}, outside the timing"
            )
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
                how = (
                    "finished its work later"
                    if tid in ended
                    else f"used {ns / 1e6:.2f} ms of CPU after the call returned"
                )
                return (
                    "unsynced_work",
                    f"thread {self.names[tid]!r}, running when the call returned, {how}: work outside the timing",
                )
        return None


def freeze(specs: list[dict], ins: list[torch.Tensor], outs: list, op, start: int, stop: int) -> dict:
    """Copies of the candidate's slots ``start:stop`` as a batch left them: every output
    (``outs``, ``[k, ...]`` tensors or None) and each input of ``ins`` (``[k, ...]``, in
    ``specs`` order) that ``op`` may not write (``op.mutable_inputs``; None for those).
    The judge checks these, so what the worker does after the batch cannot change what is
    checked. Returns ``{"sl": (start, stop), "ins", "outs"}``."""
    sl = slice(start, stop)
    outs = [None if o is None else o[sl].clone() for o in outs]
    ins = [None if s["name"] in op.mutable_inputs else t[sl].clone() for s, t in zip(specs, ins)]
    return {"sl": (start, stop), "ins": ins, "outs": outs}
