"""One Tier-1 measurement: a candidate against the baseline on one scenario.

Steps (DESIGN.md "One Tier-1 measurement", extended by issue 7): build baseline and
candidate, give constant baseline weights seeded random values, copy weights baseline ->
candidate with ``load_state_dict(strict=True)``, move both to the device, check
correctness over several trials on fresh seeded inputs (each side gets its own buffers),
time the pair (:mod:`kb_nano.timing`), check once more after timing. Every call of the
candidate is checked by the anti-cheat rules of :mod:`kb_nano.checks`. Every outcome is
a row with a status.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kb_nano
from kb_nano import checks, operators, roofline
from kb_nano.candidates import DEFAULT_DEVICES, CandidateError, load_class, one_line
from kb_nano.operators.base import DTYPES, make_tensor, refill_
from kb_nano.provenance import git_sha, package_version
from kb_nano.schema import make_row, scenario_fields
from kb_nano.timing import (exclusive, hidden_work_limit_ms, hidden_work_ms, speedup_ci, summarize, time_graphs,
                            time_pair)


def scenario_seed(scenario_id: str) -> int:
    """Deterministic 31-bit seed of a scenario id (same inputs in every run)."""
    return int(hashlib.sha256(scenario_id.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available else ``cpu``; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """GPU name from CUDA, or the CPU model name from ``/proc/cpuinfo``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def compare(ref, out, atol: float, rtol: float) -> tuple[str, str | None, float | None, float | None]:
    """Compare candidate output ``out`` with baseline output ``ref``.

    Both may be a tensor or a tuple/list of tensors (or None entries). Returns
    ``(status, error, max_abs_err, max_rel_err)``: ``incorrect_shape`` when the number
    of outputs or a shape differs, ``incorrect_dtype`` for a dtype mismatch,
    ``nonfinite`` when the candidate has NaN/Inf where the baseline does not,
    ``incorrect`` when any element has ``|out - ref| > atol + rtol * |ref|``
    (``torch.allclose`` semantics, the criterion of vLLM's kernel tests; ``rtol=0`` gives
    a pure max-abs-error test), or when an integer/bool output (token ids) differs at
    all (exact, whatever atol/rtol), else ``passed``.
    ``max_rel_err = max|out - ref| / max|ref|`` over all outputs (norm-wise relative error).
    """
    refs, outs = checks.flatten_outputs(ref), checks.flatten_outputs(out)
    if len(refs) != len(outs):
        return "incorrect_shape", f"returned {len(outs)} output(s), baseline returns {len(refs)}", None, None
    if isinstance(ref, torch.Tensor) != isinstance(out, torch.Tensor):
        return "incorrect_shape", f"returned a {type(out).__name__}, baseline returns a {type(ref).__name__}", None, None
    max_abs, max_ref, n_bad, n_all = 0.0, 0.0, 0, 0
    for i, (r, o) in enumerate(zip(refs, outs)):
        if r is None or o is None:
            if r is not o:
                return "incorrect_shape", f"output {i}: {type(o).__name__}, baseline {type(r).__name__}", None, None
            continue
        if not isinstance(o, torch.Tensor):
            return "incorrect_shape", f"output {i}: {type(o).__name__}, expected a tensor", None, None
        if tuple(o.shape) != tuple(r.shape):
            return "incorrect_shape", f"output {i}: shape {tuple(o.shape)}, baseline {tuple(r.shape)}", None, None
        if o.dtype != r.dtype:
            return "incorrect_dtype", f"output {i}: dtype {o.dtype}, baseline {r.dtype}", None, None
        rf, of = r.double(), o.double()
        bad = ~torch.isfinite(of) & torch.isfinite(rf)
        if bool(bad.any()):
            return "nonfinite", f"output {i}: {int(bad.sum())} NaN/Inf value(s) where the baseline is finite", None, None
        if rf.numel():
            diff = (of - rf).abs().nan_to_num(0.0)
            max_abs = max(max_abs, float(diff.max()))
            max_ref = max(max_ref, float(rf.abs().nan_to_num(0.0).max()))
            if r.is_floating_point() or r.is_complex():
                n_bad += int((diff > atol + rtol * rf.abs().nan_to_num(0.0)).sum())
            else:
                n_bad += int((o != r).sum())
            n_all += rf.numel()
    max_rel = max_abs / max_ref if max_ref > 0 else (0.0 if max_abs == 0 else float("inf"))
    if n_bad:
        return (
            "incorrect",
            f"{n_bad} of {n_all} elements exceed atol {atol:g} + rtol {rtol:g} * |ref| (max_abs_err {max_abs:.4g})",
            max_abs,
            max_rel,
        )
    return "passed", None, max_abs, max_rel


