"""Perf_report-style plots of merged kernel rows: one line per provider against num_tokens.

One panel per group (target, model, TP, operator variant such as ``ctx1024``, and the
device when a result set holds several), drawn only when the group has a passed row:

- ``metric="ms"``: median time per call (ms, log y) against ``num_tokens`` (log2 x);
- ``metric="gbs"``: achieved bandwidth, ``bytes_moved`` / median time (GB/s, log y),
  for the groups whose scenarios know ``bytes_moved``.

Providers are the baseline (grey, one point per scenario: the median of the
``baseline_ms`` of the scenario's passed rows) and each candidate (colours of
:func:`~kb_nano.tracking.plot_style.provider_colors`, the same in every panel and in the
speedup plot). Only passed rows make points; the others are named in a note under the
panel (``triton_rowwise skipped: n1 n16``). A candidate's point carries an error bar, its
row's 95% rerun interval: the speedup interval (``speedup_ci_low`` .. ``speedup_ci_high``,
:func:`kb_nano.stats.speedup_interval`) carried to the candidate's time, ``baseline_ms /
speedup_ci_high`` .. ``baseline_ms / speedup_ci_low`` (and its GB/s), i.e. how far a rerun
may put the candidate relative to the baseline; the candidates' bars are set apart by a
small shift along num_tokens so that they do not hide each other. :func:`perf_series` returns the numbers,
:func:`perf_figure` the matplotlib ``Figure``, :func:`perf_plot` writes the PNG.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from kb_nano.tracking.plot_style import (
    BASELINE,
    figure,
    log_axis,
    message_figure,
    provider_colors,
    save,
    short_name,
    variant_of,
    widen_log_limits,
)

METRICS = {
    "ms": ("median time per call (ms)", "time per call against num_tokens (median; lower is better)"),
    "gbs": (
        "achieved bandwidth (GB/s)",
        "achieved bandwidth (bytes_moved / median time) against num_tokens (higher is better)",
    ),
}
MAX_COLS = 3  # panels per figure row
MAX_NOTE_LINES = 4  # lines of not-passed rows under a panel; the rest is counted


def _value(ms: float | None, nbytes: int | None, metric: str) -> float | None:
    """The plotted value of a median time ``ms`` (milliseconds): itself for ``ms``,
    ``nbytes / ms`` in GB/s for ``gbs``; None when unknown or not positive."""
    if not ms or ms <= 0 or math.isnan(ms):
        return None
    if metric == "ms":
        return ms
    return nbytes / (ms * 1e-3) / 1e9 if nbytes else None


def _interval(r: dict, metric: str) -> tuple[float, float] | None:
    """A passed row's 95% rerun interval carried to its candidate's value: the times
    ``baseline_ms / speedup_ci_high`` .. ``baseline_ms / speedup_ci_low`` (ms), as
    ``(low, high)`` of ``metric``; None without a positive interval or baseline time."""
    lo, hi, base = r.get("speedup_ci_low"), r.get("speedup_ci_high"), r.get("baseline_ms")
    if not (lo and hi and base and 0 < lo <= hi and base > 0):
        return None
    ends = [_value(base / s, r.get("bytes_moved"), metric) for s in (hi, lo)]
    return None if None in ends else (min(ends), max(ends))


def _group_key(r: dict, by_device: bool) -> tuple:
    device = (r.get("device_name") or r.get("device") or "unknown") if by_device else ""
    return (r["target"], r["model"], r["tp"], variant_of(r), device)


def _group_order(key: tuple, level: int) -> tuple:
    target, model, tp, variant, device = key
    return (level, target, model, tp, len(variant), variant, device)


def perf_series(rows: list[dict], metric: str = "ms") -> list[dict]:
    """The panels of :func:`perf_figure`, in order: one dict per group with a passed row
    that has a value for ``metric`` (``ms`` or ``gbs``).

    Keys: ``target``, ``model``, ``tp``, ``variant`` (``""`` for none), ``device`` (``""``
    unless the rows come from several devices), ``lines`` (``{provider: [(num_tokens,
    value), ...]}`` sorted by num_tokens, :data:`~kb_nano.tracking.plot_style.BASELINE`
    first, then the candidate ids sorted; value in ms or GB/s), ``intervals``
    (``{candidate: [(num_tokens, low, high), ...]}``, the 95% rerun interval of the value,
    see the module's doc, for the points whose row has one; the median of each bound
    where several rows make a point) and ``not_passed`` (``[(candidate, status,
    num_tokens), ...]`` of the group's rows that did not pass)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, not {metric!r}")
    by_device = len({r.get("device_name") or r.get("device") or "unknown" for r in rows}) > 1
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group_key(r, by_device), []).append(r)
    panels = []
    for key, grows in groups.items():
        passed = [r for r in grows if r["status"] == "passed"]
        base: dict[int, list[float]] = {}
        cand: dict[str, dict[int, list[float]]] = {}
        bounds: dict[str, dict[int, list[tuple[float, float]]]] = {}
        for r in passed:
            n = r["num_tokens"]
            if r.get("baseline_ms") and r["baseline_ms"] > 0:
                base.setdefault(n, []).append(r["baseline_ms"])
            v = _value(r.get("candidate_ms"), r.get("bytes_moved"), metric)
            if v is not None:
                cand.setdefault(r["candidate"], {}).setdefault(n, []).append(v)
                ci = _interval(r, metric)
                if ci is not None:
                    bounds.setdefault(r["candidate"], {}).setdefault(n, []).append(ci)
        nbytes = {r["num_tokens"]: r.get("bytes_moved") for r in passed}
        lines: dict[str, list[tuple[int, float]]] = {}
        bline = [(n, _value(statistics.median(ms), nbytes[n], metric)) for n, ms in sorted(base.items())]
        if any(v is not None for _, v in bline):
            lines[BASELINE] = [(n, v) for n, v in bline if v is not None]
        for c in sorted(cand):
            lines[c] = [(n, statistics.median(vs)) for n, vs in sorted(cand[c].items())]
        if not lines:
            continue
        intervals = {
            c: [
                (n, statistics.median(lo for lo, _ in cis), statistics.median(hi for _, hi in cis))
                for n, cis in sorted(by_n.items())
            ]
            for c, by_n in sorted(bounds.items())
        }
        not_passed = sorted((r["candidate"], r["status"], r["num_tokens"]) for r in grows if r["status"] != "passed")
        target, model, tp, variant, device = key
        level = min(r.get("level") or 0 for r in grows)
        panels.append(
            {
                "order": _group_order(key, level),
                "target": target,
                "model": model,
                "tp": tp,
                "variant": variant,
                "device": device,
                "lines": lines,
                "intervals": intervals,
                "not_passed": not_passed,
            }
        )
    panels.sort(key=lambda p: p["order"])
    for p in panels:
        del p["order"]
    return panels


