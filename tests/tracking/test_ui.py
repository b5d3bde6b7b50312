"""``kb_nano mlflow-ui``'s server (kb_nano.tracking.ui): the URL host of a bind address,
and the one-line errors before it serves: a port in use, a server that exits at once; the
kb-nano view of each experiment's runs table (kb_nano.tracking.ui_view).
Serving and Ctrl-C: tests/tracking/test_history.py (test_mlflow_ui_serves_the_runs_on_loopback)."""

from __future__ import annotations

import json
import socket

import pytest
from tracking_helpers import free_port

from kb_nano import tracking
from kb_nano.cli import main
from kb_nano.errors import KbNanoError
from kb_nano.tracking.ui import serve_ui, url_host


def test_url_host_of_bind_addresses():
    assert url_host("0.0.0.0") == url_host("::") == url_host("") == "127.0.0.1"
    assert url_host("::1") == "[::1]"
    assert url_host("localhost") == "localhost"


def test_a_port_in_use_is_a_one_line_error(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        uri = tracking.default_tracking_uri(tmp_path)
        assert main(["mlflow-ui", "--tracking-uri", uri, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: port {port} on 127.0.0.1 is already in use; pick another with --port\n"
    assert not (tmp_path / "results").exists()  # nothing started, no store created


def test_a_server_that_exits_before_serving_is_a_one_line_error(tmp_path):
    """``mlflow ui`` refusing an argument passed after ``--`` exits at once: a KbNanoError
    naming its status (its own message is above it), the store directory made for it."""
    uri = tracking.default_tracking_uri(tmp_path)
    with pytest.raises(KbNanoError, match=r"^mlflow ui exited with status 2 before serving; see its messages above$"):
        serve_ui(uri, "127.0.0.1", free_port(), start_timeout=60, mlflow_args=["--no-such-option"])
    assert (tmp_path / "results").is_dir()


def test_every_experiment_has_the_kb_nano_view_of_its_summary_columns(tmp_path):
    """The runs-table view the printed URL opens: an experiment tag in the envelope the
    MLflow UI reads (name, createdAt, a JSON state), whose columns are all the logged
    run's params and metrics; kept as is by the next log, brought up to date when stale."""
    from tracking_helpers import result_set, row

    from kb_nano.tracking.ui_view import VIEW_NAME, VIEW_TAG

    uri = tracking.default_tracking_uri(tmp_path)
    rows = [row("rms_norm", "torch_fused", speedup=1.2), row("rms_norm", "triton_rowwise", status="skipped")]
    rec = tracking.log_kernels(**result_set(tmp_path / "a", rows), tracking_uri=uri)
    c = tracking.client(uri)
    run = c.get_run(rec["run_id"])
    tag = c.get_experiment(rec["experiment_id"]).tags[VIEW_TAG]
    view = json.loads(tag)
    assert view["name"] == VIEW_NAME and isinstance(view["createdAt"], int)
    columns = json.loads(view["state"])["selectedColumns"]
    assert "metrics.`geomean_speedup`" in columns and "params.`git_sha`" in columns
    logged = {f"metrics.`{k}`" for k in run.data.metrics} | {f"params.`{k}`" for k in run.data.params}
    assert set(columns) <= logged

    again = [row("rms_norm", "torch_fused", speedup=1.3)]
    tracking.log_kernels(**result_set(tmp_path / "b", again), tracking_uri=uri)
    assert c.get_experiment(rec["experiment_id"]).tags[VIEW_TAG] == tag  # unchanged: not rewritten

    stale = json.dumps(view | {"state": json.dumps({"selectedColumns": ["metrics.`rows`"]})})
    c.set_experiment_tag(rec["experiment_id"], VIEW_TAG, stale)
    tracking.log_kernels(**result_set(tmp_path / "c", rows[:1]), tracking_uri=uri)
    fixed = json.loads(c.get_experiment(rec["experiment_id"]).tags[VIEW_TAG])
    assert json.loads(fixed["state"])["selectedColumns"] == columns and fixed["createdAt"] == view["createdAt"]
