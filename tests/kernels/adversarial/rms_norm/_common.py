"""Shared pieces of the adversarial rms_norm candidates (a helper module: names starting
with ``_`` are not candidates)."""

import ctypes
import mmap
import os
import struct
import time

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The correct result, as the baseline computes it: x ``[num_tokens, hidden]``."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class Base(nn.Module):
    """The baseline's constructor and state_dict (``weight``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))


def burn_while_idle(worker: int, shm, seconds: float = 120) -> None:
    """A helper process's loop (for the corpus entries that detach burners): while
    process ``worker`` lives, burn 2 ms of CPU whenever ``shm`` (``[busy, last_end_ns]``,
    two int64) says its candidate is idle and made no call for 3 ms, i.e. while the
    baseline is timed; at most ``seconds``."""
    deadline = time.monotonic() + seconds
    x = 0
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except OSError:
            break
        busy, last = struct.unpack_from("qq", shm, 0)
        if busy or time.monotonic_ns() - last < 3_000_000:
            time.sleep(0.0005)
            continue
        t = time.monotonic_ns() + 2_000_000
        while time.monotonic_ns() < t:
            x += 1


# MAP_SHARED anonymous memory a burner candidate's helpers read: [busy, last_end_ns] (two
# int64), written by IdleSignalling around each call
SHM = mmap.mmap(-1, 16)
CLONE_PARENT = 0x00008000
SIGCHLD = 17
SYS_CLONE = 56 if os.uname().machine == "x86_64" else 220


def clone_sibling(body) -> None:
    """Start a process as a sibling of this worker (raw ``clone(CLONE_PARENT)``: a child
    of the worker's parent, outside the worker's process tree) that runs ``body()`` and
    exits."""
    libc = ctypes.PyDLL(None)  # keeps the GIL across the call
    libc.syscall.restype = ctypes.c_long
    args = (SYS_CLONE, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
    if libc.syscall(*map(ctypes.c_long, args)) == 0:
        try:
            ctypes.pythonapi.PyOS_AfterFork_Child()
            body()
        finally:
            os._exit(0)


class IdleSignalling(Base):
    """A correct fused rms_norm (with the residual add of fused_add_rms_norm) that starts
    its helpers once, on the first call, and marks in :data:`SHM` when it is busy and
    when its last call ended: what :func:`burn_while_idle` reads. Each burner candidate
    subclasses it with its own ``start_helpers(self)``."""

    started = False

    def forward(self, x, residual=None):
        if not IdleSignalling.started:
            IdleSignalling.started = True
            self.start_helpers()
        struct.pack_into("q", SHM, 0, 1)
        if residual is not None:
            x = (x.float() + residual.float()).to(x.dtype)
            residual = x
        out = F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        struct.pack_into("qq", SHM, 0, 0, time.monotonic_ns())
        return out if residual is None else (out, residual)
