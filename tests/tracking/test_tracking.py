"""MLflow tracking (kb_nano.tracking): store URI resolution, the run digest, idempotent
logging into a real SQLite store and a real ``mlflow server``, concurrent writers, and
the plots (kb_nano.tracking.plots)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tracking_helpers
from tracking_helpers import mlflow_server, result_set, row

from kb_nano import tracking
from kb_nano.errors import KbNanoError
from kb_nano.tracking.plots import achieved, bandwidth_plot, device_peak
from kb_nano.tracking.speedup_plots import speedup_plot

ROWS = [
    row("rms_norm", "torch_fused", speedup=1.2),
    row("rms_norm", "torch_fused", n=64, speedup=1.1),
    row("rms_norm", "triton_rowwise", status="skipped"),
    row("silu_and_mul", "inplace", speedup=0.8),
    row("silu_and_mul", "inplace", n=64, status="incorrect"),
]


def _runs(uri: str, tier: str = "kernels") -> list:
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(tracking.experiment_name(tier))
    return [] if exp is None else c.search_runs([exp.experiment_id], "")


# ----------------------------------------------------------------------------- URIs


def test_default_uri_is_absolute_sqlite_under_results(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking.resolve_tracking_uri(tmp_path, {"mlflow_tracking_uri": ""})
    assert uri == f"sqlite:///{tmp_path.resolve()}/results/mlflow.db"
    assert uri.startswith("sqlite:////")
    assert tracking.artifact_root(uri) == tmp_path.resolve() / "results" / "mlflow-artifacts"


def test_uri_precedence_and_normalisation(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = {"mlflow_tracking_uri": "http://127.0.0.1:5000"}
    assert tracking.resolve_tracking_uri(tmp_path, cfg) == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:6000")
    assert tracking.resolve_tracking_uri(tmp_path, cfg) == "http://127.0.0.1:6000"
    assert (
        tracking.resolve_tracking_uri(tmp_path, cfg, explicit="sqlite:///x/y.db")
        == f"sqlite:///{tmp_path.resolve()}/x/y.db"
    )
    assert (
        tracking.resolve_tracking_uri(tmp_path, None, explicit="store.db") == f"sqlite:///{tmp_path.resolve()}/store.db"
    )
    with pytest.raises(KbNanoError, match="in-memory"):
        tracking.resolve_tracking_uri(tmp_path, None, explicit="sqlite://")
    with pytest.raises(KbNanoError, match="unknown tier"):
        tracking.experiment_name("training")
    assert tracking.marker_path("kernels") == "results/mlflow/kernels.json"


def test_unreachable_server_is_one_line_error(tmp_path):
    from tracking_helpers import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(KbNanoError) as exc:
        tracking.log_kernels(**result_set(tmp_path, ROWS[:1]), tracking_uri=uri)
    assert "unreachable" in str(exc.value) and "\n" not in str(exc.value)


# ----------------------------------------------------------------------------- digest + metrics


def test_digest_keys_rows_manifest_and_candidates():
    hashes = {"rms_norm/torch_fused": "a" * 64}
    d = tracking.result_digest("kernels", ROWS, "m" * 64, hashes)
    assert d == tracking.result_digest("kernels", list(reversed(ROWS)), "m" * 64, hashes)  # order-free
    assert len(d) == 64
    remeasured = [dict(ROWS[0], created_at="2026-02-02T00:00:00+00:00"), *ROWS[1:]]
    assert tracking.result_digest("kernels", remeasured, "m" * 64, hashes) != d
    assert tracking.result_digest("kernels", ROWS, "n" * 64, hashes) != d
    assert tracking.result_digest("kernels", ROWS, "m" * 64, {"rms_norm/torch_fused": "b" * 64}) != d
    assert tracking.result_digest("e2e", ROWS, "m" * 64, hashes) != d
    nan = [dict(ROWS[2], max_abs_err=float("nan"))]
    assert tracking.result_digest("kernels", nan, None, {}) == tracking.result_digest("kernels", nan, None, {})


def test_kernel_metrics():
    m = tracking.kernel_metrics(ROWS)
    assert m["rows"] == 5 and m["scenarios"] == 4 and m["scenarios_run"] == 4
    assert m["passed"] == 3 and m["failed"] == 1 and m["skipped"] == 1
    assert m["pass_rate"] == pytest.approx(0.75)
    assert m["geomean_speedup"] == pytest.approx((1.2 * 1.1 * 0.8) ** (1 / 3))
    assert m["geomean_speedup/target/rms_norm"] == pytest.approx((1.2 * 1.1) ** 0.5)
    assert m["geomean_speedup/candidate/silu_and_mul/inplace"] == pytest.approx(0.8)
    assert m["pass_rate/candidate/silu_and_mul/inplace"] == pytest.approx(0.5)
    assert "geomean_speedup/candidate/rms_norm/triton_rowwise" not in m  # nothing passed
    assert m["status/incorrect"] == 1


# ----------------------------------------------------------------------------- logging


def test_log_kernels_sqlite_idempotent_and_new_run_on_candidate_edit(tmp_path):
    kwargs = result_set(tmp_path, ROWS)
    uri = tracking.default_tracking_uri(tmp_path)
    first = tracking.log_kernels(**kwargs, tracking_uri=uri)
    assert first["created"] and first["experiment"] == "kb_nano/kernels"
    assert json.loads(kwargs["marker"].read_text())["run_id"] == first["run_id"]

    again = tracking.log_kernels(**kwargs, tracking_uri=uri)
    assert not again["created"] and again["run_id"] == first["run_id"]
    assert len(_runs(uri)) == 1

    run = tracking.client(uri).get_run(first["run_id"])
    p, m, t = run.data.params, run.data.metrics, run.data.tags
    assert p["models"] == "llama31-8b" and p["tp"] == "1" and p["num_warmup"] == "1" and p["num_runs"] == "5"
    for key in ("config_digest", "kb_nano_version", "torch_version", "vllm_version", "git_sha", "device_name"):
        assert p[key]
    assert p["device_name"] == "Test CPU" and p["git_sha"] == "abc123"
    assert m["scenarios_run"] == 4 and m["pass_rate"] == pytest.approx(0.75)
    assert t["kb_nano.digest"] == first["digest"] and t["kb_nano.tier"] == "kernels"
    sha = tracking.file_sha256(tmp_path / "candidates/rms_norm/torch_fused.py")
    assert t["kb_nano.candidate.rms_norm/torch_fused"] == sha
    assert t["kb_nano.candidates"] == "rms_norm/torch_fused,rms_norm/triton_rowwise,silu_and_mul/inplace"
    arts = {a.path for d in ("results", "inputs") for a in tracking.client(uri).list_artifacts(first["run_id"], d)}
    assert arts == {"results/kernels.parquet", "results/kernels.json", "inputs/llm.yaml"}
    exp = tracking.client(uri).get_experiment(first["experiment_id"])
    assert exp.artifact_location == (tmp_path / "results/mlflow-artifacts/kernels").resolve().as_uri()

    # An edited candidate: new source hash -> a new digest -> exactly one new run.
    (tmp_path / "candidates/rms_norm/torch_fused.py").write_text("# edited\n")
    edited = tracking.log_kernels(**kwargs, tracking_uri=uri)
    assert edited["created"] and edited["digest"] != first["digest"]
    assert len(_runs(uri)) == 2
    assert not tracking.log_kernels(**kwargs, tracking_uri=uri)["created"]
    assert len(_runs(uri)) == 2


def test_log_kernels_with_plots_as_artifacts(tmp_path):
    kwargs = result_set(tmp_path, ROWS)
    plots = [speedup_plot(ROWS, tmp_path / "p/s.png"), bandwidth_plot(ROWS, tmp_path / "p/b.png")]
    rec = tracking.log_kernels(**{**kwargs, "plots": plots}, tracking_uri=tracking.default_tracking_uri(tmp_path))
    arts = tracking.client(rec["tracking_uri"]).list_artifacts(rec["run_id"], "plots")
    assert sorted(a.path for a in arts) == ["plots/b.png", "plots/s.png"]


def test_lost_race_deletes_the_duplicate(tmp_path, monkeypatch):
    """Against a server there is no lock: two writers of the same digest may both create a
    run; the later one sees the older twin afterwards and deletes itself."""
    kwargs = result_set(tmp_path, ROWS)
    uri = tracking.default_tracking_uri(tmp_path)
    first = tracking.log_kernels(**kwargs, tracking_uri=uri)
    real = tracking.find_runs_by_digest
    calls = []

    def blind_first_look(c, exp_id, digest):
        calls.append(digest)
        return [] if len(calls) == 1 else real(c, exp_id, digest)

    monkeypatch.setattr(tracking.runs, "find_runs_by_digest", blind_first_look)
    second = tracking.log_kernels(**kwargs, tracking_uri=uri)
    assert not second["created"] and second["run_id"] == first["run_id"]
    assert [r.info.run_id for r in _runs(uri)] == [first["run_id"]]  # the duplicate is deleted


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from tracking_helpers import result_set, row
    from kb_nano import tracking
    root, uri, speed, go = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    kwargs = result_set(root, [row("rms_norm", "torch_fused", speedup=speed)])
    import mlflow  # import before the start signal so both write at the same moment
    (root / "ready").touch()
    while not go.exists():
        time.sleep(0.01)
    rec = tracking.log_kernels(**kwargs, tracking_uri=uri)
    print(rec["run_id"], rec["created"])
    """
)


