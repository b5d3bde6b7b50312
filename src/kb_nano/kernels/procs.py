"""Process trees seen from the judge: CPU time used, scheduling restored, killed (Linux
``/proc``, psutil)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

# Signals that end a process from outside (a Ctrl-C, kill, a closed terminal, the OOM
# killer): a worker the candidate cannot signal (the baseline's: Landlock's signal scope)
# that dies of one was ended by its environment, not by the measurement
EXTERNAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL})

LIVE_WORKERS: set[int] = set()  # pids of this process's workers (the fork server starts nothing else)
# Held while a worker is started (forked, then added to LIVE_WORKERS) or killed (removed
# once reaped) and while the judge looks for processes beside the workers: a worker that
# another thread (a spare started ahead, a concurrent job) is starting or ending is never
# taken for a candidate's stray.
WORKERS_LOCK = threading.Lock()
# pid -> start time (``/proc/<pid>/stat`` field 22) of each process :func:`kill_tree` sent
# SIGKILL: it runs no more code, but may take a while to exit (a loaded host, a large
# address space to tear down), meanwhile adopted by the fork server (a subreaper) when
# its parent died first. :func:`strays` leaves these out; a reused pid has another start.
KILLED: dict[int, int] = {}


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every live process below it, parents first: from each thread's
    ``/proc/<pid>/task/<tid>/children`` (Linux >= 3.5, ``CONFIG_PROC_CHILDREN``), which
    reads only the tree, where ``psutil.Process.children`` reads the parent of every
    process on the host (4.4 ms on a 16-core GPU host, called several times per ABAB
    pair). Falls back to psutil where the kernel has no such file."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        import psutil

        with contextlib.suppress(psutil.Error):
            return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
        return [pid]
    out, seen, i = [pid], {pid}, 0
    while i < len(out):
        parent, i = out[i], i + 1
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    for child in map(int, f.read().split()):
                        if child not in seen:
                            seen.add(child)
                            out.append(child)
    return out


def strays(worker_pid: int, known: set[int]) -> list[int]:
    """Children of ``worker_pid``'s parent (the workers' fork server) that are not in
    ``known`` (the live workers): a candidate can start a process as its own sibling
    (``clone(CLONE_PARENT)``), or detach one after turning its worker's subreaper flag
    off (the fork server, a subreaper, :func:`become_subreaper`, then adopts it), outside
    its tree and so outside :func:`tree_cpu_s`; the fork server itself starts only
    workers. Zombies (a killed worker the fork server has not reaped yet: it runs nothing)
    and processes :func:`kill_tree` killed that are still exiting (:data:`KILLED`) are
    left out. Empty when the parent cannot be read."""
    parent = parent_pid(worker_pid)
    if parent is None:
        return []
    siblings = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{parent}/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    siblings.update(map(int, f.read().split()))
    for pid in [p for p, start in KILLED.items() if _start_time(p) != start]:  # gone (or pid reused)
        KILLED.pop(pid, None)
    return sorted(
        pid
        for pid in siblings - set(known) - {worker_pid}
        if not _exited(pid) and KILLED.get(pid, -1) != _start_time(pid)
    )


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat`` file from
    the 3rd (state) on (after the command name's closing parenthesis, which may itself
    hold spaces and parentheses); None when it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot, ``/proc/<pid>/stat`` field
    22); None when it is gone."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return int(fields[19]) if fields and len(fields) > 19 else None


def _exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie: every thread of it in state ``Z``/``X``
    (``/proc/<pid>/task/<tid>/stat``). The process's own ``stat`` is not enough: a main
    thread that ends alone (a raw ``exit`` syscall) shows ``Z`` there while its other
    threads run on."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields and fields[0] not in ("Z", "X"):
            return False
    return True


_CLK_TCK = os.sysconf("SC_CLK_TCK")  # the unit of /proc/<pid>/stat's cutime and cstime


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``: its process CPU clock (``clock_gettime`` on the
    clock id ``((~pid) << 3) | 2``, CPUCLOCK_SCHED of the whole thread group, Linux
    ``kernel/time/posix-cpu-timers.c``; nanoseconds, every thread counted, live or exited:
    threads that start after a batch, burn and exit before the next look are in it),
    else the sum of its live threads' ``/proc/<pid>/task/<tid>/schedstat``; plus its
    reaped children's ``cutime + cstime`` from ``/proc/<pid>/stat`` (clock ticks)."""
    try:
        own = time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        own = 0.0
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f,
                ):
                    own += int(f.read().split()[0]) / 1e9
    return own + reaped_cpu_s(pid)


