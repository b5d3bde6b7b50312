"""Providers side by side (kb_nano.kernels.providers): grouping, the scenario's baseline,
the cells, --versus."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kb_nano.kernels.providers import gbps, group_key, provider_tables, scenario_view


def row(sid, n, cand, base, ms, status="passed", speed=None, lo=None, hi=None, sig=True, nbytes=None, flops=None):
    return {
        "scenario_id": sid,
        "num_tokens": n,
        "candidate": cand,
        "status": status,
        "baseline_ms": base,
        "candidate_ms": ms,
        "speedup": speed if speed is not None else (base / ms if base and ms else None),
        "speedup_ci_low": lo,
        "speedup_ci_high": hi,
        "significant": sig,
        "bytes_moved": nbytes,
        "flops": flops,
    }


ROWS = [
    row("rms_norm__m__tp1__n64", 64, "rms_norm/a", 1.0, 0.5, lo=1.9, hi=2.1, nbytes=2e6),
    row("rms_norm__m__tp1__n64", 64, "rms_norm/b", 3.0, 1.0, lo=2.5, hi=3.5, nbytes=2e6),
    row("rms_norm__m__tp1__n1", 1, "rms_norm/a", 0.2, 0.1, lo=0.8, hi=3.0, sig=False),
    {**row("rms_norm__m__tp1__n1", 1, "rms_norm/b", 0.4, None, status="incorrect"), "error": "max_abs_err 3.1"},
    row("attention__m__tp1__n8__ctx1024", 8, "attention/x", 2.0, 1.0, flops=3e9),
]


def render(tables) -> str:
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    for t in tables:
        console.print(t)
    return out.getvalue()


def test_group_key_splits_the_num_tokens_part_and_the_variant():
    assert group_key({"scenario_id": "attention__m__tp2__n8__ctx1024"}) == ("attention__m__tp2", "ctx1024")
    assert group_key({"scenario_id": "rms_norm__llama31-8b__tp1__n64"}) == ("rms_norm__llama31-8b__tp1", "")
    with pytest.raises(ValueError, match="no __n"):
        group_key({"scenario_id": "odd"})


def test_one_baseline_per_scenario_the_median_of_the_passed_rows():
    view = scenario_view(ROWS)
    assert list(view) == [("rms_norm__m__tp1", ""), ("attention__m__tp1", "ctx1024")]
    g = view[("rms_norm__m__tp1", "")]
    assert g["providers"] == ["rms_norm/a", "rms_norm/b"]
    assert list(g["lines"]) == [1, 64]  # ascending num_tokens
    assert g["lines"][64]["baseline_ms"] == pytest.approx(2.0)  # median of 1.0 and 3.0
    assert g["lines"][1]["baseline_ms"] == pytest.approx(0.2)  # the incorrect row's baseline is left out
    assert g["lines"][64]["baseline_gbps"] == pytest.approx(gbps(2e6, 2.0)) == pytest.approx(1.0)


def test_cells_show_time_bandwidth_speedup_interval_and_status():
    text = render(provider_tables(ROWS))
    assert "rms_norm m tp1" in text and "attention m tp1 ctx1024" in text
    assert "0.5000 ms" in text and "4 GB/s" in text  # 2e6 bytes in 0.5 ms
    assert "2.00x [1.90-2.10]" in text
    assert "vs 3.0000 ms paired" in text  # b's speedup is over its own baseline time, not the column's 2.0
    assert "2.00x [0.80-3.00] ~" in text  # not significant
    assert "incorrect" in text and "max_abs_err 3.1" in text  # a row that did not pass says why
    assert "3 TFLOP/s" in text and "1.5 TFLOP/s" in text  # 3e9 FLOP in 1.0 ms (candidate) and 2.0 ms (baseline)


def test_versus_gives_each_candidates_ratio_to_the_named_one_and_rejects_unknown_ids():
    text = render(provider_tables(ROWS, versus="rms_norm/b"))
    assert "rms_norm/b (versus)" in text
    assert "vs: 2.00x" in text  # b 1.0 ms / a 0.5 ms at n64
    with pytest.raises(ValueError, match="--versus rms_norm/zz: not a candidate"):
        provider_tables(ROWS, versus="rms_norm/zz")
