"""The judge's worker processes: one baseline worker and one worker per candidate file,
kept between scenarios, and the request/reply plumbing with its timeouts.

Workers are started from a ``forkserver`` that imported torch and the worker modules
once, never forked from the judge (whose memory maps the other side's slots). A worker
whose candidate crashed, hung, ran into a runtime error or broke a rule is killed with
everything it started; the next scenario gets a fresh one.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from pathlib import Path

from kb_nano.kernels.fork_sockets import use_abstract_unix_sockets
from kb_nano.kernels.procs import EXTERNAL_SIGNALS, LIVE_WORKERS, WORKERS_LOCK, kill_worker, tree_cpu_s

use_abstract_unix_sockets()

MAX_REPLY_BYTES = 1 << 20  # a worker's JSON reply; more is a protocol violation
# idle candidate workers kept per judge (least recently used go first): a sweep's jobs come
# in any order, so about one per candidate file; a CUDA worker holds a context on the GPU
MAX_CANDIDATE_WORKERS = {"cpu": 16, "cuda": 8}
START_S = 120.0  # longest start of a worker (fork, torch threads, CUDA context) before the scenario clock


class WorkerGone(Exception):
    """The worker process died (``reason`` says how); ``interrupted`` when it died of one
    of :data:`kb_nano.kernels.procs.EXTERNAL_SIGNALS` (a Ctrl-C, kill), which ends the job without a row when
    the worker is the baseline's."""

    def __init__(self, reason: str, interrupted: bool = False, role: str = "") -> None:
        super().__init__(reason)
        self.interrupted = interrupted
        self.role = role


class WorkerTimeout(Exception):
    """The worker did not answer before the scenario's deadline."""


class WorkerHandle:
    """The judge's end of one worker. ``ready`` is the worker's first reply (its sandbox,
    thread count, and for a candidate the import's violation, if any)."""

    def __init__(self, ctx, spec: dict, log_fd: int, deadline: float, wait: bool = True) -> None:
        self.role = spec["role"]
        self.conn, child = ctx.Pipe(duplex=True)
        from kb_nano.kernels import worker_process  # (torch: not at import, see judge_process.serve)

        self.proc = ctx.Process(target=worker_process.main, args=(child, spec), name=f"kb_nano {self.role}")
        with WORKERS_LOCK:
            self.proc.start()
            self.pid = self.proc.pid
            LIVE_WORKERS.add(self.pid)
        child.close()
        self.log_fd = log_fd
        self._ready: dict | None = None
        try:
            self._send_fd(log_fd)  # the worker's stdout/stderr from its first line on
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_ready(deadline)

    def wait_ready(self, deadline: float) -> dict:
        """The worker's first reply, waited for once (a worker started with ``wait=False``
        starts up while the judge does other things)."""
        if self._ready is None:
            try:
                self._ready = self._receive(deadline)
            except BaseException:
                self.close()
                raise
        return self._ready

    def started(self) -> bool:
        """The worker finished its start (its first reply is read or waiting in the pipe)."""
        return self._ready is not None or self.conn.poll(0)

    @property
    def ready(self) -> dict:
        """The first reply (see :meth:`wait_ready`, which must have returned)."""
        assert self._ready is not None, "wait_ready() first"
        return self._ready

    def request(self, msg: dict, deadline: float, shared=None) -> dict:
        """Send ``msg`` (and then ``shared``'s descriptor, see :mod:`kb_nano.kernels.shm`)
        and return the reply. Raises :class:`WorkerTimeout` past ``deadline`` (a
        ``time.monotonic`` value) and :class:`WorkerGone` when the worker died."""
        try:
            if shared is not None:
                shared.send(self.conn, self.pid, **msg)
            else:
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self._gone() from None
        return self._receive(deadline)

    def send_log(self, fd: int, deadline: float) -> None:
        """Point the worker's stdout and stderr at the scenario's log file ``fd``."""
        self.log_fd = fd
        self._send_fd(fd)
        self._receive(deadline)

    def _send_fd(self, fd: int) -> None:
        from multiprocessing.reduction import send_handle

        try:
            self.conn.send({"cmd": "log"})
            send_handle(self.conn, fd, self.pid)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self._gone() from None

    def _receive(self, deadline: float) -> dict:
        ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise WorkerTimeout(f"the {self.role} worker did not answer in time")
        if self.conn in ready:
            try:
                data = _recv_by(self.conn, deadline, self.role)
            except (EOFError, OSError):
                raise self._gone() from None
            try:
                reply = json.loads(data)
            except ValueError:
                reply = None
            if not isinstance(reply, dict):
                raise WorkerGone(f"the {self.role} worker sent a malformed reply")
            return reply
        raise self._gone()

    def _gone(self) -> WorkerGone:
        self.proc.join(5)
        code = self.proc.exitcode
        if code is not None and code < 0 and -code in EXTERNAL_SIGNALS:
            name = signal.Signals(-code).name
            return WorkerGone(f"the {self.role} worker died of {name}", interrupted=True, role=self.role)
        from kb_nano.kernels.worker_process import SELF_SIGINT_STATUS

        if code == SELF_SIGINT_STATUS:
            return WorkerGone(f"the {self.role} sent SIGINT to its own process")
        how = (
            f"killed by signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with status {code}"
        )
        return WorkerGone(f"{self.role} worker {how} without a result" + _last_line(self.log_fd), role=self.role)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the worker and everything it started."""
        return tree_cpu_s(self.pid)

    def close(self) -> None:
        """Kill the worker, its tree and any process beside the workers (it stays live until reaped)."""
        with WORKERS_LOCK:
            kill_worker(self.pid, LIVE_WORKERS)
        self.proc.join(5)
        LIVE_WORKERS.discard(self.pid)
        self.conn.close()


def _recv_by(conn, deadline: float, role: str) -> bytes:
    """``conn.recv_bytes`` that gives up at ``deadline`` even when a worker sent only part
    of a message (``SIGALRM``; in the main thread, where the judge runs)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return conn.recv_bytes(MAX_REPLY_BYTES)

    def expire(*_):
        raise WorkerTimeout(f"the {role} worker sent part of a reply and stopped")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(0.05, deadline - time.monotonic()))
    try:
        return conn.recv_bytes(MAX_REPLY_BYTES)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _last_line(fd: int) -> str:
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, 4096, max(0, size - 4096)).decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in data.splitlines() if ln.strip()]
    return f": {lines[-1][:200]}" if lines else ""


