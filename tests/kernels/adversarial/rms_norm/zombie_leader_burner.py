"""Hack (a breaker's, 2026-12-04): ``clone_parent_burner``'s helpers, each hidden as a
zombie: a helper starts its burning thread and then ends its main thread alone (a raw
``exit`` syscall, not ``exit_group``). Linux then shows the helper's ``/proc/<pid>/stat``
in state ``Z`` while the other thread burns on; the check for processes beside the workers
read only that state and took the helper for a killed worker not yet reaped, so the row
passed with the baseline slowed (0.48 ms vs 0.25 ms on the 2-core CPU) and the helper
outlived the job. The check now reads every thread's state
(:func:`kb_nano.kernels.procs.strays`)."""

import ctypes
import os
import threading
import time

from _common import SHM, IdleSignalling, burn_while_idle, clone_sibling

EXPECTED = "tampered"
EXPECTED_ERROR = "run beside the workers"

SYS_EXIT = 60 if os.uname().machine == "x86_64" else 93  # exit (this thread), not exit_group


class ZombieLeaderRMSNorm(IdleSignalling):
    def start_helpers(self, n=2):
        worker = os.getpid()

        def helper():
            threading.Thread(target=burn_while_idle, args=(worker, SHM, 120), daemon=False).start()
            time.sleep(0.05)
            ctypes.CDLL(None).syscall(ctypes.c_long(SYS_EXIT), ctypes.c_long(0))  # only this thread ends

        for _ in range(n):
            clone_sibling(helper)
