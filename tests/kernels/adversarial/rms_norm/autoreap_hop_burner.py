"""Hack (a breaker's, 2026-12-04): helpers whose CPU time vanishes. The worker ignores
``SIGCHLD``, so the kernel reaps its exited children at once and their CPU time reaches
no process's ``cutime``; each helper burns while the baseline is timed and, after 0.3 ms
of CPU, forks its successor and exits, so the judge's reading of the candidate's process
tree sees only the live helpers' last fraction of a millisecond (on the 2-core CPU:
``passed`` at 1.1-3.5x, the honest control beside it 1.1-1.4x). The candidate's worker
now runs under a seccomp filter that refuses any new ``SIGCHLD`` action
(:mod:`kb_nano.kernels.seccomp`): exited helpers stay zombies of the worker, whose CPU
clock counts them, or are reaped into its ``cutime``."""

import os
import signal

from _common import SHM, IdleSignalling, burn_while_idle

EXPECTED = "import_error"
EXPECTED_ERROR = "Operation not permitted"

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited children: reaped by the kernel, uncounted


def _hop_burner(worker: int) -> None:
    """Burn while the candidate is idle (a slice at a time), each slice in a new process;
    return once the worker is gone."""
    while True:
        try:
            os.kill(worker, 0)
        except OSError:
            return
        burn_while_idle(worker, SHM, seconds=0.0003)
        if os.fork():
            os._exit(0)  # the successor goes on; this one's CPU time is reaped uncounted


class AutoreapHopBurner(IdleSignalling):
    def start_helpers(self, n=2):
        worker = os.getpid()
        for _ in range(n):
            if os.fork() == 0:
                try:
                    _hop_burner(worker)
                finally:
                    os._exit(0)