def randomize_constant_parameters(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Add seeded N(0, std^2) noise to every floating-point parameter whose elements are all
    equal (RMSNorm's ones, a zero bias), in place.

    Weights initialised to a constant cannot tell a candidate that ignores them from a
    correct one (``x * 1 == x``); vLLM's kernel tests randomise them the same way
    (``weight.normal_(mean=1.0, std=0.1)``). Randomly initialised parameters are kept.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel() > 0 and bool((p == p.flatten()[0]).all()):
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * std
                p.add_(noise.to(device=p.device, dtype=p.dtype))


def make_inputs(scenario: dict, generator: torch.Generator, device: str, golden: dict | None, root: Path, draw: int):
    """The input tensors of one call of ``scenario`` (in spec order) and their source.

    With ``golden`` (the job's ``{"path", "sha256"}`` param, see
    :func:`kb_nano.workflow.golden_param`) the inputs the capture provides come from it
    (:func:`kb_nano.golden.golden_inputs`; ``draw`` 0 or 1 picks another layer/prompt) and
    the rest are seeded random: source ``"golden"``. Without it, or when the capture does
    not cover the scenario (the reason is printed to the job log), all inputs are seeded
    random from ``generator``: source ``"random"``.
    """
    provided: dict = {}
    if golden:
        from kb_nano.golden import GoldenMismatch, golden_inputs

        try:
            provided = golden_inputs(scenario, golden, root, device, draw)
        except GoldenMismatch as exc:
            print(f"golden inputs not used for {scenario['scenario_id']}: {exc}; using seeded random inputs")
    tensors = [provided[s["name"]] if s["name"] in provided else make_tensor(s, generator, device) for s in scenario["inputs"]]
    return tensors, "golden" if provided else "random"


def tolerance(scenario: dict, settings: dict) -> tuple[float, float]:
    """Effective ``(atol, rtol)`` of a measurement.

    Rule: a number in ``settings`` (the config's ``atol`` / ``rtol``, ``--atol`` / ``--rtol``)
    is a global override for every operator; ``None`` (the default config) means the
    operator's tolerance for the scenario dtype, which the manifest records in the
    scenario (``Operator.tolerance``, table :data:`kb_nano.operators.base.TOLERANCES`).
    Each of the two is resolved on its own.
    """
    if scenario.get("atol") is None or scenario.get("rtol") is None:
        from kb_nano.operators.base import tolerance_for

        default = tolerance_for(operators.get(scenario["target"]), scenario["dtype"])
    else:
        default = (float(scenario["atol"]), float(scenario["rtol"]))
    atol = default[0] if settings.get("atol") is None else float(settings["atol"])
    rtol = default[1] if settings.get("rtol") is None else float(settings["rtol"])
    return atol, rtol


PRECISIONS = ("highest", "high", "medium")
SAMPLED_CALLS = 8  # timed calls per side whose outputs are kept and compared after the loop
WAIT_AFTER_RETURN_S = 0.02  # CPU: how long the output-stability and thread checks watch after a call


def set_precision(precision: str) -> bool:
    """Fix float32 matmul precision for both sides of a measurement:
    ``torch.set_float32_matmul_precision(precision)`` and cuDNN's TF32 switch to match
    (TF32 allowed unless ``"highest"``). Returns whether TF32 is allowed. Raises
    ``ValueError`` for a precision outside :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"float32_matmul_precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != "highest"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _warm_thread_pools() -> None:
    """Start torch's intra-op (OpenMP) and BLAS thread pools before any candidate runs, so
    :class:`kb_nano.checks.ThreadWatch` never takes a pool thread that a candidate's first
    parallel op would start for the candidate's own."""
    a = torch.randn(256, 256)
    (a @ a).sum()
    torch.ones(1 << 22).sum()


def limit_memory(gigabytes: float | None, device: torch.device) -> None:
    """Cap this (worker) process's address space at ``gigabytes`` GiB (``RLIMIT_AS``) on a
    CPU run, so a candidate that allocates without bound gets an allocation error
    (``runtime_error``) instead of the host's out-of-memory killer. CUDA runs are not
    capped (the driver maps far more address space than it uses; the device's own
    allocator raises ``torch.OutOfMemoryError`` there). ``None``: no cap."""
    if gigabytes is None or device.type != "cpu":
        return
    import resource

    limit = int(float(gigabytes) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class _Trial:
    """One checked candidate call (a correctness trial or the check after timing): runs the
    baseline on its own copy of ``values`` and the candidate on ``bufs`` (the candidate's
    input buffers, filled with ``values``), then applies the rules of
    :mod:`kb_nano.checks` and the numerical comparison. ``violation`` is ``(status,
    message)`` or None; ``out`` is kept so the next call can be checked for a reused
    output buffer."""

    def __init__(self, baseline, candidate, values, bufs, names, op, device, atol, rtol, guard, previous, when):
        self.violation = None
        self.max_abs = self.max_rel = None
        self.out = None
        ref = baseline(*[v.clone() for v in values])
        before = {n: b.clone() for n, b in zip(names, bufs)}
        threads = checks.thread_idents()
        try:
            out = candidate(*bufs)
        except Exception as exc:
            self.violation = ("runtime_error", f"{when}: {one_line(exc)}")
            return
        # Right after the return, before anything slow: the threads left running, then
        # (outputs that are plain tensors only: copying a lazy one would run it) a copy
        # of the outputs queued with no synchronize.
        watch = checks.ThreadWatch(threads)
        invalid = checks.invalid_outputs(out, device)
        snap = None if invalid else checks.snapshot(out)
        self.out = out
        inputs = dict(zip(names, bufs))
        allowed = tuple(op.mutable_inputs)
        for rule in (
            lambda: invalid,
            lambda: guard("during the call"),
            lambda: checks.changed_after_return(out, snap, device, WAIT_AFTER_RETURN_S),
            watch.check,
            lambda: checks.aliased_outputs(out, inputs, allowed, previous),
            lambda: checks.mutated_inputs(before, inputs, allowed),
        ):
            found = rule()
            if found:
                self.violation = (found[0], f"{when}: {found[1]}")
                return
        status, error, self.max_abs, self.max_rel = compare(ref, out, atol, rtol)
        if status != "passed":
            self.violation = (status, f"{when}: {error}")


class _SampledCalls:
    """The timed calls, with the outputs of a few of them kept and checked afterwards.

    Which timed iterations are kept (up to :data:`SAMPLED_CALLS`) is drawn from the OS's
    random source when the loop starts, so a candidate cannot tell a checked call from an
    unchecked one; one that skips work only when it is being timed (it can see the
    timing loop on its call stack) is ``incorrect`` with the probability that one of its
    skipped calls is drawn. Keeping an output is a dictionary store inside the timed
    region; copying it happens in the next (untimed) refresh, before its buffers are
    reused."""

    def __init__(self, baseline, candidate, base_slots, cand_slots, refresh, num_warmup: int, num_runs: int):
        import random

        timed = range(num_warmup, num_warmup + num_runs)
        self.picked = set(random.SystemRandom().sample(timed, min(SAMPLED_CALLS, num_runs)))
        self.kept: dict[int, list] = {}
        self.pending: list[int] = []
        self._b, self._c, self._bs, self._cs, self._refresh = baseline, candidate, base_slots, cand_slots, refresh

    def baseline(self, i: int):
        out = self._b(*self._bs[i % 2])
        if i in self.picked:
            self.kept[i] = [out, None]
        return out

    def candidate(self, i: int):
        out = self._c(*self._cs[i % 2])
        if i in self.picked:
            self.kept[i][1] = out
            self.pending.append(i)
        return out

    def _copy_pending(self) -> None:
        for j in self.pending:
            b, c = self.kept[j]
            # an invalid (e.g. lazy) output is kept as it is, for check() to report
            self.kept[j] = [_copy(b), c if checks.invalid_outputs(c, _device_of(c)) else _copy(c)]
        self.pending.clear()

    def refresh(self, i: int) -> None:
        self._copy_pending()
        self._refresh(i)

    def check(self, device: torch.device, atol: float, rtol: float):
        """``(status, message)`` for the first kept call whose output is invalid or
        differs from the baseline's of the same iteration, else None."""
        self._copy_pending()
        for j in sorted(self.kept):
            b, c = self.kept[j]
            found = checks.invalid_outputs(c, device)
            if found:
                return found[0], f"in timed call {j}: {found[1]}"
            status, error, _, _ = compare(b, c, atol, rtol)
            if status != "passed":
                return status, f"in timed call {j} (one of {len(self.kept)} checked at random): {error}"
        return None


def _copy(out):
    """A copy of a call's output (tensor, or tuple/list of tensors and None)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
    return out


def _device_of(out) -> torch.device:
    for o in checks.flatten_outputs(out):
        if isinstance(o, torch.Tensor):
            return o.device
    return torch.device("cpu")


def measure(scenario: dict, candidate_id: str, candidate_path: Path, settings: dict, root: Path) -> dict:
    """Run one candidate on one scenario and return a kernel row (see :mod:`kb_nano.schema`).

    ``settings``: ``device`` (auto|cpu|cuda[:i]), ``atol``, ``rtol`` (None = the operator's
    tolerance, see :func:`tolerance`), ``num_warmup``, ``num_runs``, ``num_trials``
    (correctness trials before timing, >= 2), ``num_threads``, ``golden`` (optional
    golden-tensor param, see :func:`make_inputs`), ``cuda_graph`` (also time CUDA-graph
    replays), ``float32_matmul_precision`` (see :func:`set_precision`),
    ``memory_limit_gb`` (see :func:`limit_memory`), ``roofline`` (peak overrides, see
    :func:`kb_nano.roofline.peaks`).

    Steps: correctness trials on fresh values (trial ``t`` writes new values into the
    buffers of trial ``t - 2``, so identity/pointer caches return stale results); the
    paired timing loop (:func:`kb_nano.timing.time_pair`, fresh values before every
    call); on CUDA the device-wide comparison (``unsynced_work``); a last checked call
    on new values; statistics, the bootstrap interval and the roofline review. Every
    call is checked by the rules of :mod:`kb_nano.checks`.
    Candidate problems become rows (``import_error``, ``runtime_error``, ``incorrect*``,
    ``nonfinite``, ``tampered``, ``invalid_output``, ``output_aliased``,
    ``input_mutated``, ``unsynced_work``, ``skipped``); errors of the harness itself
    propagate.
    """
    t_start = time.perf_counter()
    device = resolve_device(settings["device"])
    limit_memory(settings.get("memory_limit_gb"), device)
    torch.set_num_threads(int(settings["num_threads"]))
    _warm_thread_pools()
    precision = str(settings.get("float32_matmul_precision") or "highest")
    allow_tf32 = set_precision(precision) if device.type == "cuda" else None  # TF32 exists on CUDA only
    seed = scenario_seed(scenario["scenario_id"])
    atol, rtol = tolerance(scenario, settings)
    num_trials = max(2, int(settings.get("num_trials") or 3))
    base = {
        **scenario_fields(scenario),
        "input_source": "golden" if settings.get("golden") else "random",
        "seed": seed,
        "candidate": candidate_id,
        "candidate_sha256": hashlib.sha256(Path(candidate_path).read_bytes()).hexdigest(),
        "atol": atol,
        "rtol": rtol,
        "num_warmup": int(settings["num_warmup"]),
        "num_runs": int(settings["num_runs"]),
        "num_trials": num_trials,
        "num_threads": torch.get_num_threads(),
        "float32_matmul_precision": precision,
        "allow_tf32": allow_tf32,
        "device": device.type,
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "triton_version": package_version("triton"),
        "kb_nano_version": kb_nano.__version__,
        "git_sha": git_sha(root),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }

    def row(status, error=None, **fields):
        return make_row(**base, status=status, error=error, wall_s=time.perf_counter() - t_start, **fields)

    op = operators.get(scenario["target"])
    baseline_attrs = dict(vars(op.baseline))
    # Bound before the candidate is imported: replacing these classes or their methods
    # afterwards does not change what this measurement calls.
    trial_cls, sampled_cls, sampled_check = _Trial, _SampledCalls, _SampledCalls.check
    guard = functools.partial(checks.Namespaces.check, checks.Namespaces(op.baseline))
    try:
        cls = load_class(candidate_path, scenario["target"])
    except CandidateError as exc:
        return row(exc.status, str(exc))
    if dict(vars(op.baseline)) != baseline_attrs:
        return row("tampered", f"importing the candidate modified the baseline class {op.baseline.__name__}")
    found = guard("on import")
    if found:
        return row(*found)
    supported = getattr(cls, "supported_devices", DEFAULT_DEVICES)
    if not isinstance(supported, (tuple, list)) or not all(isinstance(d, str) for d in supported):
        return row("import_error", f"{cls.__name__}.supported_devices must be a tuple of device types like ('cuda',), got {supported!r}")
    supported = tuple(supported)
    if device.type not in supported:
        return row("skipped", f"{cls.__name__} supports {', '.join(supported)}; this run is on {device.type}")

    dtype = DTYPES[scenario["dtype"]]
    init_args = dict(scenario["init_args"])
    torch.manual_seed(seed)
    baseline = op.baseline(**init_args)
    randomize_constant_parameters(baseline, seed)
    try:
        candidate = cls(**init_args)
    except Exception as exc:
        return row("import_error", f"constructor {cls.__name__}(**{sorted(init_args)}): {one_line(exc)}")
    try:
        candidate.load_state_dict(baseline.state_dict(), strict=True)
    except Exception as exc:
        return row("import_error", f"state_dict does not match the baseline's: {one_line(exc)}")
    baseline = baseline.to(device=device, dtype=dtype).eval()
    candidate = candidate.to(device=device, dtype=dtype).eval()

    specs = scenario["inputs"]
    names = [s["name"] for s in specs]
    generator = torch.Generator().manual_seed(seed)
    golden = settings.get("golden")
    slots: list[list[torch.Tensor] | None] = [None, None]  # the candidate's two rotating input buffer sets
    worst = [0.0, 0.0]
    with torch.inference_mode():
        previous: list = []  # every earlier trial's output (a reused buffer, or a ring of them)
        for t in range(num_trials):
            values, source = make_inputs(scenario, generator, str(device), golden, Path(root), draw=t)
            base["input_source"] = source
            if slots[t % 2] is None:
                slots[t % 2] = [v.clone() for v in values]
            else:
                for buf, v in zip(slots[t % 2], values):
                    buf.copy_(v)
            trial = trial_cls(baseline, candidate, values, slots[t % 2], names, op, device, atol, rtol, guard, previous,
                           f"correctness trial {t + 1} of {num_trials}")
            if trial.violation:
                return row(*trial.violation, max_abs_err=trial.max_abs, max_rel_err=trial.max_rel)
            worst = [max(worst[0], trial.max_abs), max(worst[1], trial.max_rel)]
            previous.append(trial.out)
        del trial, previous

        cand_slots = slots
        base_slots = [[b.clone() for b in slot] for slot in cand_slots]
        refresh = _refresher(specs, base_slots, cand_slots, device, seed, golden if source == "golden" else None,
                             scenario, Path(root), num_trials, int(settings["num_runs"]))
        sampled = sampled_cls(baseline, candidate, base_slots, cand_slots, refresh,
                                int(settings["num_warmup"]), int(settings["num_runs"]))
        extra: dict = {}
        try:
            with exclusive(device, Path(root) / "results/.locks"):
                peak = roofline.peaks(device, device_name(device), dtype, Path(root) / "results/.device",
                                      settings.get("roofline"), working_set=scenario.get("bytes_moved"))
                timings = time_pair(
                    sampled.baseline,
                    sampled.candidate,
                    sampled.refresh,
                    device,
                    int(settings["num_warmup"]),
                    int(settings["num_runs"]),
                )
                if settings.get("cuda_graph") and device.type != "cuda":
                    extra["graph_error"] = f"CUDA graphs need a CUDA device; this run is on {device.type}"
                elif settings.get("cuda_graph"):
                    try:
                        g_base, g_cand = time_graphs(lambda i: baseline(*base_slots[i % 2]),
                                                     lambda i: candidate(*cand_slots[i % 2]), refresh, device,
                                                     int(settings["num_runs"]))
                        extra.update(baseline_graph_ms=summarize(g_base)[0], candidate_graph_ms=summarize(g_cand)[0])
                        extra["graph_speedup"] = extra["baseline_graph_ms"] / extra["candidate_graph_ms"]
                    except Exception as exc:
                        extra["graph_error"] = one_line(exc)
                        torch.cuda.synchronize(device)
        except Exception as exc:
            return row("runtime_error", f"during timing: {one_line(exc)}", max_abs_err=worst[0], max_rel_err=worst[1])
        found = guard("during the timing loop") or sampled_check(sampled, device, atol, rtol)
        if found:
            return row(*found, max_abs_err=worst[0], max_rel_err=worst[1])
        b_med, b_iqr = summarize(timings.baseline_ms)
        c_med, c_iqr = summarize(timings.candidate_ms)
        hidden = hidden_work_ms(timings)
        if timings.candidate_wall_ms:
            extra.update(baseline_wall_ms=summarize(timings.baseline_wall_ms)[0],
                         candidate_wall_ms=summarize(timings.candidate_wall_ms)[0], hidden_work_ms=hidden)
        if hidden is not None and hidden > hidden_work_limit_ms(summarize(timings.candidate_event_ms)[0]):
            return row("unsynced_work", f"the device-wide timing exceeds the event timing by {hidden:.4g} ms per call "
                       "(baseline-calibrated): the candidate leaves work on another stream that its events miss",
                       max_abs_err=worst[0], max_rel_err=worst[1], baseline_ms=b_med, candidate_ms=c_med, **extra)
        # Check again on new values in the buffers the timing loop used: a candidate that
        # is right at first and then caches or degrades is caught here.
        k = num_trials % 2
        values, _ = make_inputs(scenario, generator, str(device), golden, Path(root), draw=num_trials)
        for buf, v in zip(cand_slots[k], values):
            buf.copy_(v)
        last = trial_cls(baseline, candidate, values, cand_slots[k], names, op, device, atol, rtol, guard, None,
                      "after the timing loop")
        if last.violation:
            return row(*last.violation, max_abs_err=last.max_abs, max_rel_err=last.max_rel)
        worst = [max(worst[0], last.max_abs), max(worst[1], last.max_rel)]
    lo, hi = speedup_ci(timings.baseline_ms, timings.candidate_ms, seed)
    bound = roofline.bound_ms(scenario.get("bytes_moved"), scenario.get("flops"), peak)
    return row(
        "passed",
        max_abs_err=worst[0],
        max_rel_err=worst[1],
        baseline_ms=b_med,
        candidate_ms=c_med,
        speedup=b_med / c_med if c_med > 0 else None,
        baseline_ms_iqr=b_iqr,
        candidate_ms_iqr=c_iqr,
        speedup_ci_low=lo,
        speedup_ci_high=hi,
        significant=bool(lo > 1.0 or hi < 1.0),
        l2_flush_bytes=timings.l2_flush_bytes,
        roofline_ms=bound,
        device_copy_gbps=peak["copy_gbps"],
        review=roofline.review(c_med, bound, peak),
        **extra,
    )


def _refresher(specs, base_slots, cand_slots, device, seed, golden, scenario, root, first_draw, num_runs):
    """``refresh(i)``: write fresh input values into buffer set ``i % 2`` of both sides
    (the baseline's and a copy in the candidate's). Random inputs: drawn on the device
    with a generator seeded from the scenario, new values every call. Golden inputs:
    the captured draws rotate (up to 8 loaded once; as many distinct as the capture
    has) and their floating-point tensors are scaled by a fresh random factor in
    [0.75, 1.25) every call (router logits keep their top-k, attention its structure),
    so no two calls see the same values."""
    if golden:
        sets = [make_inputs(scenario, torch.Generator().manual_seed(seed + d), str(device), golden, root,
                            draw=first_draw + 1 + d)[0] for d in range(min(8, max(num_runs, 1)))]
        scales = torch.Generator().manual_seed(seed ^ 0x5EED)

        def refresh(i: int) -> None:
            # captured values, each call scaled by a fresh factor in [0.75, 1.25): the
            # captures repeat (4 prompts x layers), the values a call sees never do
            factor = 0.75 + 0.5 * float(torch.rand((), generator=scales))
            for b, c, v in zip(base_slots[i % 2], cand_slots[i % 2], sets[i % len(sets)]):
                b.copy_(v)
                if b.is_floating_point():
                    b.mul_(factor)
                c.copy_(b)

        return refresh
    gen = torch.Generator(device=device).manual_seed(seed)

    def refresh(i: int) -> None:
        for b, c, spec in zip(base_slots[i % 2], cand_slots[i % 2], specs):
            refill_(b, spec, gen)
            c.copy_(b)

    return refresh

