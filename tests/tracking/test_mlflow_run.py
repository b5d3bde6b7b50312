"""What one kernel run holds in MLflow, read back from a real SQLite store: per-scenario
metrics under stable, MLflow-legal names (charted across runs), the merged table as a
table artifact, a run name equal to the id the CLI and ``kb_nano history`` show, an
experiment the UI shows as a runs table; and the ``-dirty`` git sha."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest
from tracking_helpers import mlflow_server, result_set, row

from kb_nano import tracking
from kb_nano.provenance import git_sha
from kb_nano.tracking import history

ROWS = [
    row("rms_norm", "torch_fused", speedup=1.2, speedup_ci_low=1.1, speedup_ci_high=1.3),
    row("rms_norm", "torch_fused", n=64, speedup=0.9),
    row("rms_norm", "triton_rowwise", status="skipped"),
    row("silu_and_mul", "inplace", n=64, status="incorrect"),
]
KEY = "rms_norm__llama31-8b__tp1__n1/rms_norm/torch_fused"
ROW_METRIC = "rms_norm/llama31-8b__tp1__n1 torch_fused"  # the row's speedup metric after "speedup/"


def test_metric_names_are_legal_stable_and_distinct():
    from mlflow.utils.validation import _validate_metric_name

    assert tracking.metric_name("speedup", "rms_norm__llama31-8b__tp1__n1", "rms_norm/torch_fused") == f"speedup/{KEY}"
    odd = [
        ("speedup", "attn__org/Model:v2+x__tp1__n8", "attn/a+b"),
        ("speedup", "attn__org/Model_v2_x__tp1__n8", "attn/a_b"),  # what the first sanitises to
        ("speedup", "a//b/../c/.", "x/"),
        ("speedup", "é" * 300, "c"),
    ]
    names = [tracking.metric_name(*parts) for parts in odd]
    for name in names:
        _validate_metric_name(name)  # MLflow's own check: raises on an illegal name
        assert len(name) <= 250
    assert len(set(names)) == len(names)
    assert names == [tracking.metric_name(*parts) for parts in odd]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two logged runs of the same scenarios; the second one's first row is faster."""
    tmp = tmp_path_factory.mktemp("mlflow_run")
    uri = tracking.default_tracking_uri(tmp)
    faster = [dict(ROWS[0], speedup=1.5, candidate_ms=0.02 / 1.5), *ROWS[1:]]
    recs = [
        tracking.log_kernels(**result_set(tmp / name, rows), tracking_uri=uri)
        for name, rows in (("a", ROWS), ("b", faster))
    ]
    return uri, recs


def test_per_scenario_metrics_chart_one_row_across_runs(two_runs):
    """Each passed row is one metric, its speedup, named by target then scenario and
    candidate (the UI's metrics tab: one section per target); its interval and medians
    are in the table artifact only."""
    uri, (a, b) = two_runs
    c = tracking.client(uri)
    m = c.get_run(a["run_id"]).data.metrics
    assert m[f"speedup/{ROW_METRIC}"] == pytest.approx(1.2)
    assert m["speedup/rms_norm/llama31-8b__tp1__n64 torch_fused"] == pytest.approx(0.9)
    per_row = sorted(k for k in m if k.startswith("speedup/"))
    assert per_row == [f"speedup/{ROW_METRIC}", "speedup/rms_norm/llama31-8b__tp1__n64 torch_fused"]
    assert not any(k.startswith(("speedup_ci_", "baseline_ms/", "candidate_ms/")) for k in m)
    assert m["geomean_speedup"] == pytest.approx((1.2 * 0.9) ** 0.5, rel=5e-4)  # the summary, 4 digits
    # one scenario across runs, as the UI's chart of that metric reads it
    runs = c.search_runs([a["experiment_id"]], order_by=["attributes.start_time ASC"])
    assert [r.data.metrics[f"speedup/{ROW_METRIC}"] for r in runs] == pytest.approx([1.2, 1.5])


def test_thousands_of_rows_are_logged_in_batches(tmp_path):
    rows = [row("rms_norm", "torch_fused", n=n + 1, speedup=1 + n / 10000) for n in range(1100)]
    rec = tracking.log_kernels(**result_set(tmp_path, rows), tracking_uri=tracking.default_tracking_uri(tmp_path))
    m = tracking.client(rec["tracking_uri"]).get_run(rec["run_id"]).data.metrics
    assert sum(k.startswith("speedup/") for k in m) == 1100
    assert m["speedup/rms_norm/llama31-8b__tp1__n1100 torch_fused"] == 1.11  # 1.1099 to 4 significant digits


