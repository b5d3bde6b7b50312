"""The kernel plots' content (kb_nano.tracking.perf_plots, kb_nano.tracking.plots) read
back from the matplotlib Figures, the merged HTML table (kb_nano.tracking.report_table),
and a real small Snakemake sweep that writes the new PNGs and the table."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys

import pytest
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.text import Text
from tracking_helpers import result_set, row
from workflow_helpers import copy_workflow

from kb_nano import tracking
from kb_nano.tracking.perf_plots import perf_figure, perf_plot, perf_series
from kb_nano.tracking.plot_style import BASELINE, BASELINE_COLOR, PALETTE, provider_colors, shape_label, variant_of
from kb_nano.tracking.plots import CROWDED_LABELS, bandwidth_figure
from kb_nano.tracking.report_table import TABLE_COLUMNS, kernels_table_html, write_kernels_table
from kb_nano.tracking.speedup_plots import speedup_figure


def _timed(target: str, cand: str, base: float, ms: float, **kw) -> dict:
    """A passed row with the given baseline and candidate median times (ms)."""
    return dict(row(target, cand, speedup=base / ms, **kw), baseline_ms=base, candidate_ms=ms)


def _rows() -> list[dict]:
    """rms_norm on llama31-8b tp1 at n1/16/64 (torch_fused passes everywhere,
    triton_rowwise fails at n64); silu_and_mul at tp2 with one passed row; a group
    (llama32-1b) with no passed row; attention decode rows with a ctx1024 variant."""
    rows = []
    for n, (base, fused, triton) in {1: (0.02, 0.016, 0.018), 16: (0.04, 0.03, 0.05), 64: (0.1, 0.08, None)}.items():
        rows.append(_timed("rms_norm", "torch_fused", base, fused, n=n))
        if triton:
            # a second baseline measurement of the same scenario: the plot takes the median
            rows.append(_timed("rms_norm", "triton_rowwise", base * 1.5, triton, n=n))
        else:
            rows.append(row("rms_norm", "triton_rowwise", n=n, status="incorrect"))
    rows.append(_timed("silu_and_mul", "inplace", 0.03, 0.02, tp=2, n=16))
    rows.append(row("silu_and_mul", "inplace", tp=2, n=64, status="skipped"))
    rows.append(row("rms_norm", "torch_fused", model="llama32-1b", status="runtime_error"))
    for n in (8, 32):
        r = _timed("attention", "gqa_grouped", 0.5, 0.5 / 1.1, n=n)
        r["scenario_id"] += "__ctx1024"
        rows.append(r)
    return rows


def _lines(ax) -> dict[str, list]:
    return {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}


def test_shape_labels_and_variants():
    r = row("attention", "gqa_grouped", n=8)
    assert (variant_of(r), shape_label(r)) == ("", "n8")
    r["scenario_id"] += "__ctx1024"
    assert (variant_of(r), shape_label(r)) == ("ctx1024", "n8 ctx1024")
    assert variant_of({"variant": "ctx256", "scenario_id": "x"}) == "ctx256"


def test_provider_colors_distinct_over_the_result_set_and_none_for_skipped_only():
    rows = _rows() + [row("rms_norm", "triton_only", status="skipped")]
    colors = provider_colors(rows)
    assert colors[BASELINE] == BASELINE_COLOR
    cands = sorted({r["candidate"] for r in rows if r["status"] != "skipped"})
    # every candidate that ran has its own colour, across targets too (the roofline plot
    # draws several targets' candidates in one panel), in the order of the sorted ids
    assert [colors[c] for c in cands] == PALETTE[: len(cands)]
    assert len({colors[c] for c in cands} | {BASELINE_COLOR}) == len(cands) + 1
    assert "rms_norm/triton_only" not in colors  # only skipped: drawn nowhere


def test_perf_series_baseline_median_passed_points_and_not_passed_list():
    panels = perf_series(_rows(), "ms")
    keys = [(p["target"], p["model"], p["tp"], p["variant"]) for p in panels]
    # no panel for the llama32-1b group, which has no passed row; the variant is its own group
    assert keys == [
        ("attention", "llama31-8b", 1, "ctx1024"),
        ("rms_norm", "llama31-8b", 1, ""),
        ("silu_and_mul", "llama31-8b", 2, ""),
    ]
    rms = panels[1]
    assert list(rms["lines"]) == [BASELINE, "rms_norm/torch_fused", "rms_norm/triton_rowwise"]
    # n1, n16: median of 0.02 and 0.03 (two rows); n64: the one passed row's baseline
    assert rms["lines"][BASELINE] == [(1, pytest.approx(0.025)), (16, pytest.approx(0.05)), (64, pytest.approx(0.1))]
    assert rms["lines"]["rms_norm/torch_fused"] == [(1, 0.016), (16, 0.03), (64, 0.08)]
    assert rms["lines"]["rms_norm/triton_rowwise"] == [(1, 0.018), (16, 0.05)]  # n64 did not pass
    assert rms["not_passed"] == [("rms_norm/triton_rowwise", "incorrect", 64)]
    assert panels[2]["not_passed"] == [("silu_and_mul/inplace", "skipped", 64)]
    gbs = perf_series(_rows(), "gbs")
    # bytes_moved 24576 over 0.016 ms = 1.536 GB/s
    assert gbs[1]["lines"]["rms_norm/torch_fused"][0] == (1, pytest.approx(24576 / 0.016e-3 / 1e9))
    with pytest.raises(ValueError):
        perf_series(_rows(), "flops")


def test_perf_figure_lines_points_scales_titles_and_notes(tmp_path):
    fig = perf_figure(_rows(), "ms")
    axes = fig.get_axes()
    assert len(axes) == 3  # 3 groups with a passed row on a 3-column grid: no empty panel
    titles = [ax.get_title(loc="left") for ax in axes]
    assert titles == [
        "attention · llama31-8b · tp1 · ctx1024",
        "rms_norm · llama31-8b · tp1",
        "silu_and_mul · llama31-8b · tp2",
    ]
    ax = axes[1]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.xaxis.get_transform().base == 2
    lines = _lines(ax)
    assert set(lines) == {BASELINE, "rms_norm/torch_fused", "rms_norm/triton_rowwise"}
    assert {gid: len(ln.get_xdata()) for gid, ln in lines.items()} == {
        BASELINE: 3,
        "rms_norm/torch_fused": 3,
        "rms_norm/triton_rowwise": 2,
    }
    assert list(lines["rms_norm/triton_rowwise"].get_xdata()) == [1, 16]
    assert all(ln.get_marker() not in (None, "", "None") for ln in lines.values())
    assert to_hex(lines[BASELINE].get_color()) == BASELINE_COLOR
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["baseline", "torch_fused", "triton_rowwise"]
    notes = [t.get_text() for t in ax.texts]
    assert notes == ["not passed (no point): triton_rowwise incorrect: n64"]
    assert [float(v) for v in ax.get_xticks()] == [1.0, 16.0, 64.0]
    # every panel has data; colours of a candidate are the same wherever it appears
    assert all(_lines(a) for a in axes)
    gbs = perf_figure(_rows(), "gbs")
    assert len(gbs.get_axes()) == 3
    assert "GB/s" in gbs.get_axes()[0].get_ylabel()
    out = perf_plot(_rows(), tmp_path / "p/t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perf_figure_without_passed_rows_or_bytes_has_no_axes():
    failed = [row("rms_norm", "torch_fused", status="incorrect")]
    assert perf_figure(failed).get_axes() == []
    no_bytes = [dict(r, bytes_moved=None) for r in _rows()]
    assert perf_figure(no_bytes, "gbs").get_axes() == []
    assert len(perf_figure(no_bytes, "ms").get_axes()) == 3
    assert perf_figure([]).get_axes() == []


def test_speedup_bars_carry_intervals_and_hatch_the_not_significant():
    rows = [
        row("rms_norm", "torch_fused", n=1, speedup=1.5, speedup_ci_low=1.3, speedup_ci_high=1.8, significant=True),
        row("rms_norm", "torch_fused", n=16, speedup=0.9, speedup_ci_low=0.7, speedup_ci_high=1.2, significant=False),
        row("rms_norm", "triton_rowwise", n=1, status="incorrect"),
    ]
    fig = speedup_figure(rows)
    (ax,) = fig.get_axes()
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    tops = [round(p.get_y() + p.get_height(), 6) for c in bars for p in c.patches]
    assert tops == [1.5, 0.9]
    assert [p.get_hatch() for c in bars for p in c.patches] == [None, "//"]
    assert [c.get_label() for c in bars] == ["rms_norm/torch_fused"] * 2
    errs = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    spans = []
    for c in errs:
        (segs,) = [lc.get_segments() for lc in c.lines[2]]
        spans.append(tuple(round(float(y), 6) for y in (segs[0][0][1], segs[0][1][1])))
    assert spans == [(1.3, 1.8), (0.7, 1.2)]
    assert any(line.get_ydata()[0] == 1.0 and line.get_linestyle() == "--" for line in ax.get_lines())
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "not significant" in labels and "rms_norm/triton_rowwise" in labels
    lo, hi = ax.get_ylim()
    assert lo < 0.7 and hi > 1.8  # the whiskers fit


def _labels(ax) -> list[str]:
    return [t.get_text() for t in ax.texts if t.get_gid() == "point_label"]


def test_bandwidth_points_labelled_by_shape_even_when_crowded():
    fig = bandwidth_figure(_rows())
    ax_bw, ax_fl = fig.get_axes()
    assert sorted(set(_labels(ax_bw))) == ["n1", "n16", "n32 ctx1024", "n64", "n8 ctx1024"]
    # one label per shape and position, though each has a baseline and candidate points
    assert _labels(ax_bw).count("n8 ctx1024") == 1
    crowded = []
    for n in range(2 * CROWDED_LABELS):
        crowded.append(dict(row("rms_norm", "torch_fused", n=n + 1), bytes_moved=1000 * (n + 1)))
    fig = bandwidth_figure(crowded)
    fig.canvas.draw()
    ax_bw, _ = fig.get_axes()
    notes = " ".join(t.get_text() for t in ax_bw.texts if t.get_gid() == "unplaced_labels")
    # every shape is labelled at its point or listed under the panel: none left out
    for n in range(2 * CROWDED_LABELS):
        assert f"n{n + 1}" in _labels(ax_bw) or f"n{n + 1}:" in notes
    assert len(_labels(ax_bw)) > CROWDED_LABELS
    boxes = [Text.get_window_extent(t) for t in ax_bw.texts if t.get_gid() == "point_label"]  # less leader lines
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    frame = ax_bw.get_window_extent()
    assert all(frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 for b in boxes)


def test_bandwidth_candidates_of_two_targets_differ_in_colour():
    rows = [_timed("rms_norm", "torch_fused", 0.02, 0.016), _timed("silu_and_mul", "inplace", 0.03, 0.02)]
    ax_bw, _ = bandwidth_figure(rows).get_axes()
    filled = {to_hex(ln.get_color()) for ln in ax_bw.get_lines() if ln.get_markerfacecolor() != "none"}
    assert filled - {BASELINE_COLOR} == {PALETTE[0], PALETTE[1]}


def test_kernels_table_html(tmp_path):
    rows = _rows()
    i = next(i for i, r in enumerate(rows) if r["status"] == "incorrect")
    rows[i] = dict(rows[i], error="AssertionError: <max abs err 3.0>\nsecond line")
    page = kernels_table_html(rows)
    assert page.count("<tr>") + page.count("<tr class=") == len(rows) + 1  # header + one per row
    for col in TABLE_COLUMNS:
        assert f"<th>{col}</th>" in page
    assert "AssertionError: &lt;max abs err 3.0&gt;" in page and "second line" not in page
    assert '<tr class="not_passed">' in page and '<tr class="skipped">' in page
    assert "<td>ctx1024</td>" in page
    assert f"{len(rows)} rows: 1 incorrect, 8 passed, 1 runtime_error, 1 skipped" in page  # the CLI's words
    out = write_kernels_table(rows, tmp_path / "t/kernels_table.html")
    assert out.read_text(encoding="utf-8") == page


def test_html_table_names_statuses_as_the_cli_and_cuts_notes_at_a_word(monkeypatch, capsys):
    """The HTML table's summary counts the rows by status in the words of the CLI's
    summary line (no "failed"); a long note is cut at a word boundary with an ellipsis,
    the whole note in the cell's title; a short note is left as is."""
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels
    from kb_nano.tracking.report_table import MAX_NOTE_CHARS

    long = "the candidate's processes used 12.3 ms of CPU while the baseline's batch was timed: " * 3
    rows = [
        {**row("rms_norm", "a", status="unsynced_work"), "error": long.strip()},
        {**row("rms_norm", "b", n=64, status="unsynced_work"), "error": "short <reason>"},
        row("rms_norm", "c", n=512),
    ]
    page = kernels_table_html(rows)
    assert "3 rows: 1 passed, 2 unsynced_work" in page and "failed" not in page.split("<table>")[0]
    monkeypatch.setenv("COLUMNS", "250")
    print_kernels(rows, summarize(rows))
    assert "3 rows: 1 passed, 2 unsynced_work" in capsys.readouterr().out
    (cell,) = [c for c in page.split("<td") if "12.3 ms" in c and "title=" in c]
    title = cell.split('title="')[1].split('"')[0]
    assert title == html.escape(long.strip())
    shown = cell.split(">", 1)[1].split("</td>")[0]
    assert shown.endswith("…") and len(html.unescape(shown)) <= MAX_NOTE_CHARS
    assert long.startswith(html.unescape(shown[:-1])) and long[len(html.unescape(shown[:-1]))] == " "  # a whole word
    assert '<td class="note">short &lt;reason&gt;</td>' in page


