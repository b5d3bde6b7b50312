"""The Tier-2 tables fit the terminal (:func:`kb_nano.e2e.table.e2e_table`): merged rows
built directly (no vLLM run), printed at ``$COLUMNS`` as ``kb_nano e2e`` prints them."""

from __future__ import annotations

import pytest
from tracking_helpers import e2e_rows, table_headers

from kb_nano.e2e.schema import PERCENTILES

KEY = ("model", "tp", "variant (forward calls)", "status", "speedup", "95% interval")
LATENCY_DETAIL = [f"p{q} ms" for q in PERCENTILES]
SERVE_DETAIL = [f"{m} {st} ms" for m in ("TTFT", "TPOT", "ITL", "E2EL") for st in ("mean", "p99")]
SERVE_DETAIL.remove("E2EL mean ms")  # serve's headline: the speedup's basis


@pytest.mark.parametrize("columns", [80, 120, 250])
def test_e2e_tables_fit_the_terminal(monkeypatch, capsys, columns):
    """At $COLUMNS no line is wider; model, tp, variant, status, speedup and its interval
    always stay; the percentiles and per-metric detail are left out first, then the pairs
    and the error, the headline metric (the speedup's basis) last; the caption names
    what is left out, and 250 columns show every column."""
    from kb_nano.e2e.table import print_e2e

    monkeypatch.setenv("COLUMNS", str(columns))
    print_e2e(e2e_rows())
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    flat = " ".join(out.split())
    latency, throughput, serve = (head.split(" | ") for head in table_headers(out))
    for head in (latency, throughput, serve):
        assert all(name in head for name in KEY), head
    assert "0.916x" in flat and "0.325-2.584 ~" in flat and "candidate_error" in flat
    assert "~ : the 95% rerun interval contains 1.0, so the speedup is not significant" in flat  # the legend
    if columns >= 120:  # (at 80 the variant column folds its lines)
        assert "rms_norm/torch_fused ×68" in flat and "silu_and_mul/inplace (not built)" in flat
    if columns == 250:
        assert latency == [*KEY[:4], "avg ms", *LATENCY_DETAIL, *KEY[4:], "pairs", "error"]
        assert throughput == [*KEY[:4], "req/s", "total tok/s", "output tok/s", *KEY[4:], "pairs"]
        assert serve[4:7] == ["req/s", "total tok/s", "output tok/s"] and "E2EL mean ms" in serve
        assert "left out" not in out and "expected a tensor of dtype bfloat16" in flat
    elif columns == 120:
        assert latency == [*KEY[:4], "avg ms", *KEY[4:]]
        left_out = ", ".join([*LATENCY_DETAIL, "pairs", "error"])
        assert f"left out at 120 columns: {left_out} (a wider terminal shows them)" in flat
        assert throughput == [*KEY[:4], "total tok/s", *KEY[4:], "pairs"]
        assert "left out at 120 columns: req/s, output tok/s (a wider" in flat
        assert serve == [*KEY[:4], "E2EL mean ms", *KEY[4:], "pairs"]
        assert f"left out at 120 columns: req/s, total tok/s, output tok/s, {', '.join(SERVE_DETAIL)} (a wider" in flat
    else:
        assert latency == list(KEY) and throughput == list(KEY) and serve == list(KEY)
        assert f"left out at 80 columns: avg ms, {', '.join(LATENCY_DETAIL)}, pairs, error" in flat
        assert "left out at 80 columns: req/s, total tok/s, output tok/s, pairs" in flat
