"""The speedup plot of merged kernel results (matplotlib, Agg canvas; no pyplot global state).

Speedup (baseline median / candidate median) per scenario per candidate, one panel per
target, log scale, bars from the line at 1.0, the 95% rerun interval (``speedup_ci_low``
.. ``speedup_ci_high``) as a whisker, hatched bars where the speedup is not
``significant``. A row that failed (any status but passed and skipped) keeps its slot,
shaded red, with a ✗ at its foot and its status written upright in the slot. Skipped rows
(a candidate that does not support the device, a scenario the model lacks) take no slot
and no legend entry: a note under the panel names them with their reason, and a target
whose rows are all skipped gets no panel, only a line under the figure.
:func:`speedup_figure` returns the ``Figure``, :func:`speedup_plot` writes the PNG.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from kb_nano.kernels.merge import status_counts, summarize
from kb_nano.tracking.plot_style import (
    FAILED_COLOR,
    MAX_WIDTH_IN,
    figure,
    log_axis,
    message_figure,
    provider_colors,
    ran,
    save,
    shape_label,
    short_name,
)

TITLE = "kb-nano kernels: speedup over the PyTorch baseline"


def _scenario_label(row: dict) -> str:
    return f"{row['model']}\ntp{row['tp']} {shape_label(row)}"


def _passed_speedup(r: dict) -> float | None:
    s = r.get("speedup")
    return s if r["status"] == "passed" and s and s > 0 else None


def _interval(r: dict) -> tuple[float, float] | None:
    lo, hi = r.get("speedup_ci_low"), r.get("speedup_ci_high")
    return (lo, hi) if lo and hi and 0 < lo <= hi else None


def skipped_note(rows: list[dict]) -> str:
    """``skipped (not run): triton_rowwise, 16 scenarios: TritonRMSNorm supports cuda; ...``
    lines, one per candidate with skipped rows, with the first line of its first skipped
    row's reason (``error``); ``""`` when none is skipped."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "skipped":
            by.setdefault(r["candidate"], []).append(r)
    lines = []
    for cand, rs in sorted(by.items()):
        reason = str(rs[0].get("error") or "").strip().splitlines()
        n = len({r["scenario_id"] for r in rs})
        lines.append(f"{short_name(cand)}, {n} scenario{'s' if n != 1 else ''}" + (f": {reason[0]}" if reason else ""))
    return "skipped (not run): " + "\n    ".join(lines) if lines else ""


def speedup_figure(rows: list[dict], title: str = TITLE):
    """The figure of :func:`speedup_plot` (a matplotlib ``Figure``, not saved)."""
    shown = ran(rows)
    targets = sorted(
        {r["target"] for r in shown}, key=lambda t: (min(r["level"] or 0 for r in shown if r["target"] == t), t)
    )
    only_skipped = sorted({r["target"] for r in rows} - set(targets))
    unrun = ", ".join(only_skipped)
    if not targets:
        return message_figure(
            f"no kernel rows that ran in this result set (all skipped: {unrun})"
            if unrun
            else "no kernel rows in this result set"
        )
    colors = provider_colors(rows)
    widths = []
    for t in targets:
        n_sc = len({r["scenario_id"] for r in shown if r["target"] == t})
        n_c = len({r["candidate"] for r in shown if r["target"] == t})
        widths.append(n_sc * max(n_c * 0.45, 0.8) + 2)  # 0.8 in: a tick label's width
    width = min(max(8.0, *widths), MAX_WIDTH_IN)
    fig = figure(width, 3.9 * len(targets) + 0.8 + (0.3 if unrun else 0.0))
    axes = fig.subplots(len(targets), 1, squeeze=False)[:, 0]
    ends = [1.0]
    for r in shown:
        if _passed_speedup(r):
            ends += [r["speedup"], *(_interval(r) or ())]
    limits = (min(ends) / 1.6, max(ends) * 1.6)
    for ax, target in zip(axes, targets):
        _speedup_panel(ax, target, [r for r in rows if r["target"] == target], colors, limits)
    height = fig.get_figheight()
    fig.suptitle(
        title + "\nbars from 1.0 (above = faster); whiskers: 95% rerun interval; hatched: not significant",
        fontsize=10,
    )
    bottom = 0.0
    if unrun:
        fig.text(0.01, 0.01, f"no panel, every row skipped (not run): {unrun}", fontsize=8, color="#666666")
        bottom = 0.3 / height
    fig.tight_layout(rect=(0, bottom, 1, 1 - 0.6 / height))
    return fig


