"""The MLflow UI on the kb-nano store (``kb_nano mlflow-ui``): ``mlflow ui`` started in a
process group of its own, its URL and each kb-nano experiment's runs page printed once it
answers, and stopped with kb_nano (Ctrl-C, SIGTERM, or kb_nano's death)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from kb_nano.errors import KbNanoError
from kb_nano.interrupts import interrupts, on_parent_death, stop_group
from kb_nano.tracking.store import UI_WORKFLOW_QUERY, artifact_root, check_reachable, is_server, sqlite_path
from kb_nano.tracking.ui_view import VIEW_QUERY

LOOPBACK = ("127.0.0.1", "localhost", "::1")
STOP_GRACE_S = 15  # after SIGTERM to the server's group, before SIGKILL


def url_host(host: str) -> str:
    """The host part of a URL to a server bound to ``host``: loopback for the wildcard
    addresses (``0.0.0.0``, ``::``, empty), an IPv6 address in brackets."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def runs_page_url(url: str, experiment_id: str) -> str:
    """The runs page of an experiment in the UI at ``url`` (ending in ``/``): the
    kb-nano view's columns (:mod:`kb_nano.tracking.ui_view`) in the machine-learning
    layout (MLflow 3.17 otherwise opens on its GenAI layout)."""
    return f"{url}#/experiments/{experiment_id}/runs?{VIEW_QUERY}&{UI_WORKFLOW_QUERY}"


def run_page_url(url: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the UI at ``url`` (ending in ``/``), in the machine-learning layout."""
    return f"{url}#/experiments/{experiment_id}/runs/{run_id}?{UI_WORKFLOW_QUERY}"


def _api(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=10) as resp:
        return json.load(resp)


def print_experiment_urls(url: str) -> None:
    """Print, for each kb-nano experiment of the UI at ``url`` (ending in ``/``), its
    runs page (:func:`runs_page_url`) and the page of its newest finished run
    (:func:`run_page_url`). Prints nothing more when the server's REST API does not
    answer within 10 s or answers with something other than JSON."""
    try:
        experiments = _api(url, "api/2.0/mlflow/experiments/search?max_results=100").get("experiments", [])
        for exp in experiments:
            if not exp["name"].startswith("kb_nano/"):
                continue
            print(f"  {exp['name']} runs: {runs_page_url(url, exp['experiment_id'])}", flush=True)
            query = {
                "experiment_ids": [exp["experiment_id"]],
                "filter": "attributes.status = 'FINISHED'",
                "max_results": 1,
                "order_by": ["attributes.start_time DESC"],
            }
            for run in _api(url, "api/2.0/mlflow/runs/search", query).get("runs", []):
                info = run["info"]
                page = run_page_url(url, exp["experiment_id"], info["run_id"])
                print(f"  {exp['name']} newest run {info.get('run_name') or info['run_id']}: {page}", flush=True)
    except (OSError, ValueError, KeyError):
        return


def serve_ui(
    uri: str, host: str, port: int, workers: int = 1, start_timeout: float = 120.0, mlflow_args: list[str] = ()
) -> int:
    """Serve the MLflow UI on the store ``uri`` at ``host``:``port`` until Ctrl-C (or
    SIGTERM) and return the exit status for kb_nano: 0 after an interrupt, else the
    server's own. A tracking server (``http(s)://`` URI) is checked and named instead:
    it serves its UI itself. ``workers``: the server's worker processes; ``mlflow_args``:
    more arguments of ``mlflow ui`` (e.g. ``--allowed-hosts``). Warns on stderr when
    ``host`` is not loopback (the UI has no authentication). Raises ``KbNanoError`` when
    the port is taken, when the server exits or does not answer within ``start_timeout``
    seconds, or when a tracking server does not answer."""
    if is_server(uri):
        check_reachable(uri)
        print(f"MLflow UI: {uri.rstrip('/')}/ (served by the tracking server itself; nothing to start)")
        return 0
    url = f"http://{url_host(host)}:{port}/"
    with contextlib.suppress(OSError), socket.create_connection((url_host(host).strip("[]"), port), timeout=1):
        raise KbNanoError(f"port {port} on {host} is already in use; pick another with --port")
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    cmd += ["--workers", str(workers)]
    art = artifact_root(uri)
    if art is not None:
        cmd += ["--artifacts-destination", str(art)]
    cmd += list(mlflow_args)
    if host not in LOOPBACK:
        print(
            f"warning: the MLflow UI has no authentication; anyone who can reach {host}:{port} "
            f"can read and delete runs",
            file=sys.stderr,
        )
    # its own process group: a Ctrl-C reaches kb_nano alone, which stops the server with
    # SIGTERM (the server's own SIGINT handling prints KeyboardInterrupt tracebacks)
    proc = subprocess.Popen(cmd, process_group=0, preexec_fn=on_parent_death(signal.SIGTERM))
    try:
        with interrupts((signal.SIGINT, signal.SIGTERM)):  # SIGTERM too: stop the server (see finally)
            return _serve(proc, url, uri, start_timeout)
    except KeyboardInterrupt:
        return 0
    finally:
        stop_group(proc, signal.SIGTERM, STOP_GRACE_S, signal.SIGKILL)  # the group: `mlflow ui` runs uvicorn as a child


def _serve(proc: subprocess.Popen, url: str, uri: str, start_timeout: float) -> int:
    """Wait for the server to answer, print its URLs, then wait for it to end."""
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
    print_experiment_urls(url)
    return proc.wait()
