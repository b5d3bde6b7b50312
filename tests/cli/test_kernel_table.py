"""The Tier-1 table the CLI prints: the rows of an incremental run, shared notes as footnotes,
the width of the terminal."""

from __future__ import annotations

import pytest
from tracking_helpers import row, table_headers


def test_the_table_shows_what_an_incremental_run_measured():
    """A first run shows every row (its not-applicable rows, made at the merge, have no
    created_at); a rerun that measured some rows and reused others shows those it
    measured; a run that measured nothing shows the whole selection."""
    from kb_nano.kernels.table import measured_since

    start = "2026-12-02T10:00:00+00:00"
    old, new = "2026-12-02T09:00:00+00:00", "2026-12-02T10:00:05+00:00"
    na = {**row("qk_norm", "fused", status="skipped"), "created_at": None}
    fresh = [{**row("rms_norm", "a"), "created_at": new}, {**row("rms_norm", "b"), "created_at": new}, na]
    assert measured_since(fresh, start) is None
    rerun = [fresh[0], {**fresh[1], "created_at": old}, na]
    assert measured_since(rerun, start) == [fresh[0]]
    assert measured_since([{**r, "created_at": old} for r in fresh[:2]] + [na], start) is None


def test_notes_that_rows_share_are_footnotes(monkeypatch, capsys):
    """A note several rows have (a skip reason for every num_tokens, "not significant")
    is printed once under the table and the rows show its mark; a note one row has stays
    in its cell."""
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels

    skip = "tp=8 does not divide num_attention_heads=28"
    rows = [{**row("rms_norm", "torch_fused", n=n, status="skipped"), "error": skip} for n in (1, 64, 512)]
    rows += [row("rms_norm", "fp32", n=1, speedup=1.01, speedup_ci_low=0.9, speedup_ci_high=1.1, significant=False)]
    rows += [row("rms_norm", "fp32", n=64, speedup=1.0, speedup_ci_low=0.8, speedup_ci_high=1.2, significant=False)]
    rows += [{**row("rms_norm", "fp32", n=512, status="runtime_error"), "error": "RuntimeError: only here"}]
    monkeypatch.setenv("COLUMNS", "250")
    print_kernels(rows, summarize(rows))
    out = capsys.readouterr().out
    assert out.count(skip) == 1 and "[1] " + skip in out, out
    assert out.count("the 95% rerun interval contains 1.0") == 1, out
    assert out.count("RuntimeError: only here") == 1 and "[3]" not in out, out
    body = out.split("[1] " + skip)[0]
    assert body.count("[1]") == 3 and body.count("[2]") == 2, out


@pytest.mark.parametrize("columns", [100, 200])
def test_kernel_table_fits_the_terminal(monkeypatch, capsys, columns):
    """The Tier-1 table at $COLUMNS (what rich reads): no line wider, and scenario,
    candidate, status, speedup and its interval always there; the low-priority columns
    are left out at 100 columns (the caption says so) and all shown at 200."""
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels

    rows = [
        row("fused_add_rms_norm", "fp32_sum", n=64, speedup=2.29, speedup_ci_low=1.38, speedup_ci_high=3.79),
        row("rotary_embedding", "neox_inplace", model="mistral-7b-v03", n=16384, status="runtime_error"),
        row("rms_norm", "triton_rowwise", status="skipped"),
    ]
    monkeypatch.setenv("COLUMNS", str(columns))
    print_kernels(rows, summarize(rows))
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    (head,) = table_headers(out)
    for name in ("scenario", "candidate", "status", "speedup", "rerun 95%"):
        assert name in head.split(" | "), out
    flat = " ".join(out.split())
    assert "2.29x" in flat and "1.38-3.79" in flat and "runtime_error" in flat
    if columns == 200:
        assert "baseline ms ±IQR" in head and "max_abs_err" in head and "left out" not in out
    else:
        assert "baseline ms ±IQR" not in head and "left out at 100 columns: max_abs_err" in flat


def test_the_error_column_says_how_close_to_the_tolerance(monkeypatch, capsys):
    """max_abs_err is shown with the share of the allowed error the worst element used
    (tolerance_used), so a pass at 95% of the limit is told from one at 5%; a row of an
    older schema (no tolerance_used) shows the error alone."""
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels

    rows = [
        row("rms_norm", "close", max_abs_err=0.0312, tolerance_used=0.953),
        row("rms_norm", "exact", n=64, max_abs_err=0.0, tolerance_used=0.0),
        row("rms_norm", "old", n=512, max_abs_err=0.0041),
    ]
    monkeypatch.setenv("COLUMNS", "250")
    print_kernels(rows, summarize(rows))
    out = capsys.readouterr().out
    (head,) = table_headers(out)
    assert "max_abs_err (% of allowed)" in head.split(" | "), out
    assert "0.0312 (95%)" in out and " 0 (0%)" in out, out
    assert "0.0041 " in out and "0.0041 (" not in out, out


