"""The roofline review: the bound, the measured and overridden peaks, the CPU copy bandwidth."""

from __future__ import annotations

import pytest
import torch

from kb_nano import roofline


def test_roofline_bound_and_review():
    peak = {"copy_gbps": 1000.0, "matmul_tflops": 100.0}
    # 1 GB at 1000 GB/s = 1 ms; 1e11 flop at 100 TFLOP/s = 1 ms; the larger term wins
    assert roofline.bound_ms(10**9, 0, peak) == pytest.approx(1.0)
    assert roofline.bound_ms(10**9, 2 * 10**11, peak) == pytest.approx(2.0)
    assert roofline.bound_ms(None, None, peak) is None
    assert roofline.review(0.9, 1.0, peak) is None  # within the margin
    assert "implausible" in roofline.review(0.5, 1.0, peak)


def test_roofline_peaks_are_measured_once_and_overridable(tmp_path):
    first = roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path)
    assert first["copy_gbps"] > 0 and first["matmul_tflops"] > 0
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path, {"copy_gbps": 5.0})
    assert again["copy_gbps"] == 5.0 and again["matmul_tflops"] == first["matmul_tflops"]


def test_bf16_matmul_peak_is_the_faster_gemm_path_and_old_records_are_measured_again(tmp_path, monkeypatch):
    """On a CPU a bf16 ``a @ b`` is ~10x slower than ``F.linear`` (what baselines call): the
    peak takes the faster, so the bound holds for a baseline's linear layers; a cached
    record of the old ``a @ b``-only method is measured again."""
    import json

    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or real_linear(*a))
    first = roofline.peaks(torch.device("cpu"), "test-cpu", torch.bfloat16, tmp_path)
    assert calls and first["method"] == roofline.PEAKS_METHOD
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps({"copy_gbps": 1.0, "matmul_tflops": 1e-9}))  # an old method's record
    again = roofline.peaks(torch.device("cpu"), "test-cpu", torch.bfloat16, tmp_path)
    assert again["matmul_tflops"] > 1e-6 and json.loads(path.read_text())["method"] == roofline.PEAKS_METHOD


def test_cpu_copy_bandwidth_is_measured_at_the_working_set():
    small = roofline.copy_gbps_at(torch.device("cpu"), 64 * 1024)
    assert small > 0


def test_a_slow_working_set_measurement_never_lowers_the_cached_copy_bandwidth(tmp_path, monkeypatch):
    """On a loaded host every try of the working-set copy can be preempted: the bound then
    uses the cached figure, so an honest row is not flagged implausible."""
    first = roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path)
    monkeypatch.setattr(roofline, "copy_gbps_at", lambda device, nbytes: 1e-3)
    slow = roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path, working_set=10**6)
    assert slow["copy_gbps"] == first["copy_gbps"]
    monkeypatch.setattr(roofline, "copy_gbps_at", lambda device, nbytes: 1e6)  # cache speed: higher is kept
    assert (
        roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path, working_set=10**6)["copy_gbps"] == 1e6
    )
