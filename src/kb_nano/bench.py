"""One Tier-1 measurement: a candidate against the baseline on one scenario.

Steps (DESIGN.md "One Tier-1 measurement"): build baseline and candidate, give constant
baseline weights seeded random values, copy weights baseline -> candidate with
``load_state_dict(strict=True)``, move both to the device, check correctness on fresh
seeded inputs (each side gets its own clone), then time the pair (see
:mod:`kb_nano.timing`). Every outcome is a row with a status.
"""

from __future__ import annotations

import hashlib
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kb_nano
from kb_nano import operators
from kb_nano.candidates import DEFAULT_DEVICES, CandidateError, load_class, one_line
from kb_nano.operators.base import DTYPES, make_tensor
from kb_nano.provenance import git_sha, package_version
from kb_nano.schema import make_row, scenario_fields
from kb_nano.timing import exclusive, summarize, time_pair


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


def _flatten(out) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


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
    refs, outs = _flatten(ref), _flatten(out)
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


def _torch_namespaces() -> dict[str, dict]:
    """Snapshots of the torch namespaces a baseline calls into (``torch``, ``torch.Tensor``,
    ``torch.nn.functional``), to catch a candidate that monkeypatches them on import."""
    import torch.nn.functional as F

    def attrs(obj):  # inherited names too: setting torch.Tensor.double shadows TensorBase's
        return {k: getattr(obj, k, None) for k in dir(obj) if not k.startswith("__")}

    return {"torch": attrs(torch), "torch.Tensor": attrs(torch.Tensor), "torch.nn.functional": attrs(F)}


def _replaced(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """Names whose object changed between two :func:`_torch_namespaces` snapshots (names
    that did not exist before, e.g. lazily imported submodules, are allowed)."""
    return [f"{ns}.{k}" for ns, names in before.items() for k, v in names.items()
            if k in after[ns] and after[ns][k] is not v]


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


def measure(scenario: dict, candidate_id: str, candidate_path: Path, settings: dict, root: Path) -> dict:
    """Run one candidate on one scenario and return a kernel row (see :mod:`kb_nano.schema`).

    ``settings``: ``device`` (auto|cpu|cuda[:i]), ``atol``, ``rtol`` (None = the operator's
    tolerance, see :func:`tolerance`), ``num_warmup``, ``num_runs``, ``num_threads``,
    ``golden`` (optional golden-tensor param, see :func:`make_inputs`).
    Candidate problems become rows (``import_error``, ``runtime_error``, ``incorrect*``,
    ``nonfinite``, ``skipped``); errors of the harness itself propagate.
    """
    t_start = time.perf_counter()
    device = resolve_device(settings["device"])
    torch.set_num_threads(int(settings["num_threads"]))
    seed = scenario_seed(scenario["scenario_id"])
    atol, rtol = tolerance(scenario, settings)
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
        "num_threads": torch.get_num_threads(),
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
    torch_attrs = _torch_namespaces()
    try:
        cls = load_class(candidate_path, scenario["target"])
    except CandidateError as exc:
        return row(exc.status, str(exc))
    if dict(vars(op.baseline)) != baseline_attrs:
        return row("import_error", f"importing the candidate modified the baseline class {op.baseline.__name__}")
    patched = _replaced(torch_attrs, _torch_namespaces())
    if patched:
        return row("import_error", f"importing the candidate replaced {', '.join(patched[:3])}: the baseline "
                                   "would run the candidate's code; a candidate may only define its module")
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

    generator = torch.Generator().manual_seed(seed)
    inputs, source = make_inputs(scenario, generator, str(device), settings.get("golden"), Path(root), draw=0)
    base["input_source"] = source
    with torch.inference_mode():
        ref = baseline(*[t.clone() for t in inputs])
        try:
            out = candidate(*[t.clone() for t in inputs])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:
            return row("runtime_error", one_line(exc))
        status, error, max_abs, max_rel = compare(ref, out, atol, rtol)
        if status != "passed":
            return row(status, error, max_abs_err=max_abs, max_rel_err=max_rel)
        del ref, out
        base_in = [t.clone() for t in inputs]
        cand_in = [t.clone() for t in inputs]
        try:
            with exclusive(device, Path(root) / "results/.locks"):
                base_ms, cand_ms = time_pair(
                    lambda: baseline(*base_in),
                    lambda: candidate(*cand_in),
                    device,
                    int(settings["num_warmup"]),
                    int(settings["num_runs"]),
                )
        except Exception as exc:
            return row("runtime_error", f"during timing: {one_line(exc)}", max_abs_err=max_abs, max_rel_err=max_rel)
        # Check again after timing on a second, different input set: a candidate that is
        # right on the first call and then caches or shortcuts is caught here.
        second, _ = make_inputs(scenario, generator, str(device), settings.get("golden") if source == "golden" else None, Path(root), draw=1)
        try:
            out2 = candidate(*[t.clone() for t in second])
        except Exception as exc:
            return row("runtime_error", f"after timing: {one_line(exc)}", max_abs_err=max_abs, max_rel_err=max_rel)
        status2, error2, max_abs2, max_rel2 = compare(baseline(*[t.clone() for t in second]), out2, atol, rtol)
        if status2 != "passed":
            return row(status2, f"after timing, on a second input set: {error2}", max_abs_err=max_abs2, max_rel_err=max_rel2)
        max_abs, max_rel = max(max_abs, max_abs2), max(max_rel, max_rel2)
    b_med, b_iqr = summarize(base_ms)
    c_med, c_iqr = summarize(cand_ms)
    return row(
        "passed",
        max_abs_err=max_abs,
        max_rel_err=max_rel,
        baseline_ms=b_med,
        candidate_ms=c_med,
        speedup=b_med / c_med if c_med > 0 else None,
        baseline_ms_iqr=b_iqr,
        candidate_ms_iqr=c_iqr,
    )
