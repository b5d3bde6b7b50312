"""``kb_nano history`` and ``kb_nano mlflow-ui``: the MLflow record."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from kb_nano import operators
from kb_nano.cli.config import base_config
from kb_nano.cli.snakemake import interrupts, on_parent_death, stop_group
from kb_nano.errors import KbNanoError
from kb_nano.paths import find_workflow_root


def _tracking_uri(args) -> tuple[Path, str]:
    """Workflow root and tracking URI: ``--tracking-uri`` > $MLFLOW_TRACKING_URI > config
    ``mlflow_tracking_uri`` > ``results/mlflow.db``."""
    from kb_nano.tracking import resolve_tracking_uri

    root = find_workflow_root()
    return root, resolve_tracking_uri(root, base_config(root, args.configfile), explicit=args.tracking_uri)


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


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _print_experiment_urls(url: str) -> None:
    """Print the runs page of each kb-nano experiment, in the UI's machine-learning layout
    (the runs table; MLflow 3 opens on its GenAI layout unless the URL asks otherwise)."""
    import urllib.request

    from kb_nano.tracking import UI_WORKFLOW_QUERY

    try:
        with urllib.request.urlopen(f"{url}api/2.0/mlflow/experiments/search?max_results=100", timeout=10) as resp:
            experiments = json.load(resp).get("experiments", [])
    except (OSError, ValueError):
        return
    for exp in experiments:
        if exp["name"].startswith("kb_nano/"):
            print(
                f"  {exp['name']} runs: {url}#/experiments/{exp['experiment_id']}/runs?{UI_WORKFLOW_QUERY}", flush=True
            )


def cmd_mlflow_ui(args, passthrough: list[str]) -> int:
    """``kb_nano mlflow-ui``: run ``mlflow ui`` on the kb-nano store (loopback by default),
    print its URL once it answers, and serve until Ctrl-C. Arguments after ``--`` go to
    ``mlflow ui`` (e.g. ``--allowed-hosts``). Raises ``KbNanoError`` if the port is taken
    or the server does not come up within ``--start-timeout`` seconds."""
    import socket

    from kb_nano.tracking import artifact_root, check_reachable, is_server, sqlite_path

    _, uri = _tracking_uri(args)
    if is_server(uri):
        check_reachable(uri)
        print(f"MLflow UI: {uri.rstrip('/')}/ (served by the tracking server itself; nothing to start)")
        return 0
    url = f"http://{_url_host(args.host)}:{args.port}/"
    with (
        contextlib.suppress(OSError),
        socket.create_connection((_url_host(args.host).strip("[]"), args.port), timeout=1),
    ):
        raise KbNanoError(f"port {args.port} on {args.host} is already in use; pick another with --port")
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--workers",
        str(args.workers),
    ]
    art = artifact_root(uri)
    if art is not None:
        cmd += ["--artifacts-destination", str(art)]
    cmd += passthrough
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: the MLflow UI has no authentication; anyone who can reach {args.host}:{args.port} "
            f"can read and delete runs",
            file=sys.stderr,
        )
    # its own process group: a Ctrl-C reaches kb_nano alone, which stops the server with
    # SIGTERM (the server's own SIGINT handling prints KeyboardInterrupt tracebacks)
    proc = subprocess.Popen(cmd, process_group=0, preexec_fn=on_parent_death(signal.SIGTERM))

    try:
        with interrupts((signal.SIGINT, signal.SIGTERM)):  # SIGTERM too: stop the server (see finally)
            return _serve(proc, url, uri, args.start_timeout)
    except KeyboardInterrupt:
        return 0
    finally:
        stop_group(proc, signal.SIGTERM, 15, signal.SIGKILL)  # the group: `mlflow ui` runs uvicorn as a child


def _serve(proc, url: str, uri: str, start_timeout: float) -> int:
    """Wait for the server to answer, print its URLs, then wait for it to end."""
    import urllib.request

    deadline = time.monotonic() + start_timeout
    while True:
        if proc.poll() is not None:
            raise KbNanoError(f"mlflow ui exited with status {proc.returncode} before serving; see its messages above")
        try:
            with urllib.request.urlopen(url + "health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise KbNanoError(f"mlflow ui did not answer on {url} within {start_timeout:.0f} s")
        time.sleep(0.5)
    print(f"MLflow UI: {url}  (store: {uri}; Ctrl-C stops it)", flush=True)
    _print_experiment_urls(url)
    return proc.wait()
