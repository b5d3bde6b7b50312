"""Process trees seen from the judge: CPU time used, scheduling restored, killed (Linux
``/proc``, psutil)."""

from __future__ import annotations

import contextlib
import os


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and every process below it, every
    thread summed, from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds; the
    ``cpu_times`` of ``/proc/<pid>/stat`` count 10 ms clock ticks, too coarse to tell an
    idle process from a busy one over a few milliseconds)."""
    import psutil

    pids = [pid]
    with contextlib.suppress(psutil.Error):
        pids += [p.pid for p in psutil.Process(pid).children(recursive=True)]
    total = 0
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9


def restore_scheduling(pid: int) -> list[int]:
    """The threads of ``pid`` whose CPU affinity, scheduling policy or niceness differ
    from this process's (which a worker inherits from the judge through its fork server),
    each restored; see :meth:`kb_nano.kernels.judge.Measurement.check_scheduling`."""
    want = (frozenset(os.sched_getaffinity(0)), os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    changed = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError):
            t = int(tid)
            if (frozenset(os.sched_getaffinity(t)), os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) != want:
                changed.append(t)
                os.sched_setaffinity(t, want[0])
                os.sched_setscheduler(t, want[1], os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, t, want[2])
    return changed


def kill_tree(pid: int) -> None:
    """SIGKILL a worker and every process it started (a candidate may spawn helpers)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        for proc in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