def candidate_key(path: Path, settings: dict) -> tuple:
    """What a candidate worker is kept for: its file's and helpers' bytes (an edit starts
    a new worker) and the settings fixed at its start."""
    from kb_nano.candidates import candidate_digest

    return (str(Path(path).resolve()), candidate_digest(path), _fixed(settings))


def _fixed(settings: dict) -> tuple:
    return (
        int(settings["num_threads"]),
        str(settings.get("float32_matmul_precision") or "highest"),
        settings.get("memory_limit_gb"),
    )


_CONTEXT = None


def worker_context():
    """The ``forkserver`` context workers start from (its server imports torch and the
    worker modules once); one per judge process. :func:`prewarm` starts the server early."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        preload = ["kb_nano.kernels.quiet_start", "kb_nano.kernels.worker_server", "kb_nano.kernels.worker_process"]
        ctx.set_forkserver_preload(preload)  # (judge_process.serve replaced __main__: no Snakemake script)
        _CONTEXT = ctx
    return _CONTEXT


def prewarm() -> None:
    """Start the worker fork server in the background (it imports torch: seconds), while
    the judge waits for its first request."""
    import threading
    from multiprocessing import forkserver

    from kb_nano.kernels.procs import sigint_blocked

    worker_context()
    start = sigint_blocked()(forkserver.ensure_running)  # SIGINT blocked as it starts (kernels.quiet_start)
    threading.Thread(target=start, name="kb_nano-forkserver", daemon=True).start()


class Pool:
    """The workers of one judge (one device): ``device`` as the judge names it
    (``cpu``, ``cuda:0``); ``env`` is set in every worker first; ``root`` is the
    workflow directory (its ``results/`` is hidden from candidates)."""

    def __init__(self, device: str, env: dict, root: Path) -> None:
        self.ctx = worker_context()
        self.device = device
        self.env = dict(env)
        self.root = Path(root)
        self.baseline: WorkerHandle | None = None
        self.baseline_key = None
        self.candidates: collections.OrderedDict[tuple, WorkerHandle] = collections.OrderedDict()
        self.scratch = Path(tempfile.mkdtemp(prefix="kb_nano-"))

    def _spec(self, role: str, settings: dict) -> dict:
        return {
            "role": role,
            "device": self.device,
            "env": self.env,
            "owner_pid": os.getpid(),
            "num_threads": int(settings["num_threads"]),
            "memory_limit_gb": settings.get("memory_limit_gb"),
            "precision": str(settings.get("float32_matmul_precision") or "highest"),
        }

    def start_baseline(self, settings: dict, log_fd: int, deadline: float) -> None:
        """Start the baseline worker when it is missing or its settings changed, without
        waiting for it (it starts up while the candidate's worker does)."""
        key = _fixed(settings)
        if self.baseline is not None and (self.baseline_key != key or not self.baseline.proc.is_alive()):
            self.discard(self.baseline)
        if self.baseline is None:
            self.baseline = WorkerHandle(self.ctx, self._spec("baseline", settings), log_fd, deadline, wait=False)
            self.baseline_key = key

    def get_baseline(self, settings: dict, log_fd: int, deadline: float) -> WorkerHandle:
        """The baseline worker, ready (started when missing or when its settings changed)."""
        self.start_baseline(settings, log_fd, deadline)
        self.baseline.wait_ready(deadline)
        return self.baseline

    def get_candidate(
        self, path: Path, target: str, settings: dict, log_fd: int, deadline: float, wait: bool = True
    ) -> WorkerHandle:
        """The worker of candidate file ``path`` (started, sandboxed and importing the
        candidate when there is none for the file's current bytes), ready unless ``wait``
        is false."""
        key = candidate_key(path, settings)
        stale = [k for k in self.candidates if k[0] == key[0] and k != key]
        for k in stale:
            self.discard(self.candidates[k])
        handle = self.candidates.get(key)
        if handle is not None and handle.proc.is_alive():
            self.candidates.move_to_end(key)
            if wait:
                handle.wait_ready(deadline)
            return handle
        while len(self.candidates) >= MAX_CANDIDATE_WORKERS.get(self.device.split(":")[0], 8):
            self.discard(next(iter(self.candidates.values())))
        scratch = self.scratch / key[1][:16]
        cache = cache_dir() / key[1][:16]
        for d in (scratch, cache):
            d.mkdir(parents=True, exist_ok=True)
        env = {
            **self.env,
            "TMPDIR": str(scratch),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "CUDA_CACHE_PATH": str(cache / "nv"),
            "NUMBA_CACHE_DIR": str(cache / "numba"),
            # Inductor compiles in the worker, not in a pool of compile processes that may
            # still be busy starting up when the baseline is timed (which reads as work left running)
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "HOME": str(scratch),
        }
        spec = {
            **self._spec("candidate", settings),
            "env": env,
            "path": str(path),
            "target": target,
            "writable": [str(scratch), str(cache)],
            "hidden": [str(self.root / "results")],
        }
        handle = WorkerHandle(self.ctx, spec, log_fd, deadline, wait=wait)
        self.candidates[key] = handle
        return handle

    def warm(self, files: list[tuple[str, str]], settings: dict, log_fd: int, deadline: float) -> int:
        """Start, without waiting, the workers of candidate files ``files`` (``(path,
        target)`` pairs) that have none, as many as the cap leaves room for: on a GPU host a
        worker's start (CUDA context, CUPTI) takes seconds, and started together they take
        it once, on idle cores. Returns how many it started."""
        started = 0
        cap = MAX_CANDIDATE_WORKERS.get(self.device.split(":")[0], 8)
        for path, target in files:
            if len(self.candidates) >= cap:
                break
            p = Path(path)
            if not p.is_file() or candidate_key(p, settings) in self.candidates:
                continue
            self.get_candidate(p, target, settings, log_fd, deadline, wait=False)
            started += 1
        return started

    def idle_workers(self, busy: WorkerHandle) -> dict[str, WorkerHandle]:
        """The started candidate workers other than ``busy``, by their file's path: while
        ``busy``'s scenario is measured they are stopped (:func:`kb_nano.kernels.procs.pause_trees`),
        as their threads could otherwise burn CPU while the baseline is timed, or change
        the baseline worker's priority and get ``busy``'s row called ``tampered``. Workers
        still starting run on (their start overlaps the measurement by design)."""
        return {key[0]: h for key, h in self.candidates.items() if h is not busy and h.started()}

    def discard(self, handle: WorkerHandle | None) -> None:
        """Kill ``handle``'s worker and forget it."""
        if handle is None:
            return
        handle.close()
        if handle is self.baseline:
            self.baseline = None
        for k, h in list(self.candidates.items()):
            if h is handle:
                del self.candidates[k]

    def close(self) -> None:
        """Kill every worker (all the trees first, then wait for each)."""
        handles = [h for h in [self.baseline, *self.candidates.values()] if h is not None]
        with WORKERS_LOCK:
            for h in handles:
                kill_worker(h.pid, LIVE_WORKERS)
        for h in handles:
            self.discard(h)
        import shutil

        shutil.rmtree(self.scratch, ignore_errors=True)


def cache_dir() -> Path:
    """Where candidates' compilers may cache (Triton, Inductor, numba, the CUDA JIT): one folder
    per candidate file content under ``$XDG_CACHE_HOME/kb_nano/candidates`` (``~/.cache/kb_nano``),
    so no candidate can plant entries in another's cache."""
    from kb_nano.files import user_cache_dir

    return user_cache_dir("candidates")