@pytest.mark.slow
def test_two_sweeps_finishing_at_once_are_both_recorded(tmp_path):
    """Two processes log different result sets into one fresh SQLite store at the same
    moment (including creating the database and the experiment): both runs exist."""
    uri = "sqlite:///" + str(tmp_path / "shared" / "mlflow.db")
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=str(Path(tracking_helpers.__file__).resolve().parent)))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"sweep{i}"), uri, str(1.0 + i / 10), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"sweep{i}" / "ready").exists() for i in (1, 2)):  # both wait for the signal
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "writers did not start"
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    ids = {out.split()[0] for out, _ in outs}
    assert all(out.split()[1] == "True" for out, _ in outs)
    runs = _runs(uri)
    assert {r.info.run_id for r in runs} == ids and len(ids) == 2
    assert all(r.info.status == "FINISHED" for r in runs)


@pytest.mark.slow
def test_real_mlflow_server(tmp_path, monkeypatch):
    """Log into a real ``mlflow server`` on 127.0.0.1 (via $MLFLOW_TRACKING_URI, as a user
    would), idempotently, and read it back through kb_nano.tracking.history."""
    from kb_nano.tracking import history

    with mlflow_server(tmp_path) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        uri = tracking.resolve_tracking_uri(tmp_path, {"mlflow_tracking_uri": ""})
        assert uri == url
        kwargs = result_set(tmp_path / "a", ROWS)
        first = tracking.log_kernels(**kwargs, tracking_uri=uri)
        assert first["created"] and first["tracking_uri"] == url
        assert not tracking.log_kernels(**kwargs, tracking_uri=uri)["created"]
        changed = [dict(r, speedup=r["speedup"] * 2 if r["speedup"] else None) for r in ROWS]
        second = tracking.log_kernels(**result_set(tmp_path / "b", changed), tracking_uri=uri)
        assert second["created"]
        runs = history.list_runs(uri)
        assert [r["run_id"] for r in runs] == [second["run_id"], first["run_id"]]
        cmp = history.compare_runs(uri, first["run_id"], second["run_id"][:8])  # artifacts through the server
        changes = {(r["scenario_id"], r["candidate"]): r["change"] for r in cmp["rows"]}
        assert changes[("rms_norm__llama31-8b__tp1__n1", "rms_norm/torch_fused")] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- plots


