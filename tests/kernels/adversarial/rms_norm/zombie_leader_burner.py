"""Hack (a breaker's, 2026-12-04): ``clone_parent_burner``'s helpers, each hidden as a
zombie: a helper starts its burning thread and then ends its main thread alone (a raw
``exit`` syscall, not ``exit_group``). Linux then shows the helper's ``/proc/<pid>/stat``
in state ``Z`` while the other thread burns on; the check for processes beside the workers
read only that state and took the helper for a killed worker not yet reaped, so the row
passed with the baseline slowed (0.48 ms vs 0.25 ms on the 2-core CPU) and the helper
outlived the job. The check now reads every thread's state
(:func:`kb_nano.kernels.procs.strays`)."""

import ctypes
import mmap
import os
import struct
import threading
import time

import torch.nn.functional as F
from _common import Base, burn_while_idle

EXPECTED = "tampered"
EXPECTED_ERROR = "run beside the workers"

_SHM = mmap.mmap(-1, 16)  # MAP_SHARED anonymous: [busy, last_end_ns]
_STARTED = False
CLONE_PARENT = 0x00008000
SIGCHLD = 17
SYS_CLONE = 56 if os.uname().machine == "x86_64" else 220
SYS_EXIT = 60 if os.uname().machine == "x86_64" else 93  # exit (this thread), not exit_group


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
                threading.Thread(target=burn_while_idle, args=(worker, _SHM, 120), daemon=False).start()
                time.sleep(0.05)
                ctypes.CDLL(None).syscall(ctypes.c_long(SYS_EXIT), ctypes.c_long(0))  # only this thread ends
            finally:
                os._exit(1)


class ZombieLeaderRMSNorm(Base):
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
