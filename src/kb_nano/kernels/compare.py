"""The numerical comparison of a candidate's output with the baseline's, and the
tolerance it uses. Runs in the judge, on the copies the workers wrote into the judge's
output slots.

The absolute part of the tolerance is in units of the reference output's scale: each
output's ``atol`` is multiplied by ``min(1, rms(ref))`` (:func:`scaled_atol`). The
tolerance table (:data:`kb_nano.operators.base.TOLERANCES`) is calibrated on outputs of
rms ~1, as a model's activations are; an output of rms 0.04 (``fused_moe`` with random
weights) has rounding errors 25 times smaller, and an unscaled atol of 0.02 would be half
its rms, wide enough for int8-quantized weights to pass. Outputs of rms above 1 keep the
table's atol (``rtol`` grows with the values)."""

from __future__ import annotations

import math

import torch

from kb_nano import operators
from kb_nano.kernels.checks import flatten_outputs


def compare(ref, out, atol: float, rtol: float) -> tuple[str, str | None, float | None, float | None, float | None]:
    """Compare candidate output ``out`` with baseline output ``ref``.

    Both may be a tensor or a tuple/list of tensors (or None entries). Returns
    ``(status, error, max_abs_err, max_rel_err, tolerance_used)``: ``incorrect_shape`` when the number
    of outputs or a shape differs, ``incorrect_dtype`` for a dtype mismatch,
    ``nonfinite`` when the candidate has NaN/Inf where the baseline does not,
    ``incorrect`` when any element has ``|out - ref| > atol * min(1, rms(ref)) + rtol * |ref|``
    (``torch.allclose`` semantics, the criterion of vLLM's kernel tests, with the absolute
    part scaled to the output: :func:`scaled_atol`, ``rms`` over the output's elements;
    ``rtol=0`` gives a pure max-abs-error test), or when an integer/bool output (token ids)
    differs at all (exact, whatever atol/rtol), else ``passed``.
    ``max_rel_err = max|out - ref| / max|ref|`` over all outputs (norm-wise relative error).
    ``tolerance_used = max |out - ref| / (atol * min(1, rms(ref)) + rtol * |ref|)`` over all elements: the
    share of the allowed error the worst element uses (1.0 = at the limit, so at most 1.0
    when passed; inf where nothing was allowed and the values differ; integer outputs:
    0.0 when equal). The three errors are None when no output was compared.
    """
    refs, outs = flatten_outputs(ref), flatten_outputs(out)
    if len(refs) != len(outs):
        return "incorrect_shape", f"returned {len(outs)} output(s), baseline returns {len(refs)}", None, None, None
    if isinstance(ref, torch.Tensor) != isinstance(out, torch.Tensor):
        return (
            "incorrect_shape",
            f"returned a {type(out).__name__}, baseline returns a {type(ref).__name__}",
            None,
            None,
            None,
        )
    pairs = []
    for i, (r, o) in enumerate(zip(refs, outs)):
        if r is None or o is None:
            if r is not o:
                return (
                    "incorrect_shape",
                    f"output {i}: {type(o).__name__}, baseline {type(r).__name__}",
                    None,
                    None,
                    None,
                )
            continue
        if not isinstance(o, torch.Tensor):
            return "incorrect_shape", f"output {i}: {type(o).__name__}, expected a tensor", None, None, None
        if tuple(o.shape) != tuple(r.shape):
            return "incorrect_shape", f"output {i}: shape {tuple(o.shape)}, baseline {tuple(r.shape)}", None, None, None
        if o.dtype != r.dtype:
            return "incorrect_dtype", f"output {i}: dtype {o.dtype}, baseline {r.dtype}", None, None, None
        if r.numel():
            pairs.append((i, r, o))
    # one device->host read for all outputs (each a synchronize on CUDA): max |out - ref|,
    # max |ref|, the count over the tolerance, the share of it used and the output's scaled
    # atol, in float64 (exact for these counts)
    stats = [_stats(r, o, atol, rtol) for _, r, o in pairs]
    values = torch.stack(stats).tolist() if stats else []
    max_abs, max_ref, n_bad, n_all, used, bad_atol = 0.0, 0.0, 0, 0, 0.0, None
    for (i, r, o), (abs_i, ref_i, bad_i, used_i, atol_i) in zip(pairs, values):
        if not (math.isfinite(abs_i) and math.isfinite(ref_i)):  # NaN/Inf somewhere: classify it
            found = _nonfinite(i, r, o, atol, rtol)
            if isinstance(found[0], str):
                return found
            abs_i, ref_i, bad_i, used_i, atol_i = found
        if bad_i and bad_atol is None:
            bad_atol = atol_i
        max_abs, max_ref, n_bad, n_all = max(max_abs, abs_i), max(max_ref, ref_i), n_bad + int(bad_i), n_all + r.numel()
        used = max(used, used_i)
    max_rel = max_abs / max_ref if max_ref > 0 else (0.0 if max_abs == 0 else float("inf"))
    if n_bad:
        return (
            "incorrect",
            f"{n_bad} of {n_all} elements exceed atol {atol:g} * min(1, rms(ref)) = {bad_atol:.3g} + rtol {rtol:g} "
            f"* |ref| (max_abs_err {max_abs:.4g})",
            max_abs,
            max_rel,
            used,
        )
    return "passed", None, max_abs, max_rel, used


