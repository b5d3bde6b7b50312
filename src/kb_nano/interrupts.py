"""Which signal interrupted a run, known where it matters (torch-free).

In the ``kb_nano`` process a SIGINT, SIGTERM or SIGHUP raises :class:`SignalInterrupt`,
a ``KeyboardInterrupt`` that names the signal, so the one line the CLI ends with says
what stopped the run. In the Snakemake process :func:`watch` notes a SIGINT before it
raises ``KeyboardInterrupt`` as Python's default handler does: a kernel job whose judge
or worker died of that same SIGINT asks :func:`interrupted` and ends as interrupted,
without the error report of a failed job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_NOTED = threading.Event()


class SignalInterrupt(KeyboardInterrupt):
    """``KeyboardInterrupt`` raised for the signal ``signum`` (its ``signum``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)


def raise_interrupt(signum, frame) -> None:
    """A signal handler: raise :class:`SignalInterrupt` for ``signum``."""
    raise SignalInterrupt(signum)


def watch(quiet: bool = False) -> bool:
    """In the main thread of the Snakemake process: SIGINT still raises
    ``KeyboardInterrupt``, and first notes that it came (:func:`interrupted`); with
    ``quiet``, this process's stderr goes to /dev/null from then on (``kb_nano`` says
    itself that the run was interrupted and where its results are, so Snakemake's reports
    of the jobs it stops are left out; its log file under ``.snakemake/log`` keeps them).
    Installs nothing, returning False, outside the main thread or when SIGINT already has
    a handler other than Python's default."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False

    def note(signum, frame) -> None:
        if quiet and not _NOTED.is_set():
            sys.stderr.flush()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        _NOTED.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    return True


def interrupted(wait_s: float = 0.0) -> bool:
    """Whether this process got a SIGINT since :func:`watch`, waiting up to ``wait_s``
    seconds for it (a judge dies of a Ctrl-C at the same moment as Snakemake's main
    thread gets it; the job thread that saw the judge die may look first)."""
    return _NOTED.wait(wait_s) if wait_s > 0 else _NOTED.is_set()
