"""Shared look of the kernel plots (:mod:`kb_nano.tracking.plots`,
:mod:`kb_nano.tracking.perf_plots`): the Agg figure factory (no pyplot global state), the
colours, readable log-axis ticks, and how a row's scenario shape is named.

Colours are keyed by provider name: the baseline is always :data:`BASELINE_COLOR`, and
the candidates that ran (at least one row not ``skipped``) take :data:`PALETTE` in the
order of their sorted ids over the whole result set, so a candidate keeps its colour in
every panel and every plot of a result set, and no two candidates share one (up to
``len(PALETTE)`` candidates; more reuse it from the start). Candidates that only have
skipped rows get no colour: no plot draws them.
"""

from __future__ import annotations

import math
from pathlib import Path

FAILED_COLOR = "#d62728"
SKIPPED_COLOR = "#8c8c8c"
BASELINE_COLOR = "#555555"
BASELINE = "baseline"
# matplotlib's tab10 then tab20's light tones, less red (failures) and grey (baseline, skipped)
PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#9edae5",
    "#dbdb8d",
]
MAX_WIDTH_IN = 30.0


def figure(width: float, height: float):
    """A matplotlib ``Figure`` of ``width`` × ``height`` inches at 100 dpi on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save(fig, out: Path) -> Path:
    """Write ``fig`` as a PNG to ``out`` (parent created); returns ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def message_figure(text: str):
    """A small figure holding only ``text`` (no axes): what a plot shows when no row fits."""
    fig = figure(8, 3)
    fig.text(0.5, 0.5, text, ha="center", va="center")
    return fig


def human(v: float) -> str:
    """``v`` with a k/M/G/T suffix: 1500 -> ``1.5k``."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:g}{unit}"
    return f"{v:g}"


def log_axis(axis, suffix: str = "", subs=(1.0, 2.0, 5.0)) -> None:
    """Readable log-axis ticks (0.5x 1x 2x; 1k 1M) instead of 10^n notation; only decades
    when the axis spans more than 2.5 of them. Call after the limits are final."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    if lo > 0 and math.log10(hi / lo) > 2.5:
        subs = (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{human(v)}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def ran(rows: list[dict]) -> list[dict]:
    """The rows that are not ``skipped`` (measured, passed or failed)."""
    return [r for r in rows if r["status"] != "skipped"]


def widen_log_limits(axis, factor: float = 4.0) -> tuple[float, float]:
    """Widen a log axis spanning less than ``factor`` to ``factor`` around its geometric
    middle, so that its ticks have labels; returns the final ``(low, high)``."""
    lo, hi = sorted(axis.get_view_interval())
    if lo > 0 and hi / lo < factor:
        mid = math.sqrt(lo * hi)
        lo, hi = mid / math.sqrt(factor), mid * math.sqrt(factor)
        axis.set_view_interval(lo, hi, ignore=True)
    return lo, hi


def provider_colors(rows: list[dict]) -> dict[str, str]:
    """``{provider: colour}``: :data:`BASELINE` -> :data:`BASELINE_COLOR`, and the
    candidates with a row that is not skipped (sorted ids, all targets together) ->
    :data:`PALETTE` in order."""
    cands = sorted({r["candidate"] for r in ran(rows)})
    return {BASELINE: BASELINE_COLOR, **{c: PALETTE[i % len(PALETTE)] for i, c in enumerate(cands)}}


def variant_of(row: dict) -> str:
    """The operator variant of a row's scenario (e.g. ``ctx1024``; ``""`` for none): the
    row's ``variant`` field when it has one, else the scenario id's fifth ``__`` part
    (``attention__llama31-8b__tp1__n8__ctx1024``)."""
    if row.get("variant"):
        return str(row["variant"])
    parts = str(row.get("scenario_id") or "").split("__")
    return parts[4] if len(parts) > 4 else ""


def shape_label(row: dict) -> str:
    """A scenario's shape within its operator, model and TP: ``n64`` or ``n64 ctx1024``."""
    variant = variant_of(row)
    return f"n{row['num_tokens']}" + (f" {variant}" if variant else "")


def short_name(candidate: str) -> str:
    """A candidate id without its target: ``rms_norm/torch_fused`` -> ``torch_fused``."""
    return candidate.split("/", 1)[-1]


def annotate_points(
    ax, points: dict[tuple[float, str], float], fontsize: float = 6.0, draw: bool = True
) -> list[tuple[float, str]]:
    """Label points ``{(x, text): y}`` (data coordinates) with ``text`` beside each,
    without overlap: a label goes right of its point, else left, moved up or down in
    steps of one text line (nearest first) while it would overlap one already placed or
    leave the axes (an estimate from the font size in pixels; call after the axes limits
    and the layout are final); a moved label gets a thin leader line to its point.
    Returns the ``(x, text)`` keys that found no free place (not drawn), for the caller
    to list elsewhere; with ``draw=False`` only that (nothing is drawn)."""
    fig = ax.get_figure()
    px = fontsize * fig.dpi / 72.0  # pixels per point of font size
    frame = ax.get_window_extent()
    placed: list[tuple[float, float, float, float]] = []  # x0, y0, x1, y1 in pixels
    markers = [
        (mx - 4, my - 4, mx + 4, my + 4)
        for ln in ax.get_lines()
        if ln.get_marker() not in (None, "", "None")
        for mx, my in ax.transData.transform(ln.get_xydata())
    ]
    left_over = []
    steps = [0] + [s * k for k in range(1, 40) for s in (1, -1)]
    for (x, text), y in sorted(points.items(), key=lambda kv: (kv[0][0], kv[1])):
        x0, y0 = ax.transData.transform((x, y))
        w, h = 0.62 * px * len(text), 1.25 * px
        spot = None
        for k in steps:
            for dx in (0.5 * px + 6.0, -(0.5 * px + 6.0) - w):  # clear of a marker of 8 points
                box = (x0 + dx, y0 + k * h - h / 2, x0 + dx + w, y0 + k * h + h / 2)
                inside = frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and box[3] <= frame.y1
                if inside and not any(
                    b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3] for b in placed + markers
                ):
                    spot = (dx, k * h, box)
                    break
            if spot:
                break
        if spot is None:
            left_over.append((x, text))
            continue
        dx, dy, box = spot
        placed.append(box)
        if not draw:
            continue
        ax.annotate(
            text,
            (x, y),
            xytext=(dx, dy),
            textcoords="offset pixels",
            ha="left",
            va="center",
            fontsize=fontsize,
            color="#333333",
            gid="point_label",
            arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "#999999"} if dy else None,
        )
    return left_over
