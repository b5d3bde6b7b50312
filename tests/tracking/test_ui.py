"""``kb_nano mlflow-ui``'s server (kb_nano.tracking.ui): the URL host of a bind address,
and the one-line errors before it serves: a port in use, a server that exits at once.
Serving and Ctrl-C: tests/tracking/test_history.py (test_mlflow_ui_serves_the_runs_on_loopback)."""

from __future__ import annotations

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
