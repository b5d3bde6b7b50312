"""Shared look of the kernel plots (:mod:`kb_nano.tracking.plots`,
:mod:`kb_nano.tracking.perf_plots`): the Agg figure factory (no pyplot global state), the
colours, readable log-axis ticks, and how a row's scenario shape is named.

Colours are keyed by provider name: the baseline is always :data:`BASELINE_COLOR`, and
the candidates of one target take :data:`PALETTE` in the order of their sorted names, so
a candidate keeps its colour in every panel and every plot of a result set, and two
candidates of one target never share a colour (up to ``len(PALETTE)`` per target).
"""

from __future__ import annotations

import math
from pathlib import Path

FAILED_COLOR = "#d62728"
SKIPPED_COLOR = "#8c8c8c"
BASELINE_COLOR = "#555555"
BASELINE = "baseline"
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
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


def provider_colors(rows: list[dict]) -> dict[str, str]:
    """``{provider: colour}``: :data:`BASELINE` -> :data:`BASELINE_COLOR`, and per target
    its candidates (sorted ids) -> :data:`PALETTE` in order."""
    colors = {BASELINE: BASELINE_COLOR}
    for target in sorted({r["target"] for r in rows}):
        cands = sorted({r["candidate"] for r in rows if r["target"] == target})
        colors.update({c: PALETTE[i % len(PALETTE)] for i, c in enumerate(cands)})
    return colors


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


def annotate_points(ax, points: dict[tuple[float, str], float], fontsize: float = 6.0) -> None:
    """Label points ``{(x, text): y}`` (data coordinates) with ``text`` just right of each,
    moving a label up in steps of one text line while it would overlap one already placed
    (an estimate from the font size in pixels; call after the axes limits are final), and
    drawing a thin leader line to its point when moved."""
    fig = ax.get_figure()
    px = fontsize * fig.dpi / 72.0  # pixels per point of font size
    placed: list[tuple[float, float, float, float]] = []  # x0, y0, x1, y1 in pixels
    for (x, text), y in sorted(points.items(), key=lambda kv: (kv[0][0], kv[1])):
        x0, y0 = ax.transData.transform((x, y))
        w, h = 0.62 * px * len(text), 1.25 * px
        dx, dy = 0.5 * px + 6.0, 0.0  # clear of a marker of 8 points
        for _ in range(12):
            box = (x0 + dx, y0 + dy - h / 2, x0 + dx + w, y0 + dy + h / 2)
            if not any(b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3] for b in placed):
                break
            dy += h
        placed.append(box)
        ax.annotate(
            text,
            (x, y),
            xytext=(dx, dy),
            textcoords="offset pixels",
            ha="left",
            va="center",
            fontsize=fontsize,
            color="#333333",
            arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "#999999"} if dy else None,
        )