def test_speedup_panel_title_names_the_statuses():
    rows = [
        row("rms_norm", "a", status="unsynced_work"),
        row("rms_norm", "b", status="unsynced_work"),
        row("rms_norm", "c"),
    ]
    (ax,) = speedup_figure(rows).get_axes()
    assert ax.get_title(loc="left") == "rms_norm  —  2 unsynced_work"


def test_log_kernels_keeps_the_table_with_the_results(tmp_path):
    kwargs = result_set(tmp_path, _rows())
    table = write_kernels_table(_rows(), tmp_path / "results/kernels_table.html")
    rec = tracking.log_kernels(**kwargs, tables=[table], tracking_uri=tracking.default_tracking_uri(tmp_path))
    arts = tracking.client(rec["tracking_uri"]).list_artifacts(rec["run_id"], "results")
    assert "results/kernels_table.html" in {a.path for a in arts}


@pytest.mark.slow
def test_small_sweep_writes_the_perf_plots_and_the_table(tmp_path):
    root = copy_workflow(tmp_path, {"targets": ["rms_norm"], "num_tokens": [1, 16]})
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "small.yaml"],
        cwd=root,
        env={**env, "KB_NANO_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("kernels_perf_time.png", "kernels_perf_gbs.png", "kernels_speedup.png", "kernels_bandwidth.png"):
        png = root / "results/plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
    rows = tracking.read_parquet_rows(root / "results/kernels.parquet")
    (panel,) = perf_series(rows, "ms")
    assert panel["lines"][BASELINE] and [n for n, _ in panel["lines"][BASELINE]] == [1, 16]
    page = (root / "results/kernels_table.html").read_text()
    assert page.count("rms_norm/torch_fused") == 2
    marker = json.loads((root / "results/mlflow/kernels.json").read_text())
    client = tracking.client(marker["tracking_uri"])
    plots = {a.path for a in client.list_artifacts(marker["run_id"], "plots")}
    assert {"plots/kernels_perf_time.png", "plots/kernels_perf_gbs.png"} <= plots