def test_load_warning_names_the_loaded_rows():
    """One line when a row's load average (at its start or end) exceeded the CPUs its
    judge had: how many rows, the highest load, the consequence and what to do; none on
    an idle host or for rows that recorded no load."""
    from kb_nano.kernels.table import load_warning

    idle = row("rms_norm", "a", load_avg_start=0.4, load_avg_end=1.1, cpus_available=2)
    busy = row("rms_norm", "b", load_avg_start=4.6, load_avg_end=5.3, cpus_available=2)
    ends_busy = row("rms_norm", "c", load_avg_start=1.0, load_avg_end=2.5, cpus_available=2)
    assert load_warning([idle, row("rms_norm", "old")]) is None
    skipped = row("rms_norm", "d", status="skipped", load_avg_start=9.0, load_avg_end=9.0, cpus_available=2)
    assert load_warning([idle, skipped]) is None  # nothing was timed
    failed = row("rms_norm", "e", status="incorrect", speedup=None, load_avg_start=9.0, cpus_available=2)
    assert load_warning([idle, failed]) is None  # no time reported either
    line = load_warning([idle, busy, ends_busy, skipped, failed])
    assert "\n" not in line and line.startswith("warning: 2 of 3 rows")
    assert "load average up to 5.3 on 2 CPUs" in line
    assert "significance are unreliable" in line and "idle host" in line


def test_kernels_prints_the_load_warning_after_the_table(work, monkeypatch, capsys):
    """`kb_nano kernels` (both views) ends its table with the load warning when a row was
    measured on a loaded host."""
    from kb_nano.cli import commands as cli_commands
    from kb_nano.kernels.merge import summarize

    rows = [row("rms_norm", "torch_fused", speedup=1.3, load_avg_start=4.6, load_avg_end=5.3, cpus_available=2)]
    doc = {"rows": rows, "summary": summarize(rows)}
    monkeypatch.setattr(cli_commands, "run_tier", lambda *a: a[-1](doc))
    monkeypatch.setattr(cli_commands.kbw, "start_manifest", lambda root, effective: None)
    monkeypatch.chdir(work)
    monkeypatch.setenv("COLUMNS", "200")
    from kb_nano.cli import main

    for view in ([], ["--by-scenario"]):
        assert main(["kernels", "--target", "rms_norm", "--model", "llama31-8b", *view]) == 0
        captured = capsys.readouterr()
        assert "rms_norm" in captured.out
        (line,) = [ln for ln in captured.err.splitlines() if ln.startswith("warning:")]
        assert "1 of 1 rows" in line and "up to 5.3 on 2 CPUs" in line, captured.err


def test_a_narrow_column_folds_dotted_names_between_their_parts():
    """A dotted name wider than its wrapping column (a module path, `layers.*.self_attn.q_norm`)
    is folded after a dot, not inside a part; a part wider than the column still folds, and
    a one-line column is left alone."""
    from rich.console import Console

    from kb_nano.console import Column, break_at_dots, fit_table

    assert break_at_dots("layers.*.self_attn.q_norm / k_norm", 16) == "layers.*.\nself_attn.q_norm / k_norm"
    assert break_at_dots("short.name", 16) == "short.name"
    assert break_at_dots("post_attention_layernorm", 16) == "post_attention_layernorm"
    assert break_at_dots("model.layers.\\[0].x", 12) == "model.\nlayers.\\[0].x"  # markup escapes count once
    table = fit_table(
        [Column("used in", wrap=True, min_width=16, max_width=16), Column("module")],
        [["layers.*.self_attn.q_norm (per head)", "kb_nano.operators.norms"]],
        width=60,
    )
    console = Console(width=60, record=True)
    console.print(table)
    lines = [ln.strip("│ ") for ln in console.export_text().splitlines() if ln.startswith("│")]
    cells = [ln.split("│")[0].strip() for ln in lines]
    assert cells[:2] == ["layers.*.", "self_attn.q_norm"], lines
    assert "kb_nano.operators.norms" in lines[0]


def test_the_summary_says_when_a_review_flag_is_in_a_row_not_shown(monkeypatch, capsys):
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels

    flagged = {**row("rms_norm", "old", n=1, speedup=3.0), "review": "implausible: below the roofline"}
    fresh = row("rms_norm", "new", n=1, speedup=1.1)
    monkeypatch.setenv("COLUMNS", "250")
    print_kernels([flagged, fresh], summarize([flagged, fresh]), shown=[fresh])
    out = capsys.readouterr().out
    assert "1 flagged for REVIEW (1 of them in rows not shown: --all-rows)" in out, out
    print_kernels([flagged, fresh], summarize([flagged, fresh]))
    out = capsys.readouterr().out
    assert "1 flagged for REVIEW" in out and "not shown" not in out, out
