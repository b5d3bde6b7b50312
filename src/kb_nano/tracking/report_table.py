"""The merged kernel rows as one self-contained HTML table (``results/kernels_table.html``),
the table ``snakemake --report`` shows next to the plots and MLflow keeps with the run.

Main columns only (:data:`TABLE_COLUMNS`); every column stays in ``results/kernels.parquet``.
Times are milliseconds (median per call), GB/s is ``bytes_moved`` / candidate median time,
the interval is the 95% rerun interval of the speedup. Rows are ordered by target level,
target, model, TP, variant, num_tokens and candidate; a row that did not pass is shaded
and shows the first line of its error, cut at a word boundary after
:data:`MAX_NOTE_CHARS` with an ellipsis (the whole error in the cell's ``title``, shown on
hover). The summary counts rows by status, in the words the CLI uses.
"""

from __future__ import annotations

import html
from pathlib import Path

from kb_nano.kernels.merge import status_counts, summarize
from kb_nano.tracking.plot_style import variant_of

TABLE_COLUMNS = (
    "target",
    "model",
    "tp",
    "num_tokens",
    "variant",
    "candidate",
    "status",
    "baseline ms",
    "candidate ms",
    "speedup",
    "95% interval",
    "significant",
    "candidate GB/s",
    "device",
    "dtype",
    "note",
)
MAX_NOTE_CHARS = 160

_STYLE = """
body { font-family: sans-serif; font-size: 13px; margin: 12px; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 2px 6px; white-space: nowrap; }
th { background: #eee; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.not_passed td { background: #fde8e8; }
tr.skipped td { color: #888; }
td.note { white-space: normal; max-width: 32em; font-size: 11px; }
"""


def _num(v, fmt: str) -> str:
    return "" if v is None or v != v else format(v, fmt)


def table_cells(r: dict) -> list[str]:
    """The :data:`TABLE_COLUMNS` of one row as plain text (unescaped), the note in full."""
    ms = r.get("candidate_ms")
    gbs = r["bytes_moved"] / (ms * 1e-3) / 1e9 if r.get("bytes_moved") and ms and ms > 0 else None
    lo, hi = r.get("speedup_ci_low"), r.get("speedup_ci_high")
    sig = r.get("significant")
    notes = []
    if r["status"] != "passed":
        notes += (r.get("error") or "").strip().splitlines()[:1]
    if r.get("review"):
        notes.append(f"review: {r['review']}")
    note = "; ".join(notes)
    return [
        r["target"],
        r["model"],
        str(r["tp"]),
        str(r["num_tokens"]),
        variant_of(r),
        r["candidate"],
        r["status"],
        _num(r.get("baseline_ms"), ".4f"),
        _num(ms, ".4f"),
        _num(r.get("speedup"), ".3f"),
        f"{lo:.3f} .. {hi:.3f}" if lo is not None and hi is not None else "",
        "" if sig is None else ("yes" if sig else "no"),
        _num(gbs, ".2f"),
        r.get("device_name") or r.get("device") or "",
        r.get("dtype") or "",
        note,
    ]


def shorten(text: str, limit: int = MAX_NOTE_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis
    (``…``) when cut; a first word longer than ``limit`` is cut inside it."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    head = cut.rsplit(" ", 1)[0] if " " in cut else cut
    return head.rstrip(" ;,:") + "…"


def _order(r: dict) -> tuple:
    v = variant_of(r)
    return (r.get("level") or 0, r["target"], r["model"], r["tp"], len(v), v, r["num_tokens"], r["candidate"])


def kernels_table_html(rows: list[dict], title: str = "kb-nano kernels: merged results") -> str:
    """A complete HTML page with one table row per kernel row and a one-line summary."""
    numeric = {"tp", "num_tokens", "baseline ms", "candidate ms", "speedup", "candidate GB/s"}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    body = []
    for r in sorted(rows, key=_order):
        cls = "" if r["status"] == "passed" else ("skipped" if r["status"] == "skipped" else "not_passed")
        cells = []
        for col, text in zip(TABLE_COLUMNS, table_cells(r)):
            kind = "num" if col in numeric else ("note" if col == "note" else "")
            attr = f' class="{kind}"' if kind else ""
            if col == "note" and shorten(text) != text:
                attr += f' title="{html.escape(text)}"'
                text = shorten(text)
            cells.append(f"<td{attr}>{html.escape(text)}</td>")
        attr = f' class="{cls}"' if cls else ""
        body.append(f"<tr{attr}>" + "".join(cells) + "</tr>")
    summary = f"{len(rows)} rows: {status_counts(summarize(rows)['by_status'])}"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h3>{html.escape(title)}</h3><p>{html.escape(summary)}; times in ms (median per call), "
        "GB/s = bytes_moved / candidate median time.</p>\n"
        f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table></body></html>\n"
    )


def write_kernels_table(rows: list[dict], out: Path) -> Path:
    """Write :func:`kernels_table_html` of ``rows`` to ``out`` (parent created); returns it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(kernels_table_html(rows), encoding="utf-8")
    return out