def reaped_cpu_s(pid: int) -> float:
    """CPU seconds of the children process ``pid`` has reaped (waited for): ``cutime +
    cstime`` of ``/proc/<pid>/stat`` (clock ticks). 0.0 when it cannot be read."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return (int(fields[13]) + int(fields[14])) / _CLK_TCK  # cutime, cstime
    return 0.0


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (``/proc/<pid>/stat``), None when it cannot be read."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return int(fields[1])
    return None


def become_subreaper() -> None:
    """Make this process the Linux "child subreaper" of everything below it
    (``prctl(PR_SET_CHILD_SUBREAPER)``, not inherited by children): a descendant whose
    parent exits (double fork, ``setsid``) is re-parented to the nearest subreaper above it
    instead of init. Each worker is one, so the judge's kill of its tree finds what its
    candidate detached; the workers' fork server is one too, so a candidate that turns its
    own worker's flag off before detaching a process hands it to the fork server, where
    :func:`strays` sees it. Does nothing where ``prctl`` is missing."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def end_servers() -> None:
    """Stop this process's ``multiprocessing`` fork server and resource tracker and wait
    for them (``ForkServer._stop``, ``ResourceTracker._stop``: close the pipe each
    watches, then ``waitpid``), so a judge leaves no process behind when it ends. Left
    to notice the judge's exit themselves, they outlive it for a moment, adopted by the
    nearest subreaper above: where that is a workers' fork server (a test process that
    starts judges and workers from one server), the judge there would see them as
    processes beside its workers (:func:`strays`). Does nothing for a server not
    running, or for one this process did not start: a process started by a fork server
    shares its starter's resource tracker (the pipe to it inherited, no pid of its own),
    which must outlive it. Best effort: whatever fails here is left to the exit."""
    from multiprocessing import forkserver, resource_tracker

    for server, pid in ((forkserver._forkserver, "_forkserver_pid"), (resource_tracker._resource_tracker, "_pid")):
        if getattr(server, pid, None) is not None:
            with contextlib.suppress(Exception):
                server._stop()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and every process below it
    (:func:`tree_pids`), each by :func:`_process_cpu_s` (nanosecond clocks; the
    ``utime``/``stime`` of ``/proc/<pid>/stat`` count 10 ms clock ticks, too coarse to
    tell an idle process from a busy one over a few milliseconds)."""
    return sum(_process_cpu_s(p) for p in tree_pids(pid))


def kill_worker(pid: int, known: set[int]) -> None:
    """Kill worker ``pid``'s process tree (:func:`kill_tree`) and every process beside the
    workers (:func:`strays` of ``known``, the live workers: what a candidate detached, which
    the fork server adopted), so none outlives its worker."""
    beside = strays(pid, known)
    kill_tree(pid)
    for other in beside:
        kill_tree(other)


def pause_trees(pids: list[int]) -> list[int]:
    """SIGSTOP every process of the trees of ``pids`` (:func:`tree_pids`, parents first, then
    once more for children forked meanwhile). Returns the pids stopped; gone ones are skipped.
    A stopped process cannot catch or ignore SIGSTOP (signal(7)); one that keeps forking
    and exiting can outrun the passes, which :func:`tree_cpu_s` of the roots then shows."""
    stopped: dict[int, None] = {}  # (ordered, O(1) membership: a tree may hold many processes)
    for _ in range(2):
        for root in pids:
            for pid in tree_pids(root):
                if pid not in stopped:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGSTOP)
                        stopped[pid] = None
    return list(stopped)


def resume(pids: list[int]) -> None:
    """SIGCONT each of ``pids`` (:func:`pause_trees`'s); gone ones are skipped."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


def restore_scheduling(pid: int) -> list[int]:
    """The threads of ``pid`` whose CPU affinity, scheduling policy or niceness differ
    from this process's (which a worker inherits from the judge through its fork server),
    each restored; see :meth:`kb_nano.kernels.judge.Measurement.check_scheduling`."""
    want = (frozenset(os.sched_getaffinity(0)), os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    changed = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the worker is gone: nothing to restore (its death is the next request's answer)
        return []
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            t = int(tid)
            if (
                frozenset(os.sched_getaffinity(t)),
                os.sched_getscheduler(t),
                os.getpriority(os.PRIO_PROCESS, t),
            ) != want:
                changed.append(t)
                os.sched_setaffinity(t, want[0])
                os.sched_setscheduler(t, want[1], os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, t, want[2])
    return changed


def restore_limits(pid: int) -> list[str]:
    """The resource limits (``RLIMIT_*``) of process ``pid`` that differ from this
    process's (a worker inherits the judge's through its fork server; only a candidate's
    own worker is capped, by ``memory_limit_gb``), each set back where the kernel allows.
    Another process of the same user can lower them (``prlimit``: Landlock does not cover
    it), e.g. the address space, so the baseline's heap cannot be faulted in ahead
    (:mod:`kb_nano.kernels.heap`). Returns the names of those that differed."""
    import resource

    changed = []
    for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_")):
        which = getattr(resource, name)
        with contextlib.suppress(OSError, ValueError):
            want = resource.getrlimit(which)
            if resource.prlimit(pid, which) != want:
                changed.append(name)
                with contextlib.suppress(OSError, ValueError):
                    resource.prlimit(pid, which, want)
    return changed


def elevated_threads(pid: int) -> list[int]:
    """Threads of ``pid`` and of the processes it started that run under any policy but
    the time-sharing ones (``SCHED_OTHER``, ``SCHED_BATCH``, ``SCHED_IDLE``: so
    ``SCHED_FIFO``, ``SCHED_RR``, ``SCHED_DEADLINE``), or with a lower niceness than this
    process: a candidate raising its own priority is timed shielded from load the
    baseline is not. The policy is read without its ``SCHED_RESET_ON_FORK`` flag
    (``sched_getscheduler`` returns it or-ed in: ``SCHED_FIFO | SCHED_RESET_ON_FORK``
    is still FIFO)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    shared = {getattr(os, n) for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE") if hasattr(os, n)}
    reset_on_fork = getattr(os, "SCHED_RESET_ON_FORK", 0x40000000)
    found = []
    for proc in tree_pids(pid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc}/task")]
        except (OSError, ValueError):
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                if (os.sched_getscheduler(tid) & ~reset_on_fork) not in shared or os.getpriority(
                    os.PRIO_PROCESS, tid
                ) < nice:
                    found.append(tid)
    return found


def process_tampering(base_pid: int, cand_pid: int) -> str | None:
    """Why the row is ``tampered``, or None: the baseline worker's threads no longer have
    the CPU affinity, scheduling policy and niceness of this process (the judge), or its
    resource limits changed (a candidate's process can change those of another process of
    the same user: Landlock does not cover them; both restored first), or the candidate's
    threads run at a real-time policy or a lower niceness than the judge."""
    if restore_scheduling(base_pid):
        return (
            "the baseline worker's CPU affinity or scheduling was changed during the measurement (restored): "
            "only the candidate's process could have done it"
        )
    limits = restore_limits(base_pid)
    if limits:
        return (
            f"the baseline worker's resource limits ({', '.join(limits)}) were changed during the measurement: "
            "only the candidate's process could have done it"
        )
    if elevated_threads(cand_pid):
        return (
            "the candidate's process raised its own scheduling priority (a real-time policy or a lower "
            "niceness): it would be timed shielded from load the baseline is not"
        )
    return None


def wait_idle(cpu_s, limit_s: float, window_s: float) -> None:
    """Wait (at most ``limit_s``) until ``cpu_s()`` (a process tree's CPU seconds) grows by
    less than 5% of a CPU over ``window_s``: a compiler's worker pool still starting up
    (``torch.compile``) is not work left running; what still runs when the timing starts is."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        cpu0 = cpu_s()
        time.sleep(window_s)
        if cpu_s() - cpu0 < 0.05 * window_s:
            return


def kill_tree(pid: int) -> None:
    """SIGKILL a worker and every process it started (a candidate may spawn helpers),
    the deepest first (:func:`tree_pids`); each is recorded in :data:`KILLED`."""
    import psutil

    # psutil.Process records each one's start time, so a pid reused since the walk is not killed
    procs = []
    for p in tree_pids(pid):
        with contextlib.suppress(psutil.Error):
            procs.append((psutil.Process(p), _start_time(p)))
    for proc, start in reversed(procs):
        with contextlib.suppress(psutil.Error):
            proc.kill()
            if start is not None:
                KILLED[proc.pid] = start


@contextlib.contextmanager
def sigint_blocked():
    """SIGINT blocked in the calling thread while the block runs: a fork server started
    in it begins with SIGINT blocked (a blocked signal stays blocked across exec), so a
    Ctrl-C while the server's Python starts waits until its first import
    (:mod:`kb_nano.kernels.quiet_start`) ignores it. Python's own SIGINT handling, in
    the main thread, is unaffected when the calling thread is another. multiprocessing's
    resource tracker is started first: starting it unblocks SIGINT in the calling thread
    (``multiprocessing.resource_tracker.ResourceTracker.ensure_running``)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def quiet_when_owner_gone():
    """Around the whole of a judge's or worker's life: its owner's end of the pipe closed
    (the owner interrupted, killed or done) ends the process with status 1 and no
    traceback (``EOFError`` on a receive, ``ConnectionError`` such as ``BrokenPipeError``
    on a send), wherever it was; the process's output is the job's stderr until it is
    redirected, and an interrupted run must read clean."""
    try:
        yield
    except (EOFError, ConnectionError):
        raise SystemExit(1) from None
