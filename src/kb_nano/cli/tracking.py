"""``kb_nano history`` and ``kb_nano mlflow-ui``: the MLflow record."""

from __future__ import annotations

from pathlib import Path

from kb_nano import operators
from kb_nano.config import load
from kb_nano.errors import KbNanoError
from kb_nano.paths import find_workflow_root


def _tracking_uri(args) -> tuple[Path, str]:
    """Workflow root and tracking URI: ``--tracking-uri`` > $MLFLOW_TRACKING_URI > config
    ``mlflow_tracking_uri`` > ``results/mlflow.db``."""
    from kb_nano.tracking import resolve_tracking_uri

    root = find_workflow_root()
    return root, resolve_tracking_uri(root, load(root, args.configfile), explicit=args.tracking_uri)


def cmd_history(args, passthrough: list[str]) -> int:
    """``kb_nano history``: recorded runs as a table, or ``--compare RUN_A RUN_B``: the
    rows both runs have with their speedup changes and whether each is significant, the
    rows only one has, and a summary line; read through the MLflow client. Tables fit
    the console's width. A store MLflow cannot read (e.g. a corrupt SQLite file) is a
    one-line error."""
    try:
        return _history(args, passthrough)
    except KbNanoError:
        raise
    except Exception as exc:
        if not type(exc).__module__.startswith(("sqlalchemy", "mlflow", "sqlite3", "alembic")):
            raise
        _, uri = _tracking_uri(args)
        raise KbNanoError(
            f"the MLflow store {uri} cannot be read ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:160]}); move it away or point --tracking-uri elsewhere"
        ) from None


def _history(args, passthrough: list[str]) -> int:
    from kb_nano.console import make_console
    from kb_nano.tracking import history
    from kb_nano.tracking import history_tables as tables

    if passthrough:
        raise KbNanoError(f"history takes no arguments after -- (got {' '.join(passthrough)})")
    if args.target:
        operators.check_target(args.target, where="--target")
    _, uri = _tracking_uri(args)
    console = make_console()
    if args.compare:
        result = history.compare_runs(uri, *args.compare)
        console.print(tables.compare_table(result, width=console.width))
        only = tables.only_table(result, width=console.width)
        if only is not None:
            console.print(only)
        console.print(history.compare_summary(result))
        return 0
    runs = history.list_runs(
        uri, tier=args.tier, target=args.target, candidate=args.candidate, model=args.model, limit=args.limit
    )
    filters = ", ".join(
        f"{k} {v}"
        for k, v in (("tier", args.tier), ("target", args.target), ("candidate", args.candidate), ("model", args.model))
        if v
    )
    if not runs:
        print(f"no kb-nano runs{' matching ' + filters if filters else ''} in {uri}")
        return 0
    title = "kb-nano history" + (f" ({filters})" if filters else "")
    console.print(tables.history_table(runs, title=title, width=console.width))
    print(f"store: {uri}")
    return 0


def cmd_mlflow_ui(args, passthrough: list[str]) -> int:
    """``kb_nano mlflow-ui``: serve the MLflow UI on the kb-nano store (loopback by
    default) until Ctrl-C (:func:`kb_nano.tracking.ui.serve_ui`). Arguments after ``--``
    go to ``mlflow ui`` (e.g. ``--allowed-hosts``). Raises ``KbNanoError`` if the port is
    taken or the server does not come up within ``--start-timeout`` seconds."""
    from kb_nano.tracking.ui import serve_ui

    _, uri = _tracking_uri(args)
    return serve_ui(uri, args.host, args.port, args.workers, args.start_timeout, passthrough)