def _wide(r: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both outputs in a dtype where they and their difference are exact: float32 for
    bf16/fp16 (and integers up to 2**24 in magnitude), float64 for float32/float64 and
    for integer outputs (token ids compared exactly), complex as is."""
    if r.is_complex():
        return r, o
    wide = torch.float32 if r.dtype in (torch.bfloat16, torch.float16) else torch.float64
    return r.to(wide), o.to(wide)


def _used(diff: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``max(diff / allowed)`` (0-dim float64): 0 where both are 0, inf where only
    ``allowed`` is; NaN (an infinite baseline against an infinite difference, which the
    count does not flag) counts as 0."""
    ratio = torch.where(allowed > 0, diff / allowed, torch.where(diff > 0, math.inf, 0.0))
    return ratio.nan_to_num_(nan=0.0, posinf=math.inf).max().double()


def scaled_atol(ref_abs: torch.Tensor, atol: float, dtype: torch.dtype) -> torch.Tensor:
    """The absolute tolerance of one output, on its device (a 0-dim tensor of
    ``ref_abs``'s dtype): ``atol * min(1, rms(ref))`` with ``ref_abs`` = ``|ref|`` (finite
    values), never below two units of ``dtype``'s subnormal spacing (fp16 results below
    its smallest normal, 6.1e-5, are rounded to multiples of 6e-8). See the module
    docstring for why the table's atol is scaled."""
    info = torch.finfo(dtype) if dtype.is_floating_point else None
    floor = 2 * info.tiny * info.eps if info is not None else 0.0  # two units of the subnormal spacing
    rms = ref_abs.square().mean().sqrt()
    return rms.clamp(max=1.0).mul(atol).clamp(min=floor)


def _stats(r: torch.Tensor, o: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """``[max|o - r|, max|r|, count(|o - r| > a + rtol * |r|), max(|o - r| / (a + rtol *
    |r|)), a]`` on the device, float64, with ``a`` = :func:`scaled_atol`; integer/bool
    outputs: the count is of elements that differ at all, the share used 0 or inf and
    ``a`` 0. NaN/Inf in either output make one of the two maxima non-finite
    (:func:`_nonfinite` then classifies)."""
    rf, of = _wide(r, o)
    diff = (of - rf).abs()
    ref_abs = rf.abs()
    if r.is_floating_point() or r.is_complex():
        a = scaled_atol(ref_abs, atol, r.dtype if r.is_floating_point() else ref_abs.dtype)
        allowed = ref_abs.mul(rtol).add_(a)
        bad, used = diff.gt(allowed).sum(), _used(diff, allowed)
    else:
        a = torch.zeros((), device=r.device)
        bad = (o != r).sum()
        used = torch.where(bad > 0, math.inf, 0.0).double()
    return torch.stack([diff.max().double(), ref_abs.max().double(), bad.double(), used, a.double()])


def _nonfinite(i: int, r: torch.Tensor, o: torch.Tensor, atol: float, rtol: float):
    """Output ``i`` holds NaN/Inf (either side): ``nonfinite`` (a 5-tuple like
    :func:`compare`'s) when the candidate has them where the baseline is finite; else
    ``(max_abs, max_ref, n_bad, tolerance_used, atol)``, where, if the candidate has NaN/Inf (all where the
    baseline has them too), those places count as equal (NaN -> 0, opposite infinities
    -> float max); a non-finite baseline opposite finite candidate values is compared as
    is (``inf > inf`` is false); the atol is scaled by the rms of the baseline's finite
    values (:func:`scaled_atol`)."""
    rf, of = _wide(r, o)
    finite_o = torch.isfinite(of)
    all_finite = bool(finite_o.all())
    if not all_finite:
        bad = ~finite_o & torch.isfinite(rf)
        if bool(bad.any()):
            return (
                "nonfinite",
                f"output {i}: {int(bad.sum())} NaN/Inf value(s) where the baseline is finite",
                None,
                None,
                None,
            )
    diff = (of - rf).abs()
    ref_abs = rf.abs()
    if not all_finite:
        diff.nan_to_num_(0.0)
        ref_abs.nan_to_num_(0.0)
    finite_abs = torch.where(torch.isfinite(rf), ref_abs, 0.0)
    a = float(scaled_atol(finite_abs, atol, r.dtype if r.is_floating_point() else finite_abs.dtype))
    allowed = ref_abs.mul(rtol).add_(a)
    return float(diff.max()), float(ref_abs.max()), int(diff.gt(allowed).sum()), float(_used(diff, allowed)), a


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


def spec_mismatch(ref: dict, got: dict) -> tuple[str, str] | None:
    """Compare a candidate's output description with the baseline's, as the workers
    report them (:func:`kb_nano.kernels.worker.spec_of`: ``kind`` and ``outputs``, each
    ``[shape, dtype]`` or a type name). Returns ``(status, message)`` like
    :func:`compare` (``incorrect_shape``, ``incorrect_dtype``) or None when they agree.
    ``got`` comes from the candidate's process: anything malformed is
    ``incorrect_shape``."""
    try:
        r_out, g_out = list(ref["outputs"]), list(got["outputs"])
        if len(r_out) != len(g_out):
            return "incorrect_shape", f"returned {len(g_out)} output(s), baseline returns {len(r_out)}"
        if (ref["kind"] == "Tensor") != (got["kind"] == "Tensor"):
            return "incorrect_shape", f"returned a {str(got['kind'])[:40]}, baseline returns a {ref['kind']}"
        for i, (r, g) in enumerate(zip(r_out, g_out)):
            if isinstance(r, list) != isinstance(g, list):
                what = "Tensor" if isinstance(g, list) else str(g)[:40]
                return "incorrect_shape", f"output {i}: {what}, baseline {'Tensor' if isinstance(r, list) else r}"
            if not isinstance(r, list):
                continue
            if [int(d) for d in g[0]] != list(r[0]):
                return "incorrect_shape", f"output {i}: shape {tuple(g[0])}, baseline {tuple(r[0])}"
            if str(g[1]) != r[1]:
                return "incorrect_dtype", f"output {i}: dtype torch.{str(g[1])[:20]}, baseline torch.{r[1]}"
    except (KeyError, TypeError, ValueError, IndexError):
        return "incorrect_shape", "the candidate's worker reported outputs the judge cannot read"
    return None
