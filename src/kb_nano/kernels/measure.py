"""One scenario end to end in the judge: workers from the pool, the steps of
:class:`kb_nano.kernels.judge.Measurement`, the rules only the judge can apply, and the row.

Candidate problems become rows (``import_error``, ``runtime_error``, ``incorrect*``,
``nonfinite``, ``tampered``, ``invalid_output``, ``output_aliased``, ``input_mutated``,
``unsynced_work``, ``skipped``, ``crashed``, ``timeout``); a Ctrl-C that reached a
worker raises :class:`Interrupted` (no row, the job reruns next time); a failure of the
baseline or of the judge itself propagates.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from kb_nano import roofline, stats
from kb_nano.kernels import timing
from kb_nano.kernels.agreement import timer_fields
from kb_nano.kernels.blocks import MIN_BLOCKS, RUN_TO_RUN_SD, estimate, hidden_ms, overhead_noise_ms
from kb_nano.kernels.fields import device_name, resolve_device, row_fields
from kb_nano.kernels.inputs import draw_seed, generator, make_inputs
from kb_nano.kernels.judge import ERROR_FIELDS, HIDDEN_FLOOR_MS, HIDDEN_FRACTION, KEEP_WORKER, Measurement
from kb_nano.kernels.pool import Pool, WorkerGone, WorkerTimeout
from kb_nano.kernels.procs import (
    LIVE_WORKERS,
    WORKERS_LOCK,
    kill_tree,
    pause_trees,
    restore_limits,
    restore_scheduling,
    resume,
    strays,
    tree_cpu_s,
)
from kb_nano.kernels.schema import make_row
from kb_nano.kernels.verdict import WORKER_VERDICTS, Verdict
from kb_nano.operators.base import DTYPES

CROSS_CHECK_RETRIES = 2  # rounds of more batches when the clock cross-check fails (jitter passes, hidden work stays)
# ... and up to this many rounds in all while the check is undecided (over the allowance but
# within the host's noise): on a loaded host the noise of few batches hid a forged clock (0.3x
# times reported: a 2.9x row passed on the 2-core CPU at load 2.5-2.8); it shrinks as
# 1/sqrt(blocks) while the hidden time stays, so more blocks decide it either way
CROSS_CHECK_MAX_ROUNDS = 8
# CPU seconds a stopped worker's tree may gain while another file's row is measured (its
# processes' clocks advance by nothing once stopped; this allows for the stop's own delivery)
PAUSED_CPU_S = 0.02


class Interrupted(Exception):
    """The baseline worker died of a signal from outside (Ctrl-C, kill: the candidate
    cannot signal it), or a stopped worker of another file ran during the measurement:
    the job ends without a row (the message says which)."""


def measure(
    scenario: dict, candidate_id: str, candidate_path: Path, settings: dict, root: Path, pool: Pool, log_fd: int
) -> dict:
    """Run candidate ``candidate_path`` against the baseline on ``scenario``; returns the row.

    ``settings``: ``device``, ``atol``/``rtol`` (None = the operator's), ``num_warmup``,
    ``num_runs``, ``num_trials`` (>= 2), ``num_threads``, ``timeout_s`` (the scenario's
    deadline, worker starts included), ``seed`` (None = drawn from the OS), ``golden``,
    ``cuda_graph``, ``speedup_basis``, ``ci_target``, ``max_timing_s``,
    ``float32_matmul_precision``, ``memory_limit_gb``, ``roofline``.
    ``log_fd``: the job log, which both workers write to."""
    paused: list[int] = []  # other files' idle workers, stopped until the row is decided (also the late stray check)
    idle: dict = {}  # their handles by file, and the CPU seconds their trees had used when stopped
    try:
        row = _measure(scenario, candidate_id, candidate_path, settings, root, pool, log_fd, paused, idle)
        ran = [path for path, (h, cpu) in idle.items() if tree_cpu_s(h.pid) - cpu > PAUSED_CPU_S]
        for path in ran:
            pool.discard(idle[path][0])
        if ran:  # a process that outran the stop: what it did to the timing is unknown
            raise Interrupted(
                f"the stopped worker of {', '.join(ran)} ran during this measurement (killed); the times are void"
            )
        return row
    finally:
        resume(paused)


def _measure(
    scenario: dict,
    candidate_id: str,
    candidate_path: Path,
    settings: dict,
    root: Path,
    pool: Pool,
    log_fd: int,
    paused: list[int],
    idle: dict,
) -> dict:
    """:func:`measure`, which resumes the workers it adds to ``paused`` and checks those of ``idle``."""
    t_start = time.perf_counter()
    device = resolve_device(settings["device"])
    seed = int(settings["seed"]) if settings.get("seed") is not None else draw_seed()
    fields = row_fields(scenario, candidate_id, candidate_path, settings, root, device, seed)
    deadline = time.monotonic() + float(settings["timeout_s"])
    cand = base = m = None
    status, error, extra = "passed", None, {}
    try:
        pool.start_baseline(settings, log_fd, deadline)  # both workers start up at once
        cand = pool.get_candidate(Path(candidate_path), scenario["target"], settings, log_fd, deadline)
        others = pool.idle_workers(cand)  # other candidate files' idle workers: stopped until the row is decided
        paused += pause_trees([h.pid for h in others.values()])
        idle.update({path: (h, tree_cpu_s(h.pid)) for path, h in others.items()})
        _clear_strays(cand.pid)  # left by an earlier job, not this candidate's: ended unblamed
        fields["sandbox"] = cand.ready.get("sandbox")
        cand.send_log(log_fd, deadline)
        found = cand.ready.get("violation")
        if found:
            if not (isinstance(found, list) and len(found) == 2 and found[0] in WORKER_VERDICTS):
                raise Verdict("tampered", f"the candidate's worker sent a verdict no worker sends ({str(found)[:80]})")
            raise Verdict(found[0], str(found[1])[:1000])
        base = pool.get_baseline(settings, log_fd, deadline)
        # what was changed in the baseline worker before this measurement (by a worker now
        # paused, between jobs) is restored, not blamed on this candidate
        restore_scheduling(base.pid)
        restore_limits(base.pid)
        base.send_log(log_fd, deadline)
        fields.update(num_threads=base.ready["num_threads"], allow_tf32=base.ready["allow_tf32"])
        m = Measurement(scenario, settings, root, pool, base, cand, device, seed, deadline)
        m.phases["workers"] = time.perf_counter() - t_start
        with torch.inference_mode():
            extra = _run(m, settings, Path(root))
        fields["input_source"] = m.source
    except Verdict as v:
        status, error, extra = v.status, v.message, {**extra, **v.fields}
    except WorkerTimeout as exc:
        status, error = "timeout", f"exceeded timeout_s={settings['timeout_s']}: {exc}; killed"
        pool.discard(base)  # which of the two hangs is not known: neither is kept
    except WorkerGone as exc:
        if exc.interrupted and exc.role == "baseline":  # Ctrl-C, kill; the candidate's own death by one is its row
            raise Interrupted(str(exc)) from None
        status, error = "crashed", str(exc)
    finally:
        if m is not None:
            m.close()
    status, error = _end(pool, base, cand, status, error)
    late = _clear_strays((base or cand).pid) if (base or cand) is not None else []
    if late and status != "tampered":  # made after the last check, to be blamed on the next row
        status, error = (
            "tampered",
            (
                f"process(es) {', '.join(map(str, late[:3]))} run beside the workers after the measurement, outside "
                "any worker's process tree (clone with CLONE_PARENT)"
            ),
        )
        pool.discard(cand)
    if m is not None:  # where the row's time went, for the job log
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in m.phases.items())
        os.write(log_fd, f"kb_nano: {status} in {time.perf_counter() - t_start:.2f} s ({phases})\n".encode())
    if m is not None and m.compared:
        for name, worst in zip(ERROR_FIELDS, m.worst):
            extra.setdefault(name, worst)
    if status != "passed":
        keep = (*ERROR_FIELDS, "baseline_ms", "candidate_ms", "hidden_work_ms")
        extra = {k: v for k, v in extra.items() if k in keep or k.endswith(("_eager_ms", "_kernel_ms", "_graph_ms"))}
        fields["num_runs"] = None  # no timed calls count: the row was decided before or during them
    return make_row(**{**fields, **extra}, status=status, error=error, wall_s=time.perf_counter() - t_start)


def _clear_strays(worker_pid: int) -> list[int]:
    """Kill the processes beside the workers (:func:`kb_nano.kernels.procs.strays` of
    ``worker_pid``'s fork server); returns their pids."""
    with WORKERS_LOCK:  # no worker of this process is being started or reaped meanwhile
        found = strays(worker_pid, LIVE_WORKERS)
        for pid in found:
            kill_tree(pid)
    return found


def _end(pool: Pool, base, cand, status: str, error: str | None) -> tuple[str, str | None]:
    """Tear both workers down (the candidate's guard looks once more); discard a worker
    whose outcome leaves it untrustworthy (the baseline's after ``tampered``)."""
    for worker in (cand, base):
        if worker is None or not worker.proc.is_alive():
            pool.discard(worker)
            continue
        # after `tampered` the baseline worker may carry what the candidate changed in it: not kept
        keep = status in KEEP_WORKER or (worker is base and status != "tampered")
        if keep:
            try:
                reply = worker.request({"cmd": "teardown"}, time.monotonic() + 30)
            except (WorkerGone, WorkerTimeout):
                reply, keep = {}, False
            found = reply.get("violation")
            if found and worker is cand and status == "passed":
                status, error, keep = found[0], found[1], False
        if not keep:
            pool.discard(worker)
    return status, error


def _run(m: Measurement, settings: dict, root: Path) -> dict:
    """The steps after the workers are up; returns the row's measured fields."""
    device = m.device
    t = time.perf_counter()
    m.prepare()
    t = time.perf_counter()
    num_trials = m.trials()
    m.phases["trials"] = -t + (t := time.perf_counter())
    peak = roofline.peaks(
        device,
        device_name(device),
        DTYPES[m.scenario["dtype"]],
        root / "results/.device",
        settings.get("roofline"),
        working_set=m.scenario.get("bytes_moved"),
    )
    m.phases["roofline peaks"] = -t + (t := time.perf_counter())
    s = m.timed(num_trials + 1)
    m.phases["timed"] = time.perf_counter() - t
    # the judge's clock: on a CPU around the eager batches, on CUDA around the graph replays
    # (device time). Not around CUDA eager batches: there the flush before each call hides
    # its host launch, Triton's launcher costs more of it than torch's, and an honest
    # candidate's batch read up to 1.25 ms (20 calls) over the baseline's on the H200.
    checked = ["eager"] if device.type != "cuda" else [] if "graph" in s["errors"] else ["graph"]
    extra: dict = {}
    # clean without any allowance for noise, or more blocks (host jitter passes with more
    # blocks, hidden work stays): CROSS_CHECK_RETRIES rounds, then more while the check is
    # undecided (within _limit) and the deadline allows; only then is the noise allowed (_limit)
    rounds, round_s = 0, 0.0
    while any(hidden_ms(s[t]) > _allowed(s[t], device) for t in checked):
        undecided = all(hidden_ms(s[t]) <= _limit(s[t], device) for t in checked)
        in_time = time.monotonic() + 3 * round_s + 2.0 < m.deadline
        if rounds >= CROSS_CHECK_RETRIES and not (undecided and in_time and rounds < CROSS_CHECK_MAX_ROUNDS):
            break
        t = time.monotonic()
        m.more(s, MIN_BLOCKS.get(device.type, 10))
        rounds, round_s = rounds + 1, time.monotonic() - t
    for t in checked:
        _cross_check(s[t], m.k if t == "graph" else m.n, device, extra, t)
    extra.update(timer_fields(s, device))
    kernels = s["kernel"]["kernels_cand"]
    if kernels and statistics.median(kernels) == 0 and statistics.median(s["kernel"]["kernels_base"]) > 0:
        raise Verdict(
            "unsynced_work",
            "the candidate's calls ran no GPU work while the kernel timer recorded them "
            "(the baseline's did): its outputs were made by work outside the timed calls",
            **extra,
        )
    hidden = s["kernel"]["hidden"]
    if hidden and max(hidden) > 0:
        raise Verdict(
            "unsynced_work",
            f"{max(hidden):.4g} ms of the candidate's GPU work ran before the first call "
            "of a kernel-timer batch: work left running from earlier calls, outside the timed calls",
            **extra,
        )
    # once more on new values in the slots the timed calls used
    k = num_trials % 2
    gen = generator(device, m.seed ^ 0xA11)
    values, _ = make_inputs(m.scenario, gen, str(device), m.golden, root, draw=num_trials)
    m.trial(k, values, "after the timed calls")
    which = s["basis"]
    p = s[which]
    b_med, c_med = estimate(p)
    b_iqr, c_iqr = timing.summarize(p["base"])[1], timing.summarize(p["cand"])[1]
    run_sd = RUN_TO_RUN_SD.get(device.type, 0.0)
    lo, hi = (None, None)
    if c_med > 0:
        lo, hi = stats.speedup_interval(p["block_base"], p["block_cand"], b_med / c_med, run_sd)
    bound = roofline.bound_ms(m.scenario.get("bytes_moved"), m.scenario.get("flops"), peak)
    # a bound the baseline itself beats was measured wrong (peaks taken on a loaded host): no review
    # then, unless the peaks are the user's own (config `roofline:`)
    measured = not any(v is not None for v in (settings.get("roofline") or {}).values())
    unreliable = measured and bound is not None and b_med < roofline.MARGIN * bound
    review = None if unreliable else roofline.review(c_med, bound, peak)
    if extra.get("timer_check") and "candidate:" in extra["timer_check"]:  # kb_nano.kernels.agreement
        review = "; ".join(filter(None, [review, "the timers disagree on the candidate (timer_check)"]))
    extra.update(
        baseline_ms=b_med,
        candidate_ms=c_med,
        speedup_basis=which,
        num_runs=len(p["base"]),  # the basis timer's timed calls per side
        num_blocks=s["blocks"],
        stop_reason=s["stop"],
        speedup=b_med / c_med if c_med > 0 else None,
        baseline_ms_iqr=b_iqr,
        candidate_ms_iqr=c_iqr,
        speedup_ci_low=lo,
        speedup_ci_high=hi,
        significant=None if lo is None else bool(lo > 1.0 or hi < 1.0),
        l2_flush_bytes=timing.l2_flush_bytes(device),
        l2_flush=timing.L2Flush.mode if device.type == "cuda" else None,
        graph_calls=m.k if "graph" not in s["errors"] else None,
        roofline_ms=bound,
        device_copy_gbps=peak["copy_gbps"],
        review=review,
        **m.clock.fields(),
    )
    return extra


def _allowed(s: dict, device: torch.device) -> float:
    """How much :func:`kb_nano.kernels.blocks.hidden_ms` may be without more blocks:
    :data:`HIDDEN_FRACTION` of the candidate's reported batch time plus
    :data:`HIDDEN_FLOOR_MS`, in ms."""
    return HIDDEN_FRACTION * statistics.median(s["rep_cand"]) + HIDDEN_FLOOR_MS.get(device.type, 0.3)


def _limit(s: dict, device: torch.device) -> float:
    """How much :func:`kb_nano.kernels.blocks.hidden_ms` may be after the extra blocks:
    :func:`_allowed` plus how far ``hidden_ms`` moves by chance on these batches
    (:func:`kb_nano.kernels.blocks.overhead_noise_ms`, from the baseline's batches: on a
    loaded host the scheduler's preemptions land between calls of either side; a candidate
    cannot widen that noise: its processes using CPU while the baseline runs is
    ``unsynced_work`` itself). The noise is allowed only after the extra blocks, because
    it is largest when there are fewest: hidden work passes a noisy first round no more."""
    return _allowed(s, device) + overhead_noise_ms(s)


def _cross_check(s: dict, calls: int, device: torch.device, extra: dict, timer: str) -> None:
    """``unsynced_work`` when the judge's clock around the candidate's batches exceeds the
    times its worker reported by more than :data:`HIDDEN_FRACTION` of them plus
    :data:`HIDDEN_FLOOR_MS` (:func:`kb_nano.kernels.blocks.hidden_ms`)."""
    hidden = hidden_ms(s)
    if hidden > _limit(s, device):
        raise Verdict(
            "unsynced_work",
            f"the judge's clock around the candidate's {timer} batches of {calls} calls exceeds the "
            f"call times its worker reported by {hidden:.4g} ms per batch more than the baseline's: work "
            "outside the timed calls (or a forged clock; on a busy host, re-measure the row: "
            "`-- --forcerun kernel_bench`, docs/usage.md)",
            **extra,
        )


def measure_once(scenario: dict, candidate_id: str, candidate_path: Path, settings: dict, root: Path) -> dict:
    """:func:`measure` with a pool of its own, closed afterwards (tests, scripts); the log
    goes to a temporary file. Same arguments; ``settings["device"]`` may be ``auto``."""
    import tempfile

    device = resolve_device(settings["device"])
    pool = Pool(str(device), {"OMP_WAIT_POLICY": "PASSIVE"}, Path(root))
    with tempfile.TemporaryFile() as log:
        try:
            return measure(
                scenario, candidate_id, Path(candidate_path), {"seed": None, **settings}, Path(root), pool, log.fileno()
            )
        finally:
            pool.close()
