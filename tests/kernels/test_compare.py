"""kb_nano.kernels.compare.compare: statuses, the allclose criterion and the error metrics."""

from __future__ import annotations

import math

import pytest
import torch

from kb_nano.kernels.compare import compare
from kb_nano.kernels.schema import STATUSES

T = torch.tensor


def check(result, status):
    got, error, max_abs, max_rel, _used = result
    assert got == status, result
    assert got in STATUSES
    if status == "passed":
        assert error is None
    else:
        assert isinstance(error, str) and error and "\n" not in error
    return error, max_abs, max_rel


def test_identical_passes_with_zero_error():
    x = torch.randn(4, 8)
    _, max_abs, max_rel = check(compare(x, x.clone(), 0.01, 0.01), "passed")
    assert max_abs == 0.0 and max_rel == 0.0


def test_max_abs_and_max_rel_definitions():
    ref = T([1.0, -4.0, 2.0])
    out = T([1.5, -4.0, 2.25])
    _, max_abs, max_rel = check(compare(ref, out, 1.0, 0.0), "passed")
    assert max_abs == pytest.approx(0.5)
    # max|out - ref| / max|ref| (norm-wise), not max of elementwise ratios (0.5)
    assert max_rel == pytest.approx(0.5 / 4.0)


def test_max_errors_span_all_outputs():
    ref = (T([1.0, 2.0]), T([10.0]))
    out = (T([1.3, 2.0]), T([10.1]))
    _, max_abs, max_rel = check(compare(ref, out, 0.5, 0.0), "passed")
    assert max_abs == pytest.approx(0.3)
    assert max_rel == pytest.approx(0.3 / 10.0)


def test_atol_plus_rtol_criterion():
    def T(values):  # float64 so the thresholds below are exact enough
        return torch.tensor(values, dtype=torch.float64)

    ref = T([100.0, 0.0])
    # |diff| = 1.05 at 100: allowed is atol 0.1 + rtol 0.01 * 100 = 1.1
    check(compare(ref, T([101.05, 0.0]), 0.1, 0.01), "passed")
    # |diff| = 1.2 > 1.1
    error, max_abs, max_rel = check(compare(ref, T([101.2, 0.0]), 0.1, 0.01), "incorrect")
    assert max_abs == pytest.approx(1.2) and max_rel == pytest.approx(0.012)
    assert "1 of 2 elements" in error and "atol 0.1" in error and "rtol 0.01" in error
    # near zero only atol counts
    check(compare(ref, T([100.0, 0.09]), 0.1, 0.01), "passed")
    check(compare(ref, T([100.0, 0.11]), 0.1, 0.01), "incorrect")
    # rtol 0 is a pure max-abs-error test
    check(compare(ref, T([100.09, 0.0]), 0.1, 0.0), "passed")
    check(compare(ref, T([100.2, 0.0]), 0.1, 0.0), "incorrect")


def test_tolerance_used_is_the_worst_elements_share_of_the_allowed_error():
    """max |out - ref| / (scaled atol + rtol * |ref|) over every element of every output: not
    the share max_abs_err is of some single bound (the worst element against its own)."""

    def T(values):
        return torch.tensor(values, dtype=torch.float64)

    ref = (T([100.0, 0.0]), T([2.0]))
    # allowed: 0.1 + 0.01 * 100 = 1.1 (diff 0.55: 50%); 0.1 (diff 0.08: 80%); 0.12 (diff 0.03: 25%)
    *_, used = compare(ref, (T([100.55, 0.08]), T([2.03])), 0.1, 0.01)
    assert used == pytest.approx(0.8)
    status, _, max_abs, _, used = compare(ref, (T([101.65, 0.0]), T([2.0])), 0.1, 0.01)  # 1.65 / 1.1
    assert status == "incorrect" and max_abs == pytest.approx(1.65) and used == pytest.approx(1.5)
    assert compare(ref, (T([100.0, 0.0]), T([2.0])), 0.0, 0.0)[4] == 0.0  # exact, nothing allowed
    assert compare(ref, (T([100.0, 1e-9]), T([2.0])), 0.0, 0.0)[4] == math.inf
    # inf == inf; atol scaled by the rms of the finite reference values, sqrt(1 / 2)
    assert compare(T([1.0, math.inf]), T([1.005, math.inf]), 0.01, 0.0)[4] == pytest.approx(0.5 / math.sqrt(0.5))
    tokens = torch.tensor([3, 7])
    assert compare(tokens, tokens.clone(), 0.01, 0.01)[4] == 0.0
    assert compare(tokens, torch.tensor([3, 8]), 0.01, 0.01)[4] == math.inf
    assert compare(torch.zeros(2, 3), torch.zeros(3, 2), 0.01, 0.01)[4] is None


