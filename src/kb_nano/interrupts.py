"""Which signal interrupted a run, known where it matters, and the children a run
starts stopped with it (torch-free).

In the ``kb_nano`` process a SIGINT, SIGTERM or SIGHUP raises :class:`SignalInterrupt`,
a ``KeyboardInterrupt`` that names the signal (while :func:`interrupts` is active), so
the one line the CLI ends with says what stopped the run; a server or workflow it starts
runs in a process group of its own (:func:`on_parent_death`, :func:`stop_group`). In the Snakemake process :func:`watch` notes a SIGINT before it
raises ``KeyboardInterrupt`` as Python's default handler does: a kernel job whose judge
or worker died of that same SIGINT asks :func:`interrupted` and ends as interrupted,
without the error report of a failed job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

_NOTED = threading.Event()
_WAKEUP: list[int] = []  # the read end of the signal wake-up pipe :func:`watch` installs


class SignalInterrupt(KeyboardInterrupt):
    """``KeyboardInterrupt`` raised for the signal ``signum`` (its ``signum``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)


def raise_interrupt(signum, frame) -> None:
    """A signal handler: raise :class:`SignalInterrupt` for ``signum``."""
    raise SignalInterrupt(signum)


@contextlib.contextmanager
def interrupts(sigs: tuple):
    """While the block runs, each of ``sigs`` raises :class:`SignalInterrupt` (a
    KeyboardInterrupt naming the signal) in the main thread and is unblocked: also in a
    kb_nano started with SIGINT ignored (`kb_nano ... &` from a script) or blocked by its
    parent. The handlers and the mask are restored afterwards."""
    previous = {sig: signal.signal(sig, raise_interrupt) for sig in sigs}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, set(sigs))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def on_parent_death(sig: signal.Signals):
    """A ``preexec_fn`` for a child kb_nano starts in a process group of its own: signal
    ``sig`` reaches it when kb_nano dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and
    SIGINT's default action is back (a background job of a script starts with SIGINT
    ignored, and Python then would not turn it into KeyboardInterrupt), SIGINT and SIGTERM
    unblocked (a mask the parent set is inherited)."""

    def preexec() -> None:
        import ctypes

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG

    return preexec


def stop_group(proc: subprocess.Popen, first: signal.Signals, grace_s: float, then: signal.Signals) -> None:
    """Stop the process group led by ``proc`` (started with ``process_group=0``): ``first``
    to the whole group, and ``then`` if it has not ended after ``grace_s`` seconds; waits."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, first)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, then)
        proc.wait()


def watch(quiet: bool = False) -> bool:
    """In the main thread of the Snakemake process: SIGINT still raises
    ``KeyboardInterrupt``, and first notes that it came (:func:`interrupted`); with
    ``quiet``, this process's stderr goes to /dev/null from then on (``kb_nano`` says
    itself that the run was interrupted and where its results are, so Snakemake's reports
    of the jobs it stops are left out; its log file under ``.snakemake/log`` keeps them).
    Installs nothing, returning False, outside the main thread or when SIGINT already has
    a handler other than Python's default.

    It also gives Python's signal wake-up fd a pipe of its own (unless one is set):
    CPython's C-level handler writes each signal's number there in whichever thread the
    kernel delivered it to, while the Python handler runs only once the main thread runs
    Python again, and Snakemake's main thread waits in a semaphore that only a finishing
    job releases. A job thread asking :func:`interrupted` reads the pipe, so it learns of
    the SIGINT even when the main thread has not run the handler yet."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    if not _WAKEUP:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) == -1:
            _WAKEUP.append(r)
        else:  # someone else's (an event loop): leave theirs in place
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)

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


def quiet_on_sigint() -> None:
    """In a workflow script (a ``script:`` rule's own Python process): a SIGINT ends the
    script with exit status 130 through ``SystemExit``, which Python does not print, instead
    of a ``KeyboardInterrupt`` traceback that Snakemake's script wrapper would echo with its
    whole pickled preamble. ``finally`` blocks and context managers still run; Snakemake
    removes the job's incomplete outputs as for any interrupted job."""

    def stop(signum, frame) -> None:
        raise SystemExit(130)

    signal.signal(signal.SIGINT, stop)


def interrupted(wait_s: float = 0.0) -> bool:
    """Whether this process got a SIGINT since :func:`watch`, waiting up to ``wait_s``
    seconds for it (a judge dies of a Ctrl-C at the same moment as Snakemake's main
    thread gets it; the job thread that saw the judge die may look first): noted by the
    main thread's handler, or read from the signal wake-up pipe :func:`watch` installed."""
    import select
    import time

    deadline = time.monotonic() + wait_s
    while not _NOTED.is_set():
        left = deadline - time.monotonic()
        if not _WAKEUP:
            return _NOTED.wait(left) if left > 0 else False
        ready, _, _ = select.select(_WAKEUP, [], [], max(0.0, min(left, 0.05)))
        if ready:
            with contextlib.suppress(BlockingIOError):
                if signal.SIGINT in os.read(_WAKEUP[0], 512):
                    _NOTED.set()
        if left <= 0:
            break
    return _NOTED.is_set()


def quiet_while_importing() -> None:
    """In the ``kb_nano`` command before its imports: until the command's own handlers
    (:func:`interrupts`) replace them, SIGINT, SIGTERM and SIGHUP (not ones inherited as
    ignored) end the process with one line and status 130, instead of a
    ``KeyboardInterrupt`` traceback from the middle of an import (or no line at all for
    SIGTERM)."""

    def end(signum, _frame) -> None:
        os.write(2, f"interrupted ({signal.Signals(signum).name}) while kb_nano was starting\n".encode())
        os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, end)


def end_past_daemon_threads(code: int) -> None:
    """At the end of the ``kb_nano`` command: a process that still has a daemon thread at
    work (the manifest thread of :func:`kb_nano.workflow.start_manifest`, when a Ctrl-C or
    an early error ends the run while it imports torch) ends here with ``os._exit(code)``
    after flushing its output: the interpreter's shutdown would end that thread with
    ``pthread_exit`` inside torch's C++ code, which aborts the process ("terminate called
    without an active exception", status -6) instead of ending it with its status."""
    if any(t.daemon and t.is_alive() for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed (>&-) or a reader gone (| head)
                pass
        os._exit(code)
