"""What ``kb_nano kernels`` says around its workflow run: the notes on the selection before
it (:func:`selection_notes`: candidate id prefixes, settings a CPU run ignores; the job
directories checked), the check of ``--versus`` (:func:`check_versus`), and the merged
results printed after it (:func:`show_results`: the table of :mod:`kb_nano.kernels.table`
or the providers side by side of :mod:`kb_nano.kernels.providers`). Not a kernel job's
module: editing it reruns no job."""

from __future__ import annotations

import sys
from pathlib import Path

from kb_nano import workflow as kbw
from kb_nano.errors import KbNanoError, did_you_mean
from kb_nano.files import check_dirs


def selection_notes(root: Path, effective: dict) -> None:
    """Before the run of the effective config ``effective``: a note on stderr for each
    ``candidates`` value that is an id prefix (as ``--model`` does), the job directories
    checked (:func:`kb_nano.files.check_dirs`), and a note naming the settings that change
    nothing on a CPU run (:func:`kb_nano.workflow.cpu_ignored`). Raises ``KbNanoError``."""
    chosen = kbw.candidates(root, effective)
    for want in effective["candidates"]:
        hits = [c.id for c in chosen if c.id.startswith(want)]
        if want not in hits:
            print(f"note: --candidate {want} selects {', '.join(hits)} (id prefix)", file=sys.stderr)
    check_dirs(root, kbw.kernel_job_dirs(chosen, effective))
    ignored = kbw.cpu_ignored(root, effective)
    if ignored:
        print(
            f"note: {', '.join(ignored)} change nothing on a CPU run (a CPU has the eager timer only; rows "
            "say speedup_basis=eager)",
            file=sys.stderr,
        )


def check_versus(root: Path, versus: str | None) -> None:
    """Raise ``KbNanoError`` before the sweep, not after it, when ``--versus`` names no
    candidate file ``candidates/{versus}.py``."""
    if versus and not (root / "candidates" / f"{versus}.py").is_file():
        from kb_nano.candidates import discover

        ids = [c.id for c in discover(root)]
        raise KbNanoError(f"--versus {versus}: no candidate file candidates/{versus}.py{did_you_mean(versus, ids)}")


def show_results(
    doc: dict, started_at: str, *, all_rows: bool, by_scenario: bool, versus: str | None, fail_on_error: bool
) -> int:
    """Print the merged results document ``doc`` (``rows``, ``summary``): providers side by
    side with ``by_scenario`` or ``versus``, else the kernel table of the rows measured
    since ``started_at`` (:func:`kb_nano.kernels.table.measured_since`; every row with
    ``all_rows``); then the load warning, if any, on stderr. Returns 1 when
    ``fail_on_error`` and a row is neither passed nor skipped, else 0. Raises
    ``KbNanoError`` for a ``versus`` candidate without rows in this selection."""
    from kb_nano.kernels.providers import print_providers
    from kb_nano.kernels.table import load_warning, measured_since, print_kernels

    if by_scenario or versus:
        try:
            print_providers(doc["rows"], versus)
        except ValueError as exc:
            raise KbNanoError(str(exc)) from None
    else:
        shown = None if all_rows else measured_since(doc["rows"], started_at)
        print_kernels(doc["rows"], doc["summary"], shown=shown)
    loaded = load_warning(doc["rows"])
    if loaded:
        print(loaded, file=sys.stderr)
    failed = [r for r in doc["rows"] if r["status"] not in ("passed", "skipped")]
    if fail_on_error and failed:
        print(f"error: {len(failed)} row(s) neither passed nor skipped (--fail-on-error)", file=sys.stderr)
        return 1
    return 0