def test_criterion_matches_torch_allclose():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g) * 10
    out = ref + torch.randn(1000, generator=g) * 0.05
    for atol, rtol in [(0.01, 0.01), (0.1, 0.0), (0.0, 0.02), (0.2, 0.001)]:
        status, *_ = compare(ref, out, atol, rtol)
        assert (status == "passed") == torch.allclose(out.double(), ref.double(), rtol=rtol, atol=atol)


def test_bf16_compared_in_double():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = ref.clone()
    out[3] = out[3] + 0.5
    error, max_abs, _ = check(compare(ref, out, 0.01, 0.0), "incorrect")
    assert max_abs == pytest.approx(abs(float(out[3]) - float(ref[3])))


def test_incorrect_shape():
    error, max_abs, max_rel = check(compare(torch.zeros(2, 3), torch.zeros(3, 2), 0.01, 0.01), "incorrect_shape")
    assert "(3, 2)" in error and "(2, 3)" in error
    assert max_abs is None and max_rel is None
    # broadcastable is not equal
    check(compare(torch.zeros(2, 3), torch.zeros(1, 3), 0.01, 0.01), "incorrect_shape")


def test_incorrect_dtype():
    error, *_ = check(compare(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2), 0.01, 0.01), "incorrect_dtype")
    assert "float32" in error and "bfloat16" in error


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite(bad):
    ref = torch.ones(5)
    out = torch.ones(5)
    out[2] = bad
    error, max_abs, _ = check(compare(ref, out, 0.01, 0.01), "nonfinite")
    assert "1 NaN/Inf" in error and max_abs is None


def test_nonfinite_where_baseline_is_nonfinite_too_is_not_flagged():
    ref = T([1.0, math.inf, math.nan])
    out = T([1.0, math.inf, math.nan])
    _, max_abs, _ = check(compare(ref, out, 0.01, 0.01), "passed")
    assert max_abs == 0.0


def test_opposite_infinities_are_incorrect():
    check(compare(T([math.inf]), T([-math.inf]), 0.01, 0.01), "incorrect")


def test_tuple_outputs():
    ref = (torch.ones(2, 4), torch.zeros(2, 4))
    check(compare(ref, (torch.ones(2, 4), torch.zeros(2, 4)), 0.01, 0.01), "passed")
    check(compare(ref, [torch.ones(2, 4), torch.zeros(2, 4)], 0.01, 0.01), "passed")  # list is fine
    # the second output is checked too
    error, *_ = check(compare(ref, (torch.ones(2, 4), torch.ones(2, 4)), 0.01, 0.01), "incorrect")
    assert "8 of 16" in error
    error, *_ = check(compare(ref, (torch.ones(2, 4), torch.zeros(2, 4).double()), 0.01, 0.01), "incorrect_dtype")
    assert error.startswith("output 1")
    bad = torch.zeros(2, 4)
    bad[0, 0] = math.nan
    error, *_ = check(compare(ref, (torch.ones(2, 4), bad), 0.01, 0.01), "nonfinite")
    assert error.startswith("output 1")


def test_wrong_number_of_outputs():
    ref = (torch.ones(2), torch.ones(2))
    error, *_ = check(compare(ref, torch.ones(2), 0.01, 0.01), "incorrect_shape")
    assert "returned 1 output(s), baseline returns 2" in error
    error, *_ = check(compare(torch.ones(2), (torch.ones(2), torch.ones(2)), 0.01, 0.01), "incorrect_shape")
    assert "returned 2 output(s), baseline returns 1" in error


