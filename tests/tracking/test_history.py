"""``kb_nano history`` (kb_nano.tracking.history + the CLI): listing with filters, --compare, and
``kb_nano mlflow-ui`` serving the store over HTTP on loopback. Real MLflow throughout."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from tracking_helpers import free_port, result_set, row, stop, table_headers, wait_http

from kb_nano import tracking
from kb_nano.cli import main
from kb_nano.errors import KbNanoError
from kb_nano.tracking import history


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three logged runs: A (rms_norm, llama31), B (silu_and_mul, qwen3), C (rms_norm,
    llama31, one scenario faster, one now failing)."""
    tmp = tmp_path_factory.mktemp("history")
    uri = tracking.default_tracking_uri(tmp)
    sets = {
        "A": [row("rms_norm", "torch_fused", speedup=1.0), row("rms_norm", "torch_fused", n=64, speedup=2.0)],
        "B": [row("silu_and_mul", "inplace", model="qwen3-8b", speedup=0.5)],
        "C": [row("rms_norm", "torch_fused", speedup=1.5), row("rms_norm", "torch_fused", n=64, status="incorrect")],
    }
    ids = {}
    for name, rows in sets.items():
        ids[name] = tracking.log_kernels(**result_set(tmp / name, rows), tracking_uri=uri)["run_id"]
        time.sleep(0.02)  # distinct start times
    return uri, ids


def test_list_runs_newest_first_with_summaries(store):
    uri, ids = store
    runs = history.list_runs(uri)
    assert [r["run_id"] for r in runs] == [ids["C"], ids["B"], ids["A"]]
    a = runs[2]
    assert a["tier"] == "kernels" and a["candidates"] == ["rms_norm/torch_fused"]
    assert a["scenarios_run"] == 2 and a["pass_rate"] == 1.0
    assert a["geomean_speedup"] == 1.414  # 2**0.5 as logged: 4 significant digits
    assert a["git_sha"] == "abc123" and a["models"] == ["llama31-8b"]
    assert runs[0]["pass_rate"] == 0.5


def test_list_runs_filters_and_limit(store):
    uri, ids = store
    ids_of = lambda **kw: [r["run_id"] for r in history.list_runs(uri, **kw)]  # noqa: E731
    assert ids_of(target="rms_norm") == [ids["C"], ids["A"]]
    assert ids_of(target="silu_and_mul") == [ids["B"]]
    assert ids_of(candidate="silu_and_mul/") == [ids["B"]]
    assert ids_of(candidate="rms_norm/torch_fused") == [ids["C"], ids["A"]]
    assert ids_of(model="qwen3") == [ids["B"]]
    assert ids_of(model="llama31-8b", limit=1) == [ids["C"]]
    assert ids_of(tier="kernels", limit=2) == [ids["C"], ids["B"]]
    assert ids_of(tier="e2e") == []
    with pytest.raises(KbNanoError, match="--limit"):
        history.list_runs(uri, limit=0)


def test_missing_store_has_no_runs(tmp_path):
    uri = tracking.default_tracking_uri(tmp_path)
    assert history.list_runs(uri) == []
    assert not (tmp_path / "results" / "mlflow.db").exists()  # reading creates nothing


def test_compare_per_scenario_changes(store):
    uri, ids = store
    result = history.compare_runs(uri, ids["A"], ids["C"][:10])
    by = {r["scenario_id"]: r for r in result["rows"]}
    n1, n64 = by["rms_norm__llama31-8b__tp1__n1"], by["rms_norm__llama31-8b__tp1__n64"]
    assert n1["speedup_a"] == pytest.approx(1.0) and n1["speedup_b"] == pytest.approx(1.5)
    assert n1["change"] == pytest.approx(0.5)
    assert (n64["status_a"], n64["status_b"], n64["change"]) == ("passed", "incorrect", None)
    with pytest.raises(KbNanoError, match="no kb-nano run 'feedbeef'"):
        history.compare_runs(uri, ids["A"], "feedbeef")


