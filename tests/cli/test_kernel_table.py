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
