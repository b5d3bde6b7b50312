"""What the MLflow UI shows of a kernel run, read back from a real SQLite store: metric
values rounded to 4 significant digits (counts exact), the run's start and end times
(the UI's Created and Duration) from the measurement, not from logging, and the
Description listing every candidate with its full id and source hash."""

from __future__ import annotations

from datetime import datetime

import pytest
from tracking_helpers import result_set, row

from kb_nano import tracking
from kb_nano.tracking.kernels import NOTE_TAG


def _at(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def _timed(n: int, speedup: float, start: str, end: str) -> dict:
    r = row("rms_norm", "torch_fused", n=n, speedup=speedup, started_at=start, ended_at=end)
    return dict(r, created_at=end[:19] + "+00:00")


def test_metrics_are_rounded_to_four_significant_digits(tmp_path):
    rows = [_timed(1, 1.23456789, "2026-01-01T10:00:00.5+00:00", "2026-01-01T10:00:02.25+00:00")]
    rows += [row("rms_norm", "triton_rowwise", status="skipped")]
    rec = tracking.log_kernels(**result_set(tmp_path, rows), tracking_uri=tracking.default_tracking_uri(tmp_path))
    m = tracking.client(rec["tracking_uri"]).get_run(rec["run_id"]).data.metrics
    assert m["geomean_speedup"] == 1.235 and m["speedup/rms_norm/llama31-8b__tp1__n1 torch_fused"] == 1.235
    assert (m["rows"], m["passed"], m["pass_rate"]) == (2.0, 1.0, 1.0)


def test_run_times_are_the_measurements_and_a_later_run_starts_at_its_new_rows(tmp_path):
    uri = tracking.default_tracking_uri(tmp_path)
    first = [
        _timed(1, 1.2, "2026-01-01T10:00:00.5+00:00", "2026-01-01T10:00:02.25+00:00"),
        _timed(16, 1.1, "2026-01-01T10:00:03+00:00", "2026-01-01T10:00:09.75+00:00"),
    ]
    a = tracking.log_kernels(**result_set(tmp_path / "a", first), tracking_uri=uri)
    info = tracking.client(uri).get_run(a["run_id"]).info
    assert (info.start_time, info.end_time) == (_at("2026-01-01T10:00:00.5+00:00"), _at("2026-01-01T10:00:09.75+00:00"))
    # n16 measured again an hour later, n1 reused: the run's span is the new measurement
    second = [first[0], _timed(16, 1.3, "2026-01-01T11:00:00+00:00", "2026-01-01T11:00:04+00:00")]
    b = tracking.log_kernels(**result_set(tmp_path / "b", second), tracking_uri=uri)
    info = tracking.client(uri).get_run(b["run_id"]).info
    assert b["created"] and (info.end_time - info.start_time) == 4000
    assert info.start_time == _at("2026-01-01T11:00:00+00:00")


def test_the_description_lists_every_candidate_in_full(tmp_path):
    rows = [row("rms_norm", "torch_fused", speedup=1.5), row("silu_and_mul", "inplace", status="incorrect")]
    rec = tracking.log_kernels(**result_set(tmp_path, rows), tracking_uri=tracking.default_tracking_uri(tmp_path))
    tags = tracking.client(rec["tracking_uri"]).get_run(rec["run_id"]).data.tags
    note = tags[NOTE_TAG]
    for cid in ("rms_norm/torch_fused", "silu_and_mul/inplace"):
        sha = tags[f"kb_nano.candidate.{cid}"]
        assert len(sha) == 64 and f"| {cid} | `{sha[:12]}` |" in note
    assert "| rms_norm/torch_fused | " in note and "| 1 | 1 | 1.500x |" in note
    assert "| 1 | 0 | - |" in note  # the failed candidate: run once, passed never
    assert note.startswith("**kb-nano kernels**: 2 rows (1 passed, 1 failed, 0 skipped)")


@pytest.mark.parametrize("value", [1.0, 2.0, 1234567.0])
def test_whole_numbers_are_not_rounded(value):
    assert tracking.store.four_digits(value) == value