def test_cli_history_table_and_filters(store, capsys):
    uri, ids = store
    assert main(["history", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    for rid in ids.values():
        assert rid[:12] in out
    assert "rms_norm/torch_fused" in out and "kernels" in out and "abc123" in out
    assert main(["history", "--tracking-uri", uri, "--model", "qwen3", "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert ids["B"][:12] in out and ids["A"][:12] not in out
    assert main(["history", "--tracking-uri", uri, "--candidate", "nothing/here"]) == 0
    assert "no kb-nano runs matching" in capsys.readouterr().out


def test_cli_compare_and_errors(store, capsys):
    uri, ids = store
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"], ids["C"]]) == 0
    out = capsys.readouterr().out
    assert "+50.0%" in out and "incorrect" in out
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"], "0123456789abcdef"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --compare: no kb-nano run") and err.count("\n") == 1
    assert main(["history", "--tracking-uri", uri, "--target", "rmsnorm"]) == 2
    assert "unknown target" in capsys.readouterr().err
    port = free_port()
    assert main(["history", "--tracking-uri", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert "unreachable" in err and err.count("\n") == 1


def _sigint_ignored_and_blocked() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a script's `kb_nano ... &`
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a parent that blocked it


@pytest.mark.slow
@pytest.mark.parametrize("started", ["plainly", "with SIGINT ignored and blocked"])
def test_mlflow_ui_serves_the_runs_on_loopback(store, started):
    """`kb_nano mlflow-ui` starts the UI on the same store, prints the URL, and the REST
    API behind the page lists the logged runs; a Ctrl-C stops it, also when it inherited
    SIGINT ignored or blocked."""
    uri, ids = store
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kb_nano.cli", "mlflow-ui", "--tracking-uri", uri, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_sigint_ignored_and_blocked if "ignored" in started else None,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line.startswith("MLflow UI: "):
                url = line.split()[2]
        assert url == f"http://127.0.0.1:{port}/", f"no URL printed (exit {proc.poll()})"
        wait_http(url + "health", timeout_s=10)
        with urllib.request.urlopen(url, timeout=10) as resp:  # the UI page itself
            assert resp.status == 200 and "html" in resp.headers.get("Content-Type", "")
        with urllib.request.urlopen(
            url + "api/2.0/mlflow/experiments/get-by-name?experiment_name=kb_nano/kernels", timeout=10
        ) as resp:
            exp_id = json.load(resp)["experiment"]["experiment_id"]
        req = urllib.request.Request(
            url + "api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [exp_id], "max_results": 100}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            runs = json.load(resp)["runs"]
        assert {r["info"]["run_id"] for r in runs} == set(ids.values())
        # Ctrl-C in the terminal (SIGINT to the foreground process group): the server stops
        # with kb_nano, quietly
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        time.sleep(1)  # the reader thread drains the pipe
        rest = []
        while not lines.empty():
            rest.append(lines.get_nowait())
        out = "".join(rest)
        assert "Traceback" not in out and "KeyboardInterrupt" not in out and "CancelledError" not in out, out
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "health", timeout=5)
    finally:
        stop(proc)
    assert proc.returncode is not None


def test_compare_with_a_too_short_prefix_says_so(store, capsys):
    from kb_nano.cli import main

    uri, ids = store
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"][:2], ids["C"]]) == 2
    assert "give at least 4 characters" in capsys.readouterr().err


def _ci_row(target: str, n: int, speedup: float | None, ci: tuple | None, status: str = "passed", day: int = 1) -> dict:
    lo, hi = ci or (None, None)
    return row(target, "fast", n=n, status=status, speedup=speedup, speedup_ci_low=lo, speedup_ci_high=hi) | {
        "created_at": f"2026-01-0{day}T00:00:00+00:00"  # when it was measured
    }


@pytest.fixture(scope="module")
def ci_runs(tmp_path_factory):
    """Two real runs with rerun intervals. A -> B: n1 faster (intervals apart), n64 slower
    (apart), n256 changed within overlapping intervals after an edit of the candidate (its
    source hash differs), n1024 passed -> incorrect; silu_and_mul n1 only in A,
    silu_and_mul n64 only in B (both within the other run's selection); n4096 the same
    measurement in both (a reused shard)."""
    tmp = tmp_path_factory.mktemp("history_ci")
    uri = tracking.default_tracking_uri(tmp)
    a = [
        _ci_row("rms_norm", 1, 1.0, (0.95, 1.05)),
        _ci_row("rms_norm", 64, 2.0, (1.9, 2.1)),
        _ci_row("rms_norm", 256, 1.5, (1.2, 1.8)),
        _ci_row("rms_norm", 1024, 1.1, (1.0, 1.2)),
        _ci_row("silu_and_mul", 1, 3.0, (2.9, 3.1)),
        _ci_row("rms_norm", 4096, 1.3, (1.2, 1.4)),
    ]
    b = [
        _ci_row("rms_norm", 1, 1.5, (1.4, 1.6), day=2),
        _ci_row("rms_norm", 64, 1.5, (1.4, 1.6), day=2),
        _ci_row("rms_norm", 256, 1.6, (1.3, 1.9), day=2) | {"candidate_sha256": "1" * 64},  # edited
        _ci_row("rms_norm", 1024, None, None, status="incorrect", day=2),
        _ci_row("silu_and_mul", 64, 0.2, (0.1, 0.3), day=2),
        _ci_row("rms_norm", 4096, 1.3, (1.2, 1.4)),  # measured once, reused by B
    ]
    ids = {}
    for name, rows in (("A", a), ("B", b)):
        ids[name] = tracking.log_kernels(**result_set(tmp / name, rows), tracking_uri=uri)["run_id"]
        time.sleep(0.02)
    return uri, ids


def test_compare_only_rows_in_both_runs_with_significance(ci_runs):
    uri, ids = ci_runs
    result = history.compare_runs(uri, ids["A"], ids["B"])
    by = {r["scenario_id"]: r for r in result["rows"]}
    assert set(by) == {f"rms_norm__llama31-8b__tp1__n{n}" for n in (1, 64, 256, 1024, 4096)}
    sig = {sid.rsplit("__n", 1)[1]: r["significant"] for sid, r in by.items()}
    assert sig == {"1": "faster", "64": "slower", "256": "no", "1024": None, "4096": "no"}
    assert [sid for sid, r in by.items() if r["same_measurement"]] == ["rms_norm__llama31-8b__tp1__n4096"]
    assert [sid for sid, r in by.items() if r["candidate_changed"]] == ["rms_norm__llama31-8b__tp1__n256"]
    assert by["rms_norm__llama31-8b__tp1__n1"]["ci_b"] == pytest.approx((1.4, 1.6))
    assert result["rows"][0]["status_b"] == "incorrect"  # status changes first
    assert [r["scenario_id"] for r in result["removed"]] == ["silu_and_mul__llama31-8b__tp1__n1"]
    assert [r["scenario_id"] for r in result["added"]] == ["silu_and_mul__llama31-8b__tp1__n64"]
    assert result["summary"] == {
        "compared": 5,
        "faster": 1,
        "slower": 1,
        "no_interval": 0,
        "status_changed": 1,
        "same_measurement": 1,
        "candidate_changed": 1,
        "added": 1,
        "removed": 1,
        "not_selected_by_a": 0,
        "not_selected_by_b": 0,
    }
    assert history.significance((1.0, 2.0), (2.0, 3.0)) == "no"  # touching intervals overlap
    assert history.significance(None, (2.0, 3.0)) is None


def test_cli_compare_summary_counts_the_same_rows_only(ci_runs, capsys, monkeypatch):
    uri, ids = ci_runs
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"][:8], ids["B"][:8]]) == 0
    out = capsys.readouterr().out
    assert (
        "5 rows in both runs compared: 1 significantly faster, 1 significantly slower (95% rerun intervals "
        "apart), 1 status changes; 1 of them with a changed candidate source (the change reflects the edit); "
        "1 of them the same measurement in both runs (a shard both reused); "
        "1 rows only in B (added), 1 only in A (removed)"
    ) in " ".join(out.split())
    assert "geomean" not in out  # no summary over two different row sets
    compared, only = out.split("rows only one run has")
    assert "silu_and_mul" not in compared and "passed → incorrect" in compared
    assert "1.50x (1.40-1.60)" in compared and "faster" in compared and "slower" in compared
    assert "same row" in compared  # the reused shard is not judged as a change
    edited = [ln for ln in compared.splitlines() if "n256" in ln]
    assert len(edited) == 1 and edited[0].rstrip(" │").endswith("yes")  # the candidate changed column
    assert "candidate changed" in table_headers(out)[0]
    assert "A (removed)" in only and "B (added)" in only


def test_cli_compare_of_runs_without_a_common_row(store, capsys):
    """Runs with no row in common (A: rms_norm on llama31-8b; B: silu_and_mul on qwen3-8b):
    nothing is compared (an empty table, not a crash), and as neither run selected the
    other's rows, none is called added or removed."""
    uri, ids = store
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"], ids["B"]]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 rows in both runs compared: 0 significantly faster, 0 significantly slower" in out
    assert "0 rows only in B (added), 0 only in A (removed)" in out
    assert (
        "2 rows of A not in B's selection (targets silu_and_mul; models qwen3-8b; num_tokens 1; "
        "candidates silu_and_mul/inplace), not compared"
    ) in out
    assert (
        "1 rows of B not in A's selection (targets rms_norm; models llama31-8b; candidates rms_norm/torch_fused)"
    ) in out
    assert "rows only one run has" not in out


def test_compare_tells_a_filtered_rerun_from_removed_rows(tmp_path, capsys, monkeypatch):
    """A: a full sweep (rms_norm and silu_and_mul, n1 and n64, candidates fast and old).
    B: `kb_nano kernels --target rms_norm --num-tokens 1` after candidates/rms_norm/old.py
    was deleted: rms_norm/fast at n1 is measured again, the other rows of A were not
    selected by B, except rms_norm/old at n1, which B selected (every candidate) but no
    longer has."""
    uri = tracking.default_tracking_uri(tmp_path)
    full = [
        _ci_row(target, n, 1.2, (1.1, 1.3)) | {"candidate": f"{target}/{name}"}
        for target in ("rms_norm", "silu_and_mul")
        for n in (1, 64)
        for name in ("fast", "old")
    ]
    rerun = [full[0] | {"created_at": "2026-01-02T00:00:00+00:00", "speedup": 1.3}]  # rms_norm n1 fast
    only_fast = [full[0] | {"created_at": "2026-01-03T00:00:00+00:00", "speedup": 1.4}]  # --candidate rms_norm/fast
    ids = {}
    for name, rows, filt in (("A", full, []), ("B", rerun, []), ("C", only_fast, ["rms_norm/fast"])):
        kwargs = result_set(tmp_path / name, rows)
        kwargs["config"] = {**kwargs["config"], "candidates": filt}  # the config's filter ([]: every candidate)
        ids[name] = tracking.log_kernels(**kwargs, tracking_uri=uri)["run_id"]
        time.sleep(0.02)
    result = history.compare_runs(uri, ids["A"], ids["B"])
    assert [r["candidate"] for r in result["rows"]] == ["rms_norm/fast"]
    assert [(r["scenario_id"], r["candidate"]) for r in result["removed"]] == [
        ("rms_norm__llama31-8b__tp1__n1", "rms_norm/old")
    ]
    assert len(result["not_selected_by_b"]) == 6 and result["added"] == result["not_selected_by_a"] == []
    assert result["narrowed_b"] == "targets rms_norm; num_tokens 1"
    # the other way round, B's rows are all within A's selection and A's extra rows are not "added"
    back = history.compare_runs(uri, ids["B"], ids["A"])
    assert back["summary"]["added"] == 1 and back["summary"]["not_selected_by_a"] == 6
    # C selected one candidate: rms_norm/old is outside its selection, not removed
    narrow = history.compare_runs(uri, ids["A"], ids["C"])
    assert narrow["removed"] == [] and len(narrow["not_selected_by_b"]) == 7
    assert narrow["narrowed_b"] == "targets rms_norm; num_tokens 1; candidates rms_norm/fast"

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"], ids["B"]]) == 0
    out = capsys.readouterr().out
    assert (
        "0 rows only in B (added), 1 only in A (removed); "
        "6 rows of A not in B's selection (targets rms_norm; num_tokens 1), not compared"
    ) in " ".join(out.split())
    only = out.split("rows only one run has")[1]
    assert "rms_norm/old" in only and "A (removed)" in only and "silu_and_mul" not in only


@pytest.mark.parametrize("columns", [100, 200])
def test_history_tables_fit_the_terminal(ci_runs, capsys, monkeypatch, columns):
    uri, ids = ci_runs
    monkeypatch.setenv("COLUMNS", str(columns))  # what rich reads for the console width
    assert main(["history", "--tracking-uri", uri]) == 0
    assert main(["history", "--tracking-uri", uri, "--compare", ids["A"], ids["B"]]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    runs_head, compare_head = table_headers(out)[:2]
    assert all(w in runs_head for w in ("run", "time", "pass rate", "geomean speedup")), out
    for w in ("scenario", "candidate", "status", "speedup A (95%)", "speedup B (95%)", "significant"):
        assert w in compare_head, out
    if columns == 200:
        assert "left out" not in out and "git sha" in runs_head and "change" in compare_head
    else:
        assert "left out at 100 columns:" in out and "git sha" not in runs_head


def test_compare_after_adding_a_candidate_shows_the_common_rows_speedups(tmp_path, capsys, monkeypatch):
    """A: candidate `fast` on n1 and n64. B, after candidates/rms_norm/new.py was added and
    `kb_nano kernels` rerun: `fast` n1 reused (the same shard), `fast` n64 measured again,
    and `new` on both. The compare lines up the two `fast` rows with both speedups and the
    change, and lists `new`'s rows apart as added (A selected every candidate)."""
    uri = tracking.default_tracking_uri(tmp_path)
    a = [_ci_row("rms_norm", 1, 1.2, (1.1, 1.3)), _ci_row("rms_norm", 64, 1.5, (1.4, 1.6))]
    b = [
        a[0],
        _ci_row("rms_norm", 64, 2.0, (1.9, 2.1), day=2),
        *(_ci_row("rms_norm", n, 1.0, (0.9, 1.1), day=2) | {"candidate": "rms_norm/new"} for n in (1, 64)),
    ]
    ids = []
    for name, rows in (("A", a), ("B", b)):
        kwargs = result_set(tmp_path / name, rows)
        kwargs["config"] = {**kwargs["config"], "candidates": []}  # every candidate selected
        ids.append(tracking.log_kernels(**kwargs, tracking_uri=uri)["run_id"])
        time.sleep(0.02)
    result = history.compare_runs(uri, *ids)
    by = {r["scenario_id"]: r for r in result["rows"]}
    assert {r["candidate"] for r in result["rows"]} == {"rms_norm/fast"} and len(result["rows"]) == 2
    n1, n64 = by["rms_norm__llama31-8b__tp1__n1"], by["rms_norm__llama31-8b__tp1__n64"]
    assert (n1["speedup_a"], n1["speedup_b"], n1["same_measurement"]) == (1.2, 1.2, True)
    assert (n64["speedup_a"], n64["speedup_b"]) == (1.5, 2.0) and n64["change"] == pytest.approx(1 / 3)
    assert n64["significant"] == "faster"
    assert [r["candidate"] for r in result["added"]] == ["rms_norm/new"] * 2 and result["removed"] == []
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["history", "--tracking-uri", uri, "--compare", *ids]) == 0
    out = capsys.readouterr().out
    assert "1.50x (1.40-1.60)" in out and "2.00x (1.90-2.10)" in out and "+33.3%" in out, out
    assert "2 rows in both runs compared: 1 significantly faster" in " ".join(out.split())
    assert "2 rows only in B (added), 0 only in A (removed)" in " ".join(out.split())
    assert "rms_norm/new" in out.split("rows only one run has")[1]
