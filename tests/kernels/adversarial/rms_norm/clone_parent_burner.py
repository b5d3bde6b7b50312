"""Hack (a breaker's, session 9): raw ``clone(CLONE_PARENT)`` children become siblings of
the worker (children of its fork server), outside the worker's process tree, so the judge's
CPU accounting while the baseline is timed did not see them; they burn CPU whenever this
candidate is idle, slowing the baseline (0.330 ms vs 0.130 ms on the 2-core CPU). The judge
now refuses any process beside the workers (``kb_nano.kernels.procs.strays``)."""

import ctypes
import mmap
import os
import struct
import time

import torch.nn.functional as F
from _common import Base, burn_while_idle

EXPECTED = "tampered"

_SHM = mmap.mmap(-1, 16)  # MAP_SHARED anonymous: [busy, last_end_ns]
_STARTED = False
CLONE_PARENT = 0x00008000
SIGCHLD = 17
SYS_CLONE = 56 if os.uname().machine == "x86_64" else 220


def _start(n=2):
    libc = ctypes.PyDLL(None)  # keeps the GIL across the call
    libc.syscall.restype = ctypes.c_long
    worker = os.getpid()
    for _ in range(n):
        pid = libc.syscall(
            ctypes.c_long(SYS_CLONE),
            ctypes.c_long(CLONE_PARENT | SIGCHLD),
            ctypes.c_long(0),
            ctypes.c_long(0),
            ctypes.c_long(0),
            ctypes.c_long(0),
        )
        if pid == 0:
            try:
                ctypes.pythonapi.PyOS_AfterFork_Child()
                burn_while_idle(worker, _SHM)
            finally:
                os._exit(0)


class CloneParentRMSNorm(Base):
    def forward(self, x, residual=None):
        global _STARTED
        if not _STARTED:
            _STARTED = True
            _start()
        struct.pack_into("q", _SHM, 0, 1)
        if residual is not None:
            x = (x.float() + residual.float()).to(x.dtype)
            residual = x
        out = F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        struct.pack_into("qq", _SHM, 0, 0, time.monotonic_ns())
        return out if residual is None else (out, residual)