def test_none_entries():
    # rotary with key=None returns (query, None)
    ref = (torch.ones(3), None)
    check(compare(ref, (torch.ones(3), None), 0.01, 0.01), "passed")
    error, *_ = check(compare(ref, (torch.ones(3), torch.ones(3)), 0.01, 0.01), "incorrect_shape")
    assert "output 1" in error and "NoneType" in error
    error, *_ = check(compare((torch.ones(3), torch.ones(3)), (torch.ones(3), None), 0.01, 0.01), "incorrect_shape")
    assert "output 1: NoneType, baseline Tensor" in error
    check(compare(torch.ones(3), None, 0.01, 0.01), "incorrect_shape")


def test_non_tensor_output():
    error, *_ = check(compare(torch.ones(3), [1.0, 1.0, 1.0], 0.01, 0.01), "incorrect_shape")
    check(compare(torch.ones(3), "x", 0.01, 0.01), "incorrect_shape")
    check(compare(torch.ones(3), 1.0, 0.01, 0.01), "incorrect_shape")


def test_empty_outputs_pass():
    _, max_abs, max_rel = check(compare(torch.zeros(0, 4), torch.zeros(0, 4), 0.01, 0.01), "passed")
    assert max_abs == 0.0 and max_rel == 0.0


def test_all_zero_reference_relative_error():
    _, _, max_rel = check(compare(torch.zeros(3), torch.zeros(3), 0.01, 0.0), "passed")
    assert max_rel == 0.0
    # an all-zero reference has no scale: the atol shrinks to two subnormal units
    _, max_abs, max_rel = check(compare(torch.zeros(3), T([0.0, 0.005, 0.0]), 0.01, 0.0), "incorrect")
    assert max_abs == pytest.approx(0.005) and max_rel == math.inf
    check(compare(torch.zeros(3, dtype=torch.float16), T([0.0, 6e-8, 0.0]).half(), 0.01, 0.0), "passed")


def test_atol_scales_with_the_reference_rms_below_one():
    """The table's atol is for outputs of rms ~1: an output of rms 0.04 gets 1/25 of it
    (the same relative error is caught at every scale), one of rms 100 keeps it."""
    torch.manual_seed(0)
    ref = torch.randn(4096)
    noise = torch.randn(4096) * 0.01  # 1% of an rms-1 output: passes atol 0.05
    check(compare(ref, ref + noise, 0.05, 0.0), "passed")
    small = ref * 0.04
    check(compare(small, small + noise * 0.04, 0.05, 0.0), "passed")  # the same relative error
    error, _, _ = check(compare(small, small + noise, 0.05, 0.0), "incorrect")  # 25% of its rms
    assert "min(1, rms(ref))" in error
    large = ref * 100  # rms above 1: the atol is not widened
    check(compare(large, large + 0.06 * torch.sign(noise), 0.05, 0.0), "incorrect")
    # each output its own scale
    check(compare((ref, small), (ref + noise, small + noise), 0.05, 0.0), "incorrect")
    # NaN where the baseline has NaN too: the scale comes from the finite values
    ref_nan, out_nan = small.clone(), (small + noise).clone()
    ref_nan[0] = out_nan[0] = math.nan
    check(compare(ref_nan, out_nan, 0.05, 0.0), "incorrect")


def test_integer_outputs():
    check(compare(T([1, 2, 3]), T([1, 2, 3]), 0.0, 0.0), "passed")
    check(compare(T([1, 2, 3]), T([1, 2, 4]), 0.5, 0.0), "incorrect")


def test_non_finite_values_keep_their_meaning():
    """One device read per comparison does not change what NaN/Inf mean: a baseline Inf
    opposite a finite candidate value is not counted (``inf > inf`` is false), NaN/Inf in
    both at the same places count as equal, an overflowing difference stays infinite."""
    import math

    t = torch.tensor
    assert compare(t([math.inf, 1.0]), t([5.0, 1.0]), 1e-2, 1e-2)[0] == "passed"
    assert compare(t([math.nan, 1.0]), t([math.nan, 1.0]), 1e-2, 1e-2)[0] == "passed"
    assert compare(t([1.0, 1.0]), t([math.nan, 1.0]), 1e-2, 1e-2)[0] == "nonfinite"
    status, _, max_abs, *_ = compare(t([3e38], dtype=torch.bfloat16), t([-3e38], dtype=torch.bfloat16), 1e-2, 1e-2)
    assert status == "incorrect" and max_abs == math.inf
    assert compare(t([1 + 1j]), t([1 + 2j]), 1e-2, 1e-2)[0] == "incorrect"  # the imaginary part counts