def test_the_merged_rows_are_a_table_artifact(two_runs, monkeypatch):
    uri, (a, _) = two_runs
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # load_table searches the default store
    c = tracking.client(uri)
    tags = c.get_run(a["run_id"]).data.tags
    assert json.loads(tags["mlflow.loggedArtifacts"]) == [{"path": "tables/kernels.json", "type": "table"}]
    table = c.load_table(a["experiment_id"], "tables/kernels.json", run_ids=[a["run_id"]])
    assert list(table.columns) == list(tracking.kernels.TABLE_COLUMNS)
    assert list(table.columns[:4]) == ["scenario_id", "candidate", "status", "speedup"]  # what the UI shows first
    assert len(table) == len(ROWS)
    first = table[table["scenario_id"] == "rms_norm__llama31-8b__tp1__n1"].iloc[0]
    assert first["candidate"] == "rms_norm/torch_fused" and first["speedup"] == pytest.approx(1.2)
    assert first["candidate_ms"] == 0.01667  # 0.02 / 1.2 to 4 significant digits


def test_run_name_is_the_id_the_cli_and_history_show(two_runs, tmp_path, capsys):
    from kb_nano.tracking.marker import print_mlflow_record

    uri, (a, b) = two_runs
    for rec in (a, b):
        assert rec["run_name"] == rec["run_id"][:12]
        assert tracking.client(uri).get_run(rec["run_id"]).data.tags["mlflow.runName"] == rec["run_name"]
    (tmp_path / "kernels.json").write_text(json.dumps(a))
    print_mlflow_record(tmp_path, "kernels.json", None)
    assert f"MLflow: new run {a['run_name']} in kb_nano/kernels" in capsys.readouterr().out
    runs = history.list_runs(uri)
    assert {r["run_name"] for r in runs} == {a["run_name"], b["run_name"]}
    cmp = history.compare_runs(uri, a["run_name"], b["run_name"])
    assert len(cmp["rows"]) == 4


def test_the_cli_tells_a_rerun_of_the_log_rule_by_the_markers_record(tmp_path, capsys):
    """The marker's record, read before Snakemake runs and after it, says whether the log
    rule ran: each run of the rule writes a new ``logged_at``; the file's mtime plays no
    part (a touched or copied marker is not a new record, a rewritten one with an old
    mtime is)."""
    import os

    from kb_nano.tracking.marker import print_mlflow_record, read_marker

    uri = tracking.default_tracking_uri(tmp_path)
    kwargs = result_set(tmp_path / "w", ROWS)
    marker = kwargs["marker"]
    root, rel = tmp_path / "w", "results/mlflow/kernels.json"
    assert read_marker(root, rel) is None
    first = tracking.log_kernels(**kwargs, tracking_uri=uri)
    before = read_marker(root, rel)
    assert before["run_id"] == first["run_id"] and before["logged_at"].endswith("+00:00")
    os.utime(marker, ns=(10**18, 10**18))  # touched, not rewritten: the rule did not run
    print_mlflow_record(root, rel, before)
    assert f"MLflow: nothing changed since run {first['run_name']} in kb_nano/kernels" in capsys.readouterr().out

    again = tracking.log_kernels(**kwargs, tracking_uri=uri)  # the rule ran again on the same inputs
    assert not again["created"] and again["run_id"] == first["run_id"]
    assert read_marker(root, rel)["logged_at"] != before["logged_at"]
    os.utime(marker, ns=(10**18, 10**18))  # (the mtime the marker had before)
    print_mlflow_record(root, rel, before)
    assert f"MLflow: inputs unchanged, existing run {first['run_name']}" in capsys.readouterr().out
    print_mlflow_record(root, rel, None)  # no marker before the run
    out = capsys.readouterr().out
    assert "inputs unchanged, existing run" in out and "--compare" not in out  # (no new run: nothing to compare)

    edited = result_set(tmp_path / "w", [{**ROWS[0], "speedup": 1.5, "seed": 7}, *ROWS[1:]])
    new = tracking.log_kernels(**edited, tracking_uri=uri)  # a re-measured row: a new run
    assert new["created"]
    print_mlflow_record(root, rel, read_marker(root, rel) | {"run_id": first["run_id"], "logged_at": "earlier"})
    out = capsys.readouterr().out
    assert f"MLflow: new run {new['run_name']}" in out
    assert (
        f"what changed since the previous run: kb_nano history --compare {first['run_name']} {new['run_name']}" in out
    )
    # a previous run that shares no row with the new one (another target): no compare line
    print_mlflow_record(
        root, rel, read_marker(root, rel) | {"run_id": first["run_id"], "logged_at": "earlier", "row_keys": ["x y"]}
    )
    out = capsys.readouterr().out
    assert f"MLflow: new run {new['run_name']}" in out and "--compare" not in out


