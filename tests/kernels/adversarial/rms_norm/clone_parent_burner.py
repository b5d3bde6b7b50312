"""Hack (a breaker's, session 9): raw ``clone(CLONE_PARENT)`` children become siblings of
the worker (children of its fork server), outside the worker's process tree, so the judge's
CPU accounting while the baseline is timed did not see them; they burn CPU whenever this
candidate is idle, slowing the baseline (0.330 ms vs 0.130 ms on the 2-core CPU). The judge
now refuses any process beside the workers (``kb_nano.kernels.procs.strays``)."""

import os

from _common import SHM, IdleSignalling, burn_while_idle, clone_sibling

EXPECTED = "tampered"


class CloneParentRMSNorm(IdleSignalling):
    def start_helpers(self, n=2):
        worker = os.getpid()
        for _ in range(n):
            clone_sibling(lambda: burn_while_idle(worker, SHM))
