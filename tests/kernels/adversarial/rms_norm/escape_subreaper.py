"""Hack (a breaker's, session 12): the worker is a child subreaper, so a process its
candidate detaches stays in its tree. The candidate turns that flag off on its own process
(``prctl(PR_SET_CHILD_SUBREAPER, 0)``), detaches helpers by a double fork, and turns the flag
back on: the helpers were adopted by init, outside every tree the judge watched (not in the
worker's, not beside the workers), and burned CPU whenever this candidate was idle, i.e.
while the baseline was timed (the baseline read up to 2.2x slower than beside an honest
control on the 2-core CPU; always `passed`). The workers' fork server is a subreaper now
(``kb_nano.kernels.worker_server``): it adopts the helpers, and the judge refuses any
process beside the workers."""

import ctypes
import os

from _common import SHM, IdleSignalling, burn_while_idle

EXPECTED = "tampered"

PR_SET_CHILD_SUBREAPER = 36


def _detach(n=2):
    libc = ctypes.CDLL(None, use_errno=True)
    worker = os.getpid()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    try:
        for _ in range(n):
            middle = os.fork()
            if middle == 0:
                if os.fork() == 0:  # the helper: its parent exits at once
                    os.setsid()
                    try:
                        burn_while_idle(worker, SHM)
                    finally:
                        os._exit(0)
                os._exit(0)
            os.waitpid(middle, 0)
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class EscapeSubreaperRMSNorm(IdleSignalling):
    def start_helpers(self):
        _detach()
