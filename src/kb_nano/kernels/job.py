"""One kernel job as Snakemake runs it: candidate x scenario -> one Parquet shard.

The ``kernel_bench`` rule's ``run:`` block calls :func:`run_job` in a thread of the
Snakemake process (``force-use-threads``). The job leases its GPU (:mod:`kb_nano.gpus`),
hands the scenario to the judge process of that device and waits; the judge
(:mod:`kb_nano.kernels.judge_process`) measures with its persistent workers and writes the
signed shard. One judge per device serves every job of the invocation, one scenario at
a time, so imports, CUDA contexts and compiled kernels are paid once; Snakemake still
sees one job and one shard per scenario, so incremental reruns stay exact. On SLURM each
submitted job is its own Snakemake process: jobs share a judge (and its workers) only
inside one submission, e.g. a Snakemake ``group`` (docs/tiers.md).

When the judge dies or stops answering, this thread writes a ``crashed`` row, so every
job ends with a row; a Ctrl-C ends the job without one (it reruns next time).
Torch-free: the Snakemake process stays light.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from kb_nano.candidates import file_sha256
from kb_nano.kernels import signing
from kb_nano.kernels.procs import EXTERNAL_SIGNALS, sigint_blocked
from kb_nano.kernels.schema import make_row, scenario_fields, write_rows

JUDGE_GRACE_S = 180.0  # beyond timeout_s: the judge's own work (worker starts, roofline, shard)
_CONTEXT: multiprocessing.context.BaseContext | None = None
_LOCK = threading.Lock()
_JUDGES: dict[str, Judge] = {}


def judge_context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context whose server preloads the judge's module (torch-free: a
    judge imports torch while its workers' fork server does); created on first use, once
    per process. (``snakemake.cli``: when Snakemake runs as
    its console script, multiprocessing re-imports that script in every child, 0.6 s
    each unless the server has it already.)"""
    global _CONTEXT
    with _LOCK:
        if _CONTEXT is None:
            from kb_nano.kernels.fork_sockets import use_abstract_unix_sockets

            use_abstract_unix_sockets()
            ctx = multiprocessing.get_context("forkserver")
            preload = ["kb_nano.kernels.judge_process"]
            if "snakemake.cli" in sys.modules:
                preload.insert(0, "snakemake.cli")
            preload.insert(0, "kb_nano.kernels.quiet_start")  # a Ctrl-C while the server imports: no traceback
            ctx.set_forkserver_preload(preload)
            _CONTEXT = ctx
        return _CONTEXT


class Judge:
    """The Snakemake side of one judge process (one device); ``lock`` gives it to one job
    at a time."""

    def __init__(self, key: str, gpu_ids: list[str], bind_later: bool = False) -> None:
        from kb_nano.kernels import judge_process

        ctx = judge_context()
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)} if gpu_ids else {}
        self.conn, child = ctx.Pipe(duplex=True)
        spec = {"env": env, "owner_pid": os.getpid(), "gpu_ids": ",".join(gpu_ids) or None, "bind_later": bind_later}
        self.proc = ctx.Process(target=judge_process.serve, args=(child, spec), name=f"kb_nano judge {key}")
        with _LOCK, sigint_blocked():  # Process.start() polls the other live children (multiprocessing's _cleanup)
            self.proc.start()
        child.close()
        self.lock = threading.Lock()
        self.key = key

    def ask(self, request: dict, timeout_s: float) -> dict:
        """Send one request; the reply, or ``{"dead": exitcode}`` / ``{"hung": True}``."""
        try:
            self.conn.send(request)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return {"dead": self.proc.exitcode}
        ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout_s)
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                pass
        if not ready:
            return {"hung": True}
        with _LOCK:
            self.proc.join(5)
        return {"dead": self.proc.exitcode}

    def close(self) -> None:
        from kb_nano.kernels.procs import kill_tree

        kill_tree(self.proc.pid)
        with _LOCK:
            self.proc.join(5)


_CREATE_LOCK = threading.Lock()  # one judge per device, even when two job threads ask at once
_SPARE: dict = {}  # "thread": the prestart thread, "judge": the judge it started (see prestart)
_EXIT_HOOK: list = []


def _close_at_exit() -> None:
    if not _EXIT_HOOK:
        import atexit

        # before multiprocessing's own exit handler, which would wait for the judges forever
        atexit.register(close_judges)
        _EXIT_HOOK.append(True)