def _note(not_passed: list[tuple[str, str, int]]) -> str:
    """``not passed: torch_fused incorrect: n64`` lines, one per (candidate, status)."""
    by: dict[tuple[str, str], list[int]] = {}
    for cand, status, n in not_passed:
        by.setdefault((short_name(cand), status), []).append(n)
    lines = [f"{c} {s}: " + " ".join(f"n{n}" for n in sorted(ns)) for (c, s), ns in sorted(by.items())]
    if len(lines) > MAX_NOTE_LINES:
        lines = lines[: MAX_NOTE_LINES - 1] + [f"+{len(lines) - MAX_NOTE_LINES + 1} more"]
    return "not passed (no point): " + "\n    ".join(lines) if lines else ""


def panel_title(panel: dict) -> str:
    """``rms_norm · llama32-1b · tp1`` (+ `` · ctx1024``, + `` · <device>``)."""
    parts = [panel["target"], panel["model"], f"tp{panel['tp']}", panel["variant"], panel["device"]]
    return " · ".join(p for p in parts if p)


def perf_figure(rows: list[dict], metric: str = "ms", title: str | None = None):
    """The figure of :func:`perf_plot` (a matplotlib ``Figure``, not saved)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    panels = perf_series(rows, metric)
    ylabel, what = METRICS[metric]
    if not panels:
        need = "passed rows" if metric == "ms" else "passed rows with bytes_moved"
        return message_figure(f"no {need} in this result set: nothing to plot against num_tokens")
    colors = provider_colors(rows)
    ncols = min(MAX_COLS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = figure(5.2 * ncols, 4.1 * nrows + 0.6)
    grid = fig.subplots(nrows, ncols, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels) :]:
        ax.remove()  # no empty panels
    for ax, panel in zip(axes, panels):
        ns = sorted({n for pts in panel["lines"].values() for n, _ in pts})
        _error_bars(ax, panel, colors)
        for provider, pts in panel["lines"].items():
            base = provider == BASELINE
            ax.plot(
                [n for n, _ in pts],
                [v for _, v in pts],
                marker="s" if base else "o",
                ms=5,
                lw=2.0 if base else 1.5,
                ls="--" if base else "-",
                color=colors.get(provider, "black"),
                label=provider if base else short_name(provider),
                gid=provider,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlim(ns[0] / 1.5, ns[-1] * 1.5)
        ax.xaxis.set_major_locator(FixedLocator(ns))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        lo, hi = widen_log_limits(ax.yaxis)
        log_axis(ax.yaxis, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if hi / lo < 20 else (1.0, 2.0, 5.0))
        ax.grid(which="major", alpha=0.3)
        ax.set_title(panel_title(panel), loc="left", fontsize=9)
        ax.set_xlabel("num_tokens (log2)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, frameon=False, loc="best")
        note = _note(panel["not_passed"])
        if note:
            ax.text(0.0, -0.2, note, transform=ax.transAxes, fontsize=6, va="top", ha="left", color="#666666")
    bars = (
        "; bars: 95% rerun interval of the candidate relative to the baseline"
        if any(p["intervals"] for p in panels)
        else ""
    )
    fig.suptitle((title or f"kb-nano kernels: {what}") + bars, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    return fig


def _error_bars(ax, panel: dict, colors: dict) -> None:
    """Each candidate's intervals as error bars (``gid="interval <candidate>"``), shifted
    by a factor of 2**(0.06 k) along num_tokens for the k-th candidate from the middle."""
    cands = list(panel["intervals"])
    for k, cand in enumerate(cands):
        pts = dict(panel["lines"][cand])
        shift = 2 ** (0.06 * (k - (len(cands) - 1) / 2))
        xs = [n * shift for n, _, _ in panel["intervals"][cand]]
        ys = [pts[n] for n, _, _ in panel["intervals"][cand]]
        err = [
            [max(pts[n] - lo, 0.0) for n, lo, _ in panel["intervals"][cand]],
            [max(hi - pts[n], 0.0) for n, _, hi in panel["intervals"][cand]],
        ]
        container = ax.errorbar(
            xs, ys, yerr=err, fmt="none", ecolor=colors.get(cand, "black"), elinewidth=1.0, capsize=2.5, alpha=0.8
        )
        container.set_label(f"_interval {cand}")
        for artist in container.lines[2]:
            artist.set_gid(f"interval {cand}")


def perf_plot(rows: list[dict], out: Path, metric: str = "ms", title: str | None = None) -> Path:
    """Write :func:`perf_figure` of ``rows`` for ``metric`` (``ms``: median time per
    call in ms; ``gbs``: ``bytes_moved`` / median time in GB/s) as a PNG to ``out``
    (parent created; 100 dpi); returns ``out``. Axes: log2 num_tokens, log value."""
    return save(perf_figure(rows, metric, title), out)