def _speedup_bar(ax, x: float, width: float, r: dict, color: str) -> None:
    """One passed row: a bar from 1.0 to its speedup (hatched when not significant), the
    95% interval as a whisker, the value past the whisker's end."""
    s = r["speedup"]
    ax.bar(
        x,
        s - 1.0,
        bottom=1.0,
        width=width,
        color=color,
        edgecolor="black",
        linewidth=0.4,
        hatch=None if r.get("significant") else "//",
        label=r["candidate"],
    )
    ci = _interval(r)
    if ci:
        err = [[max(s - ci[0], 0.0)], [max(ci[1] - s, 0.0)]]
        ax.errorbar([x], [s], yerr=err, fmt="none", ecolor="black", elinewidth=0.9, capsize=3, label=r["scenario_id"])
    up = s >= 1
    end = (ci[1] if up else ci[0]) if ci else s
    ax.text(x, end * (1.04 if up else 0.96), f"{s:.2f}x", ha="center", va="bottom" if up else "top", fontsize=7)


def _failed_slot(ax, x: float, width: float, status: str, fontsize: float) -> None:
    """A row that did not pass: its slot shaded red over the panel's height, a ✗ at its
    foot and the status written upright above it on a white box (``gid="failed_status"``;
    a smaller font when the status is longer than the panel is high)."""
    trans = ax.get_xaxis_transform()  # x in data, y in axes fraction
    ax.axvspan(x - width / 2, x + width / 2, color=FAILED_COLOR, alpha=0.1, lw=0)
    ax.plot([x], [0.05], transform=trans, marker="X", color=FAILED_COLOR, ms=8, ls="none", mec="black", mew=0.5)
    height_pt = ax.get_position().height * ax.get_figure().get_figheight() * 72 * 0.85
    size = min(fontsize, height_pt / max(0.62 * len(status), 1.0))
    ax.text(
        x,
        0.1,
        status,
        transform=trans,
        ha="center",
        va="bottom",
        rotation=90,
        fontsize=size,
        color=FAILED_COLOR,
        gid="failed_status",
        bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9},
    )


def _speedup_panel(ax, target: str, trows: list[dict], colors: dict, limits: tuple[float, float]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shown = ran(trows)
    scenarios = list(OrderedDict.fromkeys(r["scenario_id"] for r in shown))
    cands = sorted({r["candidate"] for r in shown})
    by_key = {(r["scenario_id"], r["candidate"]): r for r in shown}
    bar_w = 0.8 / max(len(cands), 1)
    # the status text must fit its slot: the slot's width in points, the text's height ~1.2 x its size
    fig = ax.get_figure()
    slot_pt = fig.get_figwidth() * 0.8 * 72 * bar_w / max(len(scenarios), 1)
    fontsize = max(4.5, min(7.0, slot_pt / 1.3))
    for j, cand in enumerate(cands):
        for i, sid in enumerate(scenarios):
            r = by_key.get((sid, cand))
            if r is None:
                continue
            x = i - 0.4 + bar_w * (j + 0.5)
            if _passed_speedup(r):
                _speedup_bar(ax, x, bar_w * 0.9, r, colors[cand])
            else:
                _failed_slot(ax, x, bar_w, r["status"], fontsize)
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_ylim(*limits)
    log_axis(ax.yaxis, "x", subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
    ax.set_xlim(-0.6, len(scenarios) - 0.4)
    ax.set_xticks(range(len(scenarios)))
    first = {sid: next(r for r in shown if r["scenario_id"] == sid) for sid in scenarios}
    ax.set_xticklabels([_scenario_label(first[s]) for s in scenarios], fontsize=8)
    ax.set_ylabel("speedup (log)")
    failed = summarize([r for r in shown if r["status"] != "passed"])["by_status"]
    ax.set_title(f"{target}" + (f"  —  {status_counts(failed)}" if failed else ""), loc="left", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.25)
    handles = [Patch(facecolor=colors[c], edgecolor="black", label=c) for c in cands]
    if any(_passed_speedup(r) and not r.get("significant") for r in shown):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="not significant"))
    if failed:
        handles.append(
            Line2D([], [], marker="X", color=FAILED_COLOR, ls="none", ms=9, label="not passed (status in its slot)")
        )
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    note = skipped_note(trows)
    if note:
        ax.text(0.0, -0.3, note, transform=ax.transAxes, fontsize=7, va="top", ha="left", color="#666666", gid="note")


def speedup_plot(rows: list[dict], out: Path, title: str = TITLE) -> Path:
    """Grouped bars of speedup (baseline median ms / candidate median ms) per scenario (x)
    and candidate (colour, :func:`~kb_nano.tracking.plot_style.provider_colors`), one panel
    per target with a row that ran, log y axis, dashed line at 1.0 (bars start at 1.0: up
    = faster). Whiskers are the 95% rerun interval (``speedup_ci_low`` ..
    ``speedup_ci_high``); a bar whose row is not ``significant`` (the interval includes
    1.0, or there is none) is hatched. Rows with a failure status get a shaded slot, a red
    ✗ and the status; skipped rows are named under their panel, not drawn. Writes a
    PNG to ``out`` (parent created) and returns it."""
    return save(speedup_figure(rows, title), out)
