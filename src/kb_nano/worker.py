"""Worker process of one kernel job.

Runs :func:`kb_nano.bench.measure` and writes the row as a Parquet shard. It runs in a
process of its own so that a candidate that segfaults, hangs or exhausts memory only
takes this process down; :mod:`kb_nano.kernel_job` then records ``crashed``/``timeout``.
:mod:`kb_nano.kernel_job` forks it from a fork server that has torch imported already;
this module itself is torch-free at import (the Snakemake process imports it).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def _die_with_owner(owner_pid: int) -> None:
    """SIGKILL this worker as soon as the process that owns the job (the Snakemake
    process whose thread waits for it and enforces ``timeout_s``) is gone, even when that
    process was SIGKILLed: a daemon thread waits on a Linux pidfd of the owner
    (``os.pidfd_open``; Linux >= 5.3), else polls it twice a second. So an interrupted
    sweep leaves no orphan that could run on unbounded or later write a stale shard."""
    import select
    import threading

    try:
        fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(owner_pid, 0)
                except ProcessLookupError:
                    break
                threading.Event().wait(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="kb_nano-owner-watch", daemon=True).start()


def _sort_sigint() -> None:
    """Tell a Ctrl-C from a candidate interrupting itself. SIGINT is blocked in every
    thread and taken by a watcher thread (``sigwaitinfo``), which reads who sent it:
    from this process (``si_pid``), it is the candidate's: the worker reports that and
    exits with status 1 (the job writes a ``crashed`` row). From anywhere else (the
    terminal's Ctrl-C, ``kill -INT``), it dies of SIGINT as before, which the job reads
    as an interruption (no row; the next run redoes the job)."""
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def watch() -> None:
        info = signal.sigwaitinfo({signal.SIGINT})
        if info.si_pid == os.getpid():
            print("the candidate sent SIGINT to its own process", flush=True)
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)  # default action: die of SIGINT

    threading.Thread(target=watch, name="kb_nano-sigint", daemon=True).start()


def _become_subreaper() -> None:
    """Make this worker the Linux "child subreaper" of everything it starts
    (``prctl(PR_SET_CHILD_SUBREAPER)``): a process a candidate detaches (double fork,
    ``setsid``) is re-parented to the worker instead of init, so
    :func:`_kill_descendants` (and the job's kill on timeout) still finds it. A worker
    that crashes leaves such orphans to init: a stated limit."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _kill_descendants() -> None:
    """SIGKILL every process below this worker (candidate helpers, detached or not)."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def run(spec: dict, log: str) -> None:
    """Entry point of the worker process (a ``multiprocessing`` target).

    ``spec``: ``scenario`` (manifest entry), ``candidate_id``, ``candidate_path``,
    ``settings`` (see :func:`kb_nano.bench.measure`), ``root``, ``output`` (shard path),
    ``gpu_ids`` (leased ids, exported as ``CUDA_VISIBLE_DEVICES`` before torch touches
    CUDA; None for a CPU job), ``owner_pid`` (the job's process; the worker dies with it).
    stdout/stderr go to ``log``. Every process the candidate started, detached ones
    included, is killed before the row is written (:func:`_become_subreaper`).
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _sort_sigint()  # before any thread starts: they inherit the blocked SIGINT
    _die_with_owner(int(spec["owner_pid"]))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if spec.get("gpu_ids"):
        os.environ["CUDA_VISIBLE_DEVICES"] = spec["gpu_ids"]
    _become_subreaper()
    from kb_nano.bench import measure
    from kb_nano.schema import write_rows

    row = measure(spec["scenario"], spec["candidate_id"], Path(spec["candidate_path"]), spec["settings"], Path(spec["root"]))
    _kill_descendants()  # nothing the candidate started may outlive it (or touch the shard later)
    row["gpu_ids"] = spec.get("gpu_ids")  # leased by the job (kb_nano.gpus)
    write_rows([row], Path(spec["output"]))
    print(f"{row['scenario_id']} {row['candidate']}: {row['status']}" + (f" ({row['error']})" if row["error"] else ""))
