"""The life of a worker process: sandbox, signals, its judge's requests.

:func:`main` is the ``multiprocessing`` target the judge starts (from a fork server that
imported torch once). Order matters: the sandbox is applied while the process still has
one thread (Landlock binds the calling thread and what it starts later), then the
watcher threads start, then the candidate is imported.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback

import torch

from kb_nano.kernels import heap, shm
from kb_nano.kernels.procs import become_subreaper, quiet_when_owner_gone
from kb_nano.kernels.worker import Side, spec_of

PRECISIONS = ("highest", "high", "medium")
SELF_SIGINT_STATUS = 3  # exit status of a worker whose candidate sent SIGINT to its own process


def _die_with_owner(owner_pid: int) -> None:
    """SIGKILL this worker as soon as its judge is gone, even when the judge was
    SIGKILLed: a daemon thread waits on a Linux pidfd of the owner (``os.pidfd_open``;
    Linux >= 5.3), else polls it twice a second. So an interrupted sweep leaves no
    orphan that could run on unbounded."""
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
    from this process (``si_pid``), it is the candidate's: the worker says so and exits
    with :data:`SELF_SIGINT_STATUS` (the judge writes a ``crashed`` row saying so). From anywhere else (the
    terminal's Ctrl-C, ``kill -INT``), it dies of SIGINT, which the judge reads as an
    interruption (no row; the next run redoes the job)."""
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def watch() -> None:
        info = signal.sigwaitinfo({signal.SIGINT})
        if info.si_pid == os.getpid():
            print("the candidate sent SIGINT to its own process", flush=True)
            os._exit(SELF_SIGINT_STATUS)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)  # default action: die of SIGINT

    threading.Thread(target=watch, name="kb_nano-sigint", daemon=True).start()