def prestart() -> None:
    """Start a judge before any kernel job asks for one, in a background thread: it imports
    torch and starts its workers' fork server while Snakemake parses the workflow and
    builds the manifest (seconds on a cold host). The first job takes it over for its
    device (:func:`_judge` binds it to the job's GPUs); unused, it ends with the process.
    The CLI asks for it (``KB_NANO_PRESTART_JUDGE=1``) on local, non-dry runs."""

    def start() -> None:
        with contextlib.suppress(Exception):  # a failed prestart only costs the speed-up
            _SPARE["judge"] = Judge("spare", [], bind_later=True)

    with _LOCK:
        _close_at_exit()
        if "thread" not in _SPARE:
            _SPARE["thread"] = threading.Thread(target=start, name="kb_nano-prestart", daemon=True)
            _SPARE["thread"].start()


def warm_candidates(files: list[tuple[str, str]]) -> None:
    """Candidate files (``(path, target)``) whose workers the prestarted judge starts all
    at once when its first CUDA job arrives (:meth:`kb_nano.kernels.pool.Pool.warm`): the
    Snakefile passes those with shards still missing."""
    _SPARE["warm"] = [[str(Path(p).resolve()), t] for p, t in files]


def _take_spare(key: str, gpu_ids: list[str]) -> Judge | None:
    """The prestarted judge, bound to ``gpu_ids`` (its ``CUDA_VISIBLE_DEVICES``), or None."""
    thread = _SPARE.get("thread")
    if thread is None:
        return None
    thread.join()
    judge = _SPARE.pop("judge", None)
    if judge is None or not judge.proc.is_alive():
        return None
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)} if gpu_ids else {}
    reply = judge.ask(
        {"bind": {"env": env, "gpu_ids": ",".join(gpu_ids) or None, "warm": _SPARE.get("warm", [])}}, 60.0
    )
    if not reply.get("bound"):
        judge.close()
        return None
    judge.key = key
    return judge


def _judge(key: str, gpu_ids: list[str]) -> Judge:
    with _CREATE_LOCK:
        with _LOCK:
            judge = _JUDGES.get(key)
            _close_at_exit()
        if judge is None or not judge.proc.is_alive():
            judge = _take_spare(key, gpu_ids) or Judge(key, gpu_ids)
            with _LOCK:
                _JUDGES[key] = judge
        return judge


def close_judges() -> None:
    """End every judge of this process (each kills its workers), at the latest after 10 s."""
    thread = _SPARE.get("thread")
    if thread is not None:
        thread.join(30)
    with _LOCK:
        judges = list(_JUDGES.values())
        _JUDGES.clear()
        if "judge" in _SPARE:
            judges.append(_SPARE.pop("judge"))
    for judge in judges:
        try:
            judge.conn.send(None)
        except (OSError, EOFError):
            pass
    deadline = time.monotonic() + 10
    for judge in judges:
        judge.proc.join(max(0.0, deadline - time.monotonic()))
        if judge.proc.is_alive():
            judge.close()


def _forget(judge: Judge) -> None:
    judge.close()
    with _LOCK:
        if _JUDGES.get(judge.key) is judge:
            del _JUDGES[judge.key]


def run_job(input, output, params, wildcards, threads, resources, log) -> str:
    """The ``kernel_bench`` rule's ``run:`` block: Snakemake's job objects -> :func:`run`."""
    import json

    return run(
        scenario=json.loads(params.scenario),
        candidate_id=f"{wildcards.target}/{wildcards.name}",
        candidate_path=input.candidate,
        settings={**params.settings, "num_threads": threads, "golden": params.golden},
        output=output[0],
        log=log[0],
        root=os.getcwd(),
        gpus=int(resources.get("gpu", 0)),
    )


def gpus_to_lease(declared: int, device: str, pool_ids: list[str]) -> int:
    """Devices a kernel job leases: its declared Snakemake ``resources.gpu`` when the
    device setting is ``cuda``, or ``auto`` with a non-empty pool (``auto`` on a host
    without GPUs runs on the CPU and leases nothing). ``cuda:i`` pins device ``i`` as the
    user asked and leases nothing; ``cpu`` leases nothing."""
    if device == "cuda" or (device == "auto" and pool_ids):
        return int(declared)
    return 0


