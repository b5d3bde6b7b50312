"""A CPU worker's heap: timed calls write their outputs to memory that is already mapped.

Every timed output is held until the end of its batch and beyond (the aliasing check,
:meth:`kb_nano.kernels.worker.Side.keep`), so no output can reuse the memory of the one
before it. With glibc's defaults each such allocation is fresh memory: a block above the
mmap threshold (128 KiB at first) is a new ``mmap``, and the call that writes it takes one
page fault per 4 KiB page. Measured on the 2-core AMD EPYC (``rms_norm`` of
Llama-3.2-1B, 64 tokens, bf16, one thread): 0.09 ms per call when outputs are dropped,
0.22 ms when they are held, and the ratio of two workers drifting run to run with the
allocator's state (an honest copy of the baseline read 0.55x, then 1.02x). A model's
forward pass reuses freed activations, which are mapped already.

So each CPU worker takes every block from glibc's main heap (``M_MMAP_MAX`` 0) and keeps
what it frees (``M_TRIM_THRESHOLD`` at its maximum), and before a scenario's timed calls
faults in as much free heap as the outputs it will hold (:func:`reserve`); after the
scenario, free heap above :data:`KEEP_FREE_BYTES` goes back to the system (:func:`release`).
Both workers of a measurement do the same, so neither side's output memory is colder
than the other's; a candidate that changes these settings in its own process changes only
its own time. Reference: ``mallopt(3)``, ``malloc_trim(3)``, ``mallinfo2(3)`` (glibc >= 2.33).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt(3) parameter numbers (glibc's malloc.h)
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1
KEEP_FREE_BYTES = 1 << 30  # free heap a worker keeps between scenarios (the next one reuses it)
PAGE = 4096


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc only: AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = None


def configure() -> str | None:
    """Set this process's glibc malloc to heap-only, no trimming. Returns None, or why it
    could not (not glibc, or glibc older than 2.33): the worker then runs with the
    allocator's defaults, and its row is no less valid, only noisier on the CPU."""
    global _LIBC
    _LIBC = _libc()
    if _LIBC is None:
        return "not glibc >= 2.33 (no mallinfo2)"
    if not (_LIBC.mallopt(M_MMAP_MAX, 0) and _LIBC.mallopt(M_TRIM_THRESHOLD, INT_MAX)):
        _LIBC = None
        return "mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD"
    return None


def free_bytes() -> int:
    """Free bytes in the main heap (``mallinfo2().fordblks``); 0 when not configured."""
    return int(_LIBC.mallinfo2().fordblks) if _LIBC is not None else 0


def reserve(nbytes: int) -> int:
    """Make at least ``nbytes`` of free heap mapped and touched: allocate the shortfall,
    write one byte per page, free it (kept, as trimming is off). Returns the bytes faulted
    in (0 when enough was free, when :func:`configure` did not succeed, or when the
    process's address-space limit refuses the block: the outputs then fault in as they come)."""
    if _LIBC is None or nbytes <= 0:
        return 0
    short = int(nbytes) - free_bytes()
    if short <= 0:
        return 0
    import torch

    try:
        block = torch.empty(short, dtype=torch.uint8)
    except RuntimeError:  # DefaultCPUAllocator: can't allocate memory (RLIMIT_AS)
        return 0
    block[::PAGE] = 1  # one write per page maps it
    del block
    return short


def release() -> None:
    """Give free heap back to the system when more than :data:`KEEP_FREE_BYTES` is free
    (a scenario with large outputs or weights does not leave an idle worker that big)."""
    if _LIBC is not None and free_bytes() > KEEP_FREE_BYTES:
        _LIBC.malloc_trim(0)