def limit_memory(gigabytes: float | None, device: torch.device) -> None:
    """Cap this process's address space at ``gigabytes`` GiB (``RLIMIT_AS``) on a CPU
    run, so a candidate that allocates without bound gets an allocation error
    (``runtime_error``) instead of the host's out-of-memory killer. CUDA runs are not
    capped (the driver maps far more address space than it uses; the device's own
    allocator raises ``torch.OutOfMemoryError`` there). ``None``: no cap."""
    if gigabytes is None or device.type != "cpu":
        return
    import resource

    limit = int(float(gigabytes) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def set_precision(precision: str) -> bool:
    """Fix float32 matmul precision: ``torch.set_float32_matmul_precision(precision)`` and
    cuDNN's TF32 switch to match (TF32 allowed unless ``"highest"``). Returns whether
    TF32 is allowed. Raises ``ValueError`` for a precision outside :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"float32_matmul_precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != "highest"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _warm_thread_pools() -> None:
    """Start torch's intra-op (OpenMP) and BLAS thread pools before any candidate runs, so
    :class:`kb_nano.kernels.checks.ThreadWatch` never takes a pool thread that a
    candidate's first parallel op would start for the candidate's own."""
    a = torch.randn(256, 256)
    (a @ a).sum()
    torch.ones(1 << 22).sum()


def _reply(conn, obj: dict) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(json.dumps(obj, default=str).encode())


def _slots(tensors: list, pattern: list[bool]) -> list[list]:
    """Per slot ``k``, row ``k`` of each shared ``[slots, ...]`` tensor (None where the
    pattern has no tensor: an output that is None)."""
    it = iter(tensors)
    full = [next(it) if present else None for present in pattern]
    n = next((t.shape[0] for t in full if t is not None), 0)
    return [[None if t is None else t[k] for t in full] for k in range(n)]


def main(conn, spec: dict) -> None:
    """Entry point of a worker process (see :func:`_serve` for ``spec``). A judge that is
    gone (its end of ``conn`` closed: interrupted, killed) ends the worker quietly, at any
    point of its start or its loop, without a traceback in the job's output."""
    with quiet_when_owner_gone():
        _serve(conn, spec)


def _serve(conn, spec: dict) -> None:
    """Set the worker up and answer its judge's requests. ``spec``: ``role`` (``baseline`` | ``candidate``),
    ``device``, ``env`` (set first: ``CUDA_VISIBLE_DEVICES``, ``TMPDIR``, cache
    directories), ``owner_pid`` (the judge), ``num_threads``, ``precision``,
    ``memory_limit_gb``; a candidate's also ``path``, ``target``, ``writable`` and
    ``hidden`` (the sandbox's paths)."""
    os.environ.update(spec.get("env") or {})
    import tempfile

    tempfile.tempdir = None  # the fork server's import of torch cached the old TMPDIR
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _handle(None, conn, conn.recv())  # the log file first: everything after lands in it
    sandbox = None
    candidate = spec["role"] == "candidate"
    if candidate:
        from kb_nano.kernels import sandbox as landlock
        from kb_nano.kernels.seccomp import deny_sigchld_changes

        # its own /proc/<pid> stays writable: the CUDA driver writes there (cudaGetDeviceCount fails with
        # error 304 otherwise; seen on the H200 host)
        sandbox = landlock.restrict([*spec["writable"], f"/proc/{os.getpid()}"], spec["hidden"])
        sandbox += f"; {deny_sigchld_changes()}"  # exited helpers' CPU time cannot vanish (kernels.seccomp)
        _sort_sigint()  # before any other thread starts: they inherit the blocked SIGINT
    _die_with_owner(int(spec["owner_pid"]))
    become_subreaper()
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:
        device = spec["device"] = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES names the leased GPU
    if candidate:
        limit_memory(spec.get("memory_limit_gb"), device)
    heap_note = heap.configure() if device.type == "cpu" else None
    torch.set_num_threads(int(spec["num_threads"]))
    _warm_thread_pools()
    allow_tf32 = set_precision(spec["precision"]) if device.type == "cuda" else None
    side = Side(spec)
    if device.type == "cuda":
        from kb_nano.kernels.cupti import KernelTimer
        from kb_nano.kernels.timing import L2Flush

        torch.cuda.set_device(device)
        side.flush = L2Flush(device)
        side.kernel_timer = KernelTimer(device, side.flush)  # CUPTI and its threads, before the candidate's code
    if heap_note:
        print(f"kb_nano worker: the heap keeps glibc's defaults ({heap_note}): CPU times are noisier", file=sys.stderr)
    ready = {"sandbox": sandbox, "allow_tf32": allow_tf32, "num_threads": torch.get_num_threads(), "pid": os.getpid()}
    if candidate:
        from kb_nano.kernels.seccomp import deny_new_sockets

        ready["sandbox"] += f", {deny_new_sockets()}"  # no tmux / D-Bus / docker server acts for it (kernels.seccomp)
        ready["violation"] = _load(side, spec)
    # what exists now (torch, the candidate's module) lives as long as the worker: the
    # collections after each scenario (Side.teardown) need not scan it again
    gc.collect()
    gc.freeze()
    _reply(conn, ready)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd = msg["cmd"]
        if cmd == "exit":
            return
        try:
            _reply(conn, _handle(side, conn, msg))
        except Exception as exc:
            traceback.print_exc()
            from kb_nano.candidates import one_line

            _reply(conn, {"violation": ["runtime_error", f"{cmd}: {one_line(exc)}"]})


def _load(side: Side, spec: dict):
    """Import the candidate, with the guard's snapshot taken first; the violation or None."""
    from kb_nano import operators
    from kb_nano.candidates import CandidateError, load_class
    from kb_nano.kernels.guard import Namespaces

    op = operators.get(spec["target"])
    baseline_attrs = dict(vars(op.baseline))
    side.guard = Namespaces(op.baseline)
    try:
        side.cls = load_class(spec["path"], spec["target"])
    except CandidateError as exc:
        return [exc.status, str(exc)]
    if dict(vars(op.baseline)) != baseline_attrs:
        return ["tampered", f"importing the candidate modified the baseline class {op.baseline.__name__}"]
    found = side.check_guard("on import")
    return list(found) if found else None


def _handle(side: Side | None, conn, msg: dict) -> dict:
    cmd = msg["cmd"]
    if cmd == "log":
        fd = shm.recv_handle(conn)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return {"ok": True}
    if cmd == "shared":
        tensors = shm.receive(conn, msg)
        if msg["tag"] == "params":
            if side.role == "baseline":
                side.export(tensors)
            else:
                side.params = tensors
        elif msg["tag"] == "inputs":
            side.inputs = _slots(tensors, msg["pattern"])
        else:
            side.set_outputs(_slots(tensors, msg["pattern"]))
        return {"ok": True}
    if cmd == "supports":
        return side.supports(msg.get("semantics", ""))
    if cmd == "setup":
        return side.setup(msg)
    if cmd == "probe":
        with torch.inference_mode():
            out = side.call(0)
        return {"spec": spec_of(out)}
    if cmd == "trial":
        with torch.inference_mode():
            return side.checked_call(int(msg["slot"]), msg["when"], bool(msg.get("watch", True)))
    if cmd == "batch":
        return side.batch(msg)
    if cmd == "check":
        return side.check_batch()
    if cmd == "teardown":
        found = side.check_guard("at the end")
        side.teardown()
        return {"ok": True, "violation": list(found) if found else None}
    raise ValueError(f"unknown request {cmd!r}")