def test_an_older_runs_ui_name_works_in_compare(two_runs):
    uri, (a, b) = two_runs
    tracking.client(uri).update_run(a["run_id"], name="kernels-0123456789ab")  # named as runs once were
    try:
        assert history.resolve_run(tracking.client(uri), "kernels-0123456789ab").info.run_id == a["run_id"]
    finally:
        tracking.client(uri).update_run(a["run_id"], name=a["run_name"])


def test_experiments_are_run_based_for_the_ui(two_runs, tmp_path):
    uri, (a, _) = two_runs
    c = tracking.client(uri)
    assert c.get_experiment(a["experiment_id"]).tags["mlflow.experimentKind"] == "custom_model_development"
    # an experiment created before the tag existed gets it on the next log
    old_uri = tracking.default_tracking_uri(tmp_path)
    old = tracking.client(old_uri)
    exp_id = old.create_experiment(
        "kb_nano/kernels", artifact_location=(tmp_path / "artifacts").as_uri(), tags={"kb_nano.tier": "kernels"}
    )
    tracking.log_kernels(**result_set(tmp_path, ROWS[:1]), tracking_uri=old_uri)
    assert old.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_mlflow_ui_links_open_the_runs_table(tmp_path, capsys):
    """The URLs `kb_nano mlflow-ui` prints (each experiment's runs page with the kb-nano
    view, its newest run's page) ask for the UI's machine-learning layout (MLflow 3.17
    shows the GenAI layout unless the URL's workflowType says otherwise), and the ids in
    them are the server's."""
    from kb_nano.tracking.ui import print_experiment_urls

    with mlflow_server(tmp_path) as url:
        rec = tracking.log_kernels(**result_set(tmp_path / "a", ROWS), tracking_uri=url)
        print_experiment_urls(url + "/")
        with urllib.request.urlopen(url + "/", timeout=10) as resp:
            assert resp.status == 200
    out = capsys.readouterr().out
    exp_id = rec["experiment_id"]
    runs = f"{url}/#/experiments/{exp_id}/runs?viewStateShareKey=kb_nano&workflowType=machine_learning"
    assert f"kb_nano/kernels runs: {runs}\n" in out
    newest = f"{url}/#/experiments/{exp_id}/runs/{rec['run_id']}?workflowType=machine_learning"
    assert f"kb_nano/kernels newest run {rec['run_name']}: {newest}\n" in out


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_sha_is_marked_dirty_with_uncommitted_tracked_changes(tmp_path):
    assert git_sha(tmp_path) is None  # not a checkout
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_sha(tmp_path) == head
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files do not count, as in `git describe --dirty`
    assert git_sha(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_sha(tmp_path) == f"{head}-dirty"
    _git(tmp_path, "add", "a.py")  # staged but not committed: still dirty
    assert git_sha(tmp_path) == f"{head}-dirty"
    _git(tmp_path, "commit", "-q", "-m", "two")
    assert (
        git_sha(tmp_path)
        == subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    )


def _measured(target: str, n: int, speedup: float, second: int, name: str = "torch_fused") -> dict:
    """A measured row: its shard's created_at and seed say which measurement it is."""
    return row(target, name, n=n, speedup=speedup, seed=1000 + second) | {
        "created_at": f"2026-01-01T00:00:{second:02d}+00:00"
    }


def _log(root, rows, uri, manifest: str):
    """Log ``rows`` as `kb_nano kernels` does; each selection has its own manifest."""
    kwargs = result_set(root, rows, manifest_text=f"schema_version: 1\nscenarios: []\n# {manifest}\n")
    return tracking.log_kernels(**kwargs, tracking_uri=uri), kwargs["marker"]


def test_a_filtered_rerun_that_measured_nothing_logs_no_run(tmp_path, capsys):
    """A full sweep, then `--target rms_norm --num-tokens 1` reusing every selected shard:
    no second run; the record and the CLI name the run that holds the rows. A scenario no
    job measured (not applicable, made at merge without created_at) is held the same way.
    A rerun that measured one row logs a run as before, and so does a set of rows that
    only several runs together hold."""
    from kb_nano.tracking.marker import print_mlflow_record

    uri = tracking.default_tracking_uri(tmp_path)
    not_applicable = row("qk_norm", "fused", status="skipped") | {"error": "not applicable: llama31-8b has no qk_norm"}
    full = [
        _measured("rms_norm", 1, 1.2, 1),
        _measured("rms_norm", 64, 0.9, 2),
        _measured("silu_and_mul", 1, 1.5, 3, "inplace"),
        not_applicable | {"created_at": None},
    ]
    first, _ = _log(tmp_path / "full", full, uri, "full")
    assert first["created"]

    view, marker = _log(tmp_path / "view", [full[0], full[3]], uri, "rms_norm+qk_norm n1")
    assert not view["created"] and view["run_id"] == first["run_id"]
    assert view["recorded_in"] == [{"run_id": first["run_id"], "run_name": first["run_name"], "rows": 2}]
    assert [r["run_id"] for r in history.list_runs(uri)] == [first["run_id"]]  # no run for the view
    print_mlflow_record(marker.parents[2], str(marker.relative_to(marker.parents[2])), None)
    out = capsys.readouterr().out
    assert (
        f"MLflow: no new run, nothing new was measured: all 2 rows are already recorded in run {first['run_name']}"
        in (" ".join(out.split()))
    )

    # one row measured again (a new created_at and seed): the view is a new result, logged
    again = _measured("rms_norm", 1, 1.3, 4)
    remeasured, _ = _log(tmp_path / "again", [again, full[1]], uri, "rms_norm")
    assert remeasured["created"] and "recorded_in" not in remeasured
    # rows of two runs together (a full sweep after the rerun): a combination no run records, logged
    both, _ = _log(tmp_path / "both", [again, full[1], full[2]], uri, "rms_norm silu_and_mul")
    assert both["created"] and "recorded_in" not in both
    assert len(history.list_runs(uri)) == 3


def test_a_run_of_the_five_metrics_per_row_holds_its_rows(tmp_path, monkeypatch):
    """A run logged while kb-nano recorded five metrics per row (``candidate_ms/...``,
    no ``speedup/<target>/...``) still holds its rows: a filtered rerun of them logs no run."""
    from kb_nano.tracking import kernels

    def five_per_row(rows):
        fields = ("speedup", "speedup_ci_low", "speedup_ci_high", "baseline_ms", "candidate_ms")
        passed = [r for r in rows if r["status"] == "passed"]
        named = ((tracking.metric_name(f, r["scenario_id"], r["candidate"]), r.get(f)) for r in passed for f in fields)
        return {name: v for name, v in named if v is not None}

    uri = tracking.default_tracking_uri(tmp_path)
    full = [_measured("rms_norm", 1, 1.2, 1), _measured("rms_norm", 64, 0.9, 2)]
    monkeypatch.setattr(kernels, "scenario_metrics", five_per_row)
    old, _ = _log(tmp_path / "old", full, uri, "full")
    assert (
        "candidate_ms/rms_norm__llama31-8b__tp1__n1/rms_norm/torch_fused"
        in tracking.client(uri).get_run(old["run_id"]).data.metrics
    )
    monkeypatch.undo()
    view, _ = _log(tmp_path / "view", full[:1], uri, "n1")
    assert not view["created"] and view["recorded_in"][0]["run_id"] == old["run_id"]


def test_a_view_of_an_edited_candidate_is_not_the_recorded_one(tmp_path):
    """Rows equal to a logged run's, but the candidate file changed since (its shards not
    measured again): the earlier run recorded another source, so the result set is new."""
    uri = tracking.default_tracking_uri(tmp_path)
    rows = [_measured("rms_norm", 1, 1.2, 1), _measured("rms_norm", 64, 0.9, 2)]
    first, _ = _log(tmp_path / "a", rows, uri, "full")
    (tmp_path / "b" / "candidates" / "rms_norm").mkdir(parents=True)
    (tmp_path / "b" / "candidates" / "rms_norm" / "torch_fused.py").write_text("# edited\n")
    edited, _ = _log(tmp_path / "b", rows[:1], uri, "n1")
    assert edited["created"] and edited["run_id"] != first["run_id"]