def run(
    scenario: dict,
    candidate_id: str,
    candidate_path: str,
    settings: dict,
    output: str,
    log: str,
    root: str,
    gpus: int = 0,
) -> str:
    """Lease the job's GPUs, have the device's judge measure, make sure ``output`` holds a
    row afterwards; returns the row status.

    ``settings``: see :func:`kb_nano.kernels.measure.measure` (``timeout_s`` is also the
    longest wait for a free GPU). ``gpus``: the job's declared ``resources.gpu`` (see
    :func:`gpus_to_lease`). Raises ``KbNanoError`` (no row: the job is retried next run)
    when the pool is too small or no device becomes free in time, and
    when the judge or the baseline worker was interrupted (SIGINT: no row either; raises
    KeyboardInterrupt instead when Snakemake was interrupted too, see :func:`_interrupted`)."""
    from kb_nano import gpus as leasing

    pool_ids = leasing.pool()
    n = gpus_to_lease(gpus, str(settings["device"]), pool_ids)
    root_p = Path(root)
    out = Path(output) if Path(output).is_absolute() else root_p / output
    log_p = Path(log) if Path(log).is_absolute() else root_p / log
    asked_at = time.time()
    with leasing.lease(n, root_p / "results/.locks", float(settings["timeout_s"]), ids=pool_ids) as ids:
        key = ",".join(ids) if ids else f"{settings['device']}"
        request = {
            "asked_at": asked_at,
            "scenario": scenario,
            "candidate_id": candidate_id,
            "candidate_path": str(candidate_path),
            "settings": settings,
            "output": str(out),
            "log": str(log_p),
            "root": str(root_p),
        }
        t0, started_at = time.perf_counter(), _utc_now()
        for attempt in range(3):
            judge = _judge(key, ids)  # (a dead one is replaced)
            with judge.lock:
                # a judge that died under the job before this one (that job has its row) is
                # replaced, not asked: its death is not this job's candidate's doing
                if judge.proc.is_alive() or attempt == 2:
                    reply = judge.ask(request, float(settings["timeout_s"]) + JUDGE_GRACE_S)
                    break
            code = judge.proc.exitcode  # ... unless a signal from outside ended it: the run is stopping
            if code is not None and code < 0 and -code in EXTERNAL_SIGNALS:
                _interrupted(f"{candidate_id} on {scenario['scenario_id']}", log_p, signal.Signals(-code).name)
        if "status" in reply:
            return reply["status"]
        dead = reply.get("dead")
        if "interrupted" in reply or (dead is not None and dead < 0 and -dead in EXTERNAL_SIGNALS):
            how = signal.Signals(-dead).name if dead is not None and dead < 0 else _signal_named(reply["interrupted"])
            _interrupted(f"{candidate_id} on {scenario['scenario_id']}", log_p, how)
        _forget(judge) if "status" not in reply and "error" not in reply else None
        if "error" in reply:
            log_p.parent.mkdir(parents=True, exist_ok=True)
            with open(log_p, "a") as f:
                f.write(reply.get("traceback", ""))
            error = f"harness error (not the candidate's): {reply['error']} (log: {log_p})"
        elif reply.get("hung"):
            error = f"the judge did not answer within timeout_s + {JUDGE_GRACE_S:.0f} s; killed (log: {log_p})"
        else:
            error = f"the judge process died ({_how(reply.get('dead'))}) (log: {log_p})"
        row = make_row(
            **scenario_fields(scenario),
            candidate=candidate_id,
            candidate_sha256=file_sha256(root_p / candidate_path),
            gpu_ids=",".join(ids) or None,
            status="crashed",
            error=error,
            num_warmup=int(settings["num_warmup"]),
            num_runs=int(settings["num_runs"]),
            created_at=_utc_now()[:19] + "+00:00",
            started_at=started_at,
            ended_at=_utc_now(),
            wall_s=time.perf_counter() - t0,
        )
        write_rows([row], out, secret=signing.key(root_p))
        return "crashed"


def _signal_named(reason: str) -> str:
    """The signal's name in a :class:`kb_nano.kernels.pool.WorkerGone` reason ("the
    baseline worker died of SIGKILL" -> "SIGKILL"), else the reason itself."""
    return reason.rsplit(" ", 1)[-1] if reason.rsplit(" ", 1)[-1].startswith("SIG") else reason


def _interrupted(job: str, log_p: Path, how: str = "SIGINT") -> None:
    """End a job whose judge or baseline worker died of a signal from outside (``how``:
    :data:`kb_nano.kernels.procs.EXTERNAL_SIGNALS`; the candidate cannot signal either),
    without a row (the next run redoes it), with one line in its log. When the Snakemake
    process got a SIGINT too (a Ctrl-C, kb_nano stopping the run: :func:`kb_nano.interrupts.interrupted`), one
    line on stderr and ``KeyboardInterrupt``, which Snakemake, already stopping, drops
    without a failed job's report. Otherwise (only the workers got it) a job error that
    names it, which ends the run; not KeyboardInterrupt, which would leave Snakemake's
    scheduler waiting for the job forever."""
    from kb_nano.errors import KbNanoError
    from kb_nano.interrupts import interrupted

    message = f"{job}: interrupted ({how}); no row, the next run redoes this job"
    with contextlib.suppress(OSError):
        log_p.parent.mkdir(parents=True, exist_ok=True)
        with open(log_p, "a") as f:
            f.write(f"kb_nano: {message}\n")
    if interrupted(wait_s=2.0):
        print(f"kb-nano: {message}", file=sys.stderr)
        raise KeyboardInterrupt
    raise KbNanoError(message)


def _how(code) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit status {code}"


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