def test_device_peaks_and_achieved_rates():
    assert device_peak("NVIDIA H200")["bandwidth_gbs"] == 4800.0
    assert device_peak("NVIDIA H200", "bfloat16")["tflops"] == 989.0
    assert device_peak("NVIDIA H100 PCIe")["bandwidth_gbs"] == 2000.0
    assert device_peak("NVIDIA H100 80GB HBM3")["bandwidth_gbs"] == 3350.0
    assert device_peak("AMD EPYC 7B13") is None
    gbs, gflops = achieved({"candidate_ms": 0.01, "bytes_moved": 10**6, "flops": 2 * 10**6})
    assert gbs == pytest.approx(100.0) and gflops == pytest.approx(200.0)
    assert achieved({"candidate_ms": None, "bytes_moved": 1, "flops": 1}) == (None, None)


def test_plots_cpu_and_cuda_rows(tmp_path):
    cuda = [dict(r, device="cuda", device_name="NVIDIA H200") for r in ROWS]
    for rows, name in ((ROWS, "cpu"), (ROWS + cuda, "mixed"), ([], "empty")):
        for fn in (speedup_plot, bandwidth_plot):
            out = fn(rows, tmp_path / f"{name}_{fn.__name__}.png")
            assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_e2e_metrics_count_skipped_rows_as_not_run():
    """An eval run whose TP-4 rows were skipped on a CPU: the pass rate is over the rows
    that ran (2 ok of 2), not 50%, as Tier 1 counts them."""
    from kb_nano.tracking.e2e import e2e_metrics

    rows = [
        {"status": s, "variant": v, "speedup": sp, "model": "tiny-llama", "tp": tp, "workload": "w"}
        for s, v, sp, tp in (
            ("ok", "baseline", 1.0, 1),
            ("ok", "a", 1.1, 1),
            ("skipped", "baseline", None, 4),
            ("skipped", "a", None, 4),
        )
    ]
    m = e2e_metrics(rows)
    assert (m["rows"], m["scenarios_run"], m["ok"], m["failed"], m["pass_rate"]) == (4, 2, 2, 0, 1.0)
