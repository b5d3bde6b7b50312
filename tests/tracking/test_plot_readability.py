"""What makes the kernel plots readable: the speedup plot draws only what ran (no panel
of skipped rows, no legend entry for a candidate that only skipped), failure statuses
that do not overlap, and the perf_report-style plots carry each candidate's 95% rerun
interval (kb_nano.tracking.speedup_plots, kb_nano.tracking.perf_plots)."""

from __future__ import annotations

import pytest
from matplotlib.container import BarContainer
from tracking_helpers import row

from kb_nano.tracking.perf_plots import perf_figure, perf_series
from kb_nano.tracking.speedup_plots import speedup_figure


def _sweep() -> list[dict]:
    """rms_norm at 8 num_tokens: torch_fused passes, triton_rowwise skipped (CPU), two
    candidates failing with long statuses at some shapes; the `model` target only skipped."""
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        rows.append(row("rms_norm", "torch_fused", n=n, speedup=1.2, speedup_ci_low=1.1, speedup_ci_high=1.3))
        rows.append(row("rms_norm", "triton_rowwise", n=n, status="skipped"))
        rows.append(row("rms_norm", "cand_b", n=n, status="runtime_error" if n < 4 else "passed"))
        rows.append(row("rms_norm", "cand_c", n=n, status="incorrect_shape" if n < 16 else "passed"))
    rows.append(row("model", "sdpa", status="skipped"))
    return rows


def test_speedup_plot_has_no_panel_or_legend_entry_for_what_did_not_run():
    fig = speedup_figure(_sweep())
    axes = fig.get_axes()
    assert [ax.get_title(loc="left").split()[0] for ax in axes] == ["rms_norm"]  # no `model` panel
    (ax,) = axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "rms_norm/triton_rowwise" not in legend and "skipped" not in legend
    assert {"rms_norm/torch_fused", "rms_norm/cand_b", "rms_norm/cand_c"} <= set(legend)
    # the skipped rows and the skipped-only target are named, not drawn
    notes = [t.get_text() for t in ax.texts if t.get_gid() == "note"]
    assert notes == ["skipped (not run): triton_rowwise, 8 scenarios: skipped for the test"]
    assert any("every row skipped (not run): model" in t.get_text() for t in fig.texts)
    # 3 candidates that ran: each scenario's slot is shared by 3, not 4
    bars = [p for c in ax.containers if isinstance(c, BarContainer) for p in c.patches]
    assert {round(p.get_width(), 6) for p in bars} == {round(0.8 / 3 * 0.9, 6)}


def test_speedup_failure_statuses_are_named_and_do_not_overlap():
    fig = speedup_figure(_sweep())
    fig.canvas.draw()
    (ax,) = fig.get_axes()
    status = [t for t in ax.texts if t.get_gid() == "failed_status"]
    assert sorted(t.get_text() for t in status) == ["incorrect_shape"] * 4 + ["runtime_error"] * 2
    boxes = [t.get_window_extent() for t in status]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    frame = ax.get_window_extent()
    assert all(frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)  # inside the panel
    assert all(t.get_fontsize() >= 4.5 for t in status)


def test_only_skipped_rows_give_a_message_not_an_empty_panel():
    fig = speedup_figure([row("model", "sdpa", status="skipped")])
    assert fig.get_axes() == []
    assert "all skipped: model" in fig.texts[0].get_text()


def test_perf_points_carry_the_rows_rerun_interval():
    rows = [
        dict(
            row("rms_norm", "torch_fused", n=n, speedup=1.25, speedup_ci_low=1.0, speedup_ci_high=1.6), bytes_moved=8000
        )
        for n in (1, 16)
    ]
    (panel,) = perf_series(rows, "ms")
    # baseline 0.02 ms: the candidate's time between 0.02 / 1.6 and 0.02 / 1.0
    assert panel["intervals"]["rms_norm/torch_fused"] == [
        (1, pytest.approx(0.0125), pytest.approx(0.02)),
        (16, pytest.approx(0.0125), pytest.approx(0.02)),
    ]
    (gbs,) = perf_series(rows, "gbs")
    assert gbs["intervals"]["rms_norm/torch_fused"][0][1:] == (pytest.approx(0.4), pytest.approx(0.64))
    for metric in ("ms", "gbs"):
        (ax,) = perf_figure(rows, metric).get_axes()
        bars = [c for c in ax.collections if c.get_gid() == "interval rms_norm/torch_fused"]
        assert len(bars) == 1
        spans = sorted(tuple(sorted(float(y) for _, y in seg)) for seg in bars[0].get_segments())
        lo, hi = (0.0125, 0.02) if metric == "ms" else (0.4, 0.64)
        assert spans == [(pytest.approx(lo), pytest.approx(hi))] * 2
    # a row without an interval gets a point and no bar
    bare = [dict(r, speedup_ci_low=None, speedup_ci_high=None) for r in rows]
    assert perf_series(bare, "ms")[0]["intervals"] == {}
