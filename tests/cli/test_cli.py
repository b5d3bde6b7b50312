"""The kb_nano CLI: listing, mapping, one-line errors, and a real run through Snakemake."""

from __future__ import annotations

import json
import os

import pytest
from tracking_helpers import row, table_headers
from workflow_helpers import copy_workflow, kb_nano


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("cli"))


def test_list_shows_every_operator(work):
    out = kb_nano(work, "kernels", "--list")
    assert out.returncode == 0, out.stderr
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "embedding"):
        assert name in out.stdout
    level1 = kb_nano(work, "kernels", "--list", "--level", "1")
    assert "rms_norm" in level1.stdout and "L1" in level1.stdout


def test_map_and_list_keep_transformers_config_warnings_off_the_terminal(work):
    """Reading a config with generation fields and the old ``torch_dtype`` key (Gemma-3's
    multimodal file) and building it on the meta device prints no transformers warnings."""
    for args in (("--map", "--model", "gemma3-4b", "--target", "rms_norm"), ("--list",)):
        out = kb_nano(work, "kernels", *args)
        assert out.returncode == 0, out.stderr
        assert "[transformers]" not in out.stderr, out.stderr


def test_list_shows_the_candidate_contract(work):
    """`kernels --list` shows each baseline's constructor and forward signatures: what a
    candidate must accept."""
    from kb_nano import operators
    from kb_nano.operators.base import contract

    out = kb_nano(work, "kernels", "--list")
    assert out.returncode == 0, out.stderr
    assert "candidate contract" in out.stdout
    for text in (
        "RMSNorm(hidden_size: int, eps: float = 1e-06, weight_offset: float =",
        "forward(x: torch.Tensor, residual: torch.Tensor | None = None)",
        "SiluAndMul()",  # no __init__ of its own: nn.Module's takes no arguments
        "forward(x: torch.Tensor) -> torch.Tensor",
        "QKNorm(num_heads: int, num_kv_heads: int, head_dim: int, eps: float =",
    ):
        assert text in out.stdout, out.stdout
    for name in operators.names():
        baseline = operators.get(name).baseline
        init, forward = contract(baseline)
        assert init.startswith(baseline.__name__ + "(") and forward.startswith("forward(")
        assert "self" not in init + forward and "'" not in forward
    assert contract(operators.get("attention").baseline)[1] == (
        "forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None, key_cache: torch.Tensor "
        "| None = None, value_cache: torch.Tensor | None = None) -> torch.Tensor"
    )


def _column(out: str, header: str) -> dict[str, str]:
    """The cells of ``header``'s column of the one rich table in ``out``, by the first
    column's value, each cell's wrapped lines joined with single spaces."""
    lines = out.splitlines()
    col = table_headers(out)[0].split(" | ").index(header)
    cells: dict[str, list[str]] = {}
    key = ""
    first = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("┡"))
    for line in lines[first + 1 :]:
        if line.lstrip().startswith("└"):
            break
        parts = [p.strip() for p in line.strip().strip("│").split("│")]
        key = parts[0] or key
        cells.setdefault(key, []).append(parts[col])
    return {k: " ".join(" ".join(v).split()) for k, v in cells.items()}


def test_list_shows_the_baseline_state_dict_shapes(work, monkeypatch, capsys):
    """`kernels --list` shows each baseline's state_dict keys with their per-rank shapes
    for the first configured model and TP it applies to (built on the meta device),
    naming that model; a registry model outside the configuration where none of them
    uses the operator; `(none)` without parameters; `--model`/`--tp` choose the model.
    On a narrow terminal this column is the first left out, and no line is wider."""
    from kb_nano.cli.parser import main

    monkeypatch.setenv("KB_NANO_ROOT", str(work))
    header = "baseline state_dict: keys, per-rank shapes"

    def listing(columns: int, *flags: str) -> str:
        monkeypatch.setenv("COLUMNS", str(columns))
        assert main(["kernels", "--list", *flags]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= columns, out
        return out

    out = listing(250)
    cells = _column(out, header)
    assert cells["rms_norm"] == "of llama31-8b tp=1: weight [4096]"
    assert cells["qk_norm"] == "of qwen3-8b tp=1: q_norm.weight [128] k_norm.weight [128]"
    assert cells["embedding"] == "of llama31-8b tp=1: weight [128256, 4096]"
    for name in ("silu_and_mul", "gelu_and_mul", "rotary_embedding", "sampler", "attention"):
        assert cells[name] == "(none)", name
    assert cells["fused_moe"].startswith("of mixtral-8x7b tp=1 (not configured): w13_weight [8, 28672, 4096]")
    assert cells["decoder_layer"].startswith("of llama31-8b tp=4: self_attn.q_proj.weight [1024, 4096]")
    assert cells["model"].startswith("of llama32-1b tp=1 (not configured): model.embed_tokens.weight [128256, 2048]")
    assert "model.layers.{0,1}.mlp.up_proj.weight [8192, 2048]" in cells["model"]
    assert "state_dict keys and shapes" in out

    qwen = _column(listing(250, "--model", "qwen3", "--tp", "2", "--level", "1"), header)
    assert qwen["embedding"] == "of qwen3-8b tp=2: weight [75968, 4096]" and "decoder_layer" not in qwen

    narrow = listing(120)
    (head,) = table_headers(narrow)
    assert header not in head and "candidate contract" in head
    assert f"left out at 120 columns: level, category, baseline module, {header}" in " ".join(narrow.split())


def test_map_shows_real_per_rank_shapes(work):
    out = kb_nano(work, "kernels", "--map", "--model", "llama31", "--tp", "1", "4")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "LlamaForCausalLM" in text and "hidden 4096" in text
    assert "x[N, 28672]" in text  # silu_and_mul input at tp=1: 2 * 14336
    assert "x[N, 7168]" in text  # ... and at tp=4
    assert "query[N, 1024]" in text and "key[N, 256]" in text  # rotary at tp=4: 8 heads, 2 kv heads
    assert "note: --model llama31 selects the configured llama31-8b (key prefix)" in out.stderr


def test_a_model_prefix_says_which_models_it_chose(capsys):
    """`--model qwen` keeps the configured models whose key starts with it, and says so;
    a full key or a vendored Hub id is taken as given, without a note."""
    from workflow_helpers import REPO

    from kb_nano.cli.config import select_models

    configured = ["llama31-8b", "qwen3-8b", "llama32-1b"]
    assert select_models(["llama3"], configured, REPO) == ["llama31-8b", "llama32-1b"]
    assert (
        capsys.readouterr().err == "note: --model llama3 selects the configured llama31-8b, llama32-1b (key prefix)\n"
    )
    assert select_models(["qwen3-8b", "meta-llama/Llama-3.1-8B-Instruct"], configured, REPO)[0] == "qwen3-8b"
    assert capsys.readouterr().err == ""


def test_the_table_shows_what_an_incremental_run_measured():
    """A first run shows every row (its not-applicable rows, made at the merge, have no
    created_at); a rerun that measured some rows and reused others shows those it
    measured; a run that measured nothing shows the whole selection."""
    from kb_nano.kernels.table import measured_since

    start = "2026-12-02T10:00:00+00:00"
    old, new = "2026-12-02T09:00:00+00:00", "2026-12-02T10:00:05+00:00"
    na = {**row("qk_norm", "fused", status="skipped"), "created_at": None}
    fresh = [{**row("rms_norm", "a"), "created_at": new}, {**row("rms_norm", "b"), "created_at": new}, na]
    assert measured_since(fresh, start) is None
    rerun = [fresh[0], {**fresh[1], "created_at": old}, na]
    assert measured_since(rerun, start) == [fresh[0]]
    assert measured_since([{**r, "created_at": old} for r in fresh[:2]] + [na], start) is None


def test_notes_that_rows_share_are_footnotes(monkeypatch, capsys):
    """A note several rows have (a skip reason for every num_tokens, "not significant")
    is printed once under the table and the rows show its mark; a note one row has stays
    in its cell."""
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels

    skip = "tp=8 does not divide num_attention_heads=28"
    rows = [{**row("rms_norm", "torch_fused", n=n, status="skipped"), "error": skip} for n in (1, 64, 512)]
    rows += [row("rms_norm", "fp32", n=1, speedup=1.01, speedup_ci_low=0.9, speedup_ci_high=1.1, significant=False)]
    rows += [row("rms_norm", "fp32", n=64, speedup=1.0, speedup_ci_low=0.8, speedup_ci_high=1.2, significant=False)]
    rows += [{**row("rms_norm", "fp32", n=512, status="runtime_error"), "error": "RuntimeError: only here"}]
    monkeypatch.setenv("COLUMNS", "250")
    print_kernels(rows, summarize(rows))
    out = capsys.readouterr().out
    assert out.count(skip) == 1 and "[1] " + skip in out, out
    assert out.count("the 95% rerun interval contains 1.0") == 1, out
    assert out.count("RuntimeError: only here") == 1 and "[3]" not in out, out
    body = out.split("[1] " + skip)[0]
    assert body.count("[1]") == 3 and body.count("[2]") == 2, out


@pytest.mark.parametrize("columns", [100, 200])
def test_kernel_table_fits_the_terminal(monkeypatch, capsys, columns):
    """The Tier-1 table at $COLUMNS (what rich reads): no line wider, and scenario,
    candidate, status, speedup and its interval always there; the low-priority columns
    are left out at 100 columns (the caption says so) and all shown at 200."""
    from kb_nano.kernels.merge import summarize
    from kb_nano.kernels.table import print_kernels

    rows = [
        row("fused_add_rms_norm", "fp32_sum", n=64, speedup=2.29, speedup_ci_low=1.38, speedup_ci_high=3.79),
        row("rotary_embedding", "neox_inplace", model="mistral-7b-v03", n=16384, status="runtime_error"),
        row("rms_norm", "triton_rowwise", status="skipped"),
    ]
    monkeypatch.setenv("COLUMNS", str(columns))
    print_kernels(rows, summarize(rows))
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    (head,) = table_headers(out)
    for name in ("scenario", "candidate", "status", "speedup", "rerun 95%"):
        assert name in head.split(" | "), out
    flat = " ".join(out.split())
    assert "2.29x" in flat and "1.38-3.79" in flat and "runtime_error" in flat
    if columns == 200:
        assert "baseline ms ±IQR" in head and "max_abs_err" in head and "left out" not in out
    else:
        assert "baseline ms ±IQR" not in head and "left out at 100 columns: max_abs_err" in flat


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--target", "rms_nrom"], "unknown target 'rms_nrom'"),
        (["--model", "llama99"], "unknown model 'llama99'"),
        (["--category", "nope"], "unknown category 'nope'"),
        (["--candidate", "rms_norm/nope"], "'rms_norm/nope' matches no file"),
        (["--candidate", "rms_norm/torch_fussed"], "(did you mean 'rms_norm/torch_fused'?)"),
        (["--model", "lama31"], "(did you mean 'llama31-8b'?)"),  # a typo of a key's head
        (["--versus", "rms_norm/nope"], "--versus rms_norm/nope: no candidate file"),  # before any job
        (["--model", "llama3"], None),  # prefix filter: valid (checked with --dry-run below)
    ],
)
def test_bad_flags_give_one_line_errors(work, args, needle):
    out = kb_nano(work, "kernels", "--dry-run", *args)
    if needle is None:
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tp: four\n", "tp: 'four' is not of type 'array'"),
        ("tp: [1\n", "not valid YAML"),
        ("tpp: [1]\n", "'tpp' was unexpected"),
        ("num_run: 5\n", "'num_run' was unexpected) (did you mean 'num_runs'?)"),
        ("atol: -1\n", "atol"),
        ("models: [nosuchmodel]\n", "unknown model 'nosuchmodel'"),
        ("targets: [rms_nrom]\n", "bad.yaml: targets: unknown target 'rms_nrom'"),
    ],
)
def test_bad_config_files_give_one_line_errors(work, tmp_path, text, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    out = kb_nano(work, "kernels", "--configfile", str(cfg))
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_bad_candidate_directory_and_broken_model_config(work, tmp_path):
    stray = work / "candidates/rmsnorm"
    stray.mkdir()
    (stray / "fast.py").write_text("")
    try:
        out = kb_nano(work, "kernels", "--dry-run")
        assert out.returncode == 2 and "candidates/rmsnorm/fast.py: unknown target 'rmsnorm'" in out.stderr
    finally:
        (stray / "fast.py").unlink()
        stray.rmdir()
    broken = tmp_path / "config.json"
    broken.write_text('{"hidden_size": 10')
    out = kb_nano(work, "kernels", "--model", str(broken))
    assert out.returncode == 2 and "not a readable JSON config" in out.stderr


@pytest.mark.slow
def test_kernels_runs_the_dag_and_prints_the_table(work, tmp_path):
    out_json = tmp_path / "k.json"
    args = (
        "kernels",
        "--target",
        "rms_norm",
        "--model",
        "llama32-1b",
        "--tp",
        "1",
        "--num-tokens",
        "1",
        "--num-warmup",
        "1",
        "--num-runs",
        "3",
        "--output-json",
        str(out_json),
    )
    out = kb_nano(work, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rms_norm__llama32-1b__tp1__n1" in out.stdout and "speedup" in out.stdout
    assert "steps" in out.stderr  # Snakemake progress was visible
    doc = json.loads(out_json.read_text())
    assert {r["candidate"] for r in doc["rows"]} == {"rms_norm/torch_fused", "rms_norm/triton_rowwise"}
    assert all(r["num_runs"] >= 3 for r in doc["rows"] if r["status"] == "passed")  # at least: small calls get more
    # a deleted shard is measured again (Snakemake alone keeps the up-to-date merge and skips it)
    shard = work / "results/kernels/rms_norm/torch_fused/rms_norm__llama32-1b__tp1__n1.parquet"
    kept = work / "results/kernels/rms_norm/triton_rowwise/rms_norm__llama32-1b__tp1__n1.parquet"
    shard.unlink()
    before = kept.stat().st_mtime_ns
    again = kb_nano(work, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert shard.is_file() and kept.stat().st_mtime_ns == before
    # the table shows what this run measured; the reused row is counted, not shown
    assert "rms_norm/torch_fused" in again.stdout and "rms_norm/triton_rowwise" not in again.stdout, again.stdout
    assert "1 more row of this selection not shown (measured by earlier runs" in again.stdout
    assert "2 rows:" in again.stdout  # (the summary is of the whole selection)
    every = kb_nano(work, *args, "--all-rows")
    assert "rms_norm/triton_rowwise" in every.stdout and "more row" not in every.stdout, every.stdout
    # providers side by side, from the same (up-to-date) results
    side = kb_nano(work, *args, "--by-scenario", "--versus", "rms_norm/torch_fused")
    assert side.returncode == 0, side.stdout + side.stderr
    assert "rms_norm llama32-1b tp1" in side.stdout and "rms_norm/torch_fused (versus)" in side.stdout
    assert "baseline: median of the baseline times" in side.stdout
    assert "vs " in side.stdout and " ms paired" in side.stdout  # each speedup's own baseline time


@pytest.mark.slow
def test_snakemake_actions_that_run_no_job_print_no_table(work):
    """After a real run, `kb_nano kernels -- --unlock` (and the other Snakemake-only
    actions after `--`) prints what Snakemake says, not the previous run's table."""
    small = ["--target", "rms_norm", "--model", "llama32-1b", "--tp", "1", "--num-tokens", "1"]
    first = kb_nano(work, "kernels", *small, "--num-warmup", "1", "--num-runs", "3")
    assert first.returncode == 0 and "rms_norm__llama32-1b__tp1__n1" in first.stdout, first.stdout + first.stderr
    (work / ".snakemake/locks").mkdir(parents=True, exist_ok=True)
    (work / ".snakemake/locks/0.input.lock").write_text("stale\n")  # a crashed run's lock
    for extra, said in (
        (["--unlock"], "Unlocked working directory"),
        (["-np"], "Nothing to be done"),
        (["--list-rules"], "kernel_bench"),
        (["--summary"], "merge_kernels"),
        (["--cleanup-metadata", "results/kernels.json"], ""),  # (says nothing)
    ):
        out = kb_nano(work, "kernels", *small, "--num-warmup", "1", "--num-runs", "3", "--", *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        assert said in out.stdout + out.stderr, (extra, out.stdout + out.stderr)
        for table in ("kb-nano kernels", "rms_norm__llama32-1b__tp1__n1 ", "results: ", "MLflow: "):
            assert table not in out.stdout, (extra, out.stdout)
        if extra == ["--unlock"]:
            locks = work / ".snakemake/locks"
            assert not locks.exists() or not any(locks.iterdir())


def test_snakemake_action_reads_snakemakes_own_options():
    from kb_nano.launch import snakemake_action

    assert snakemake_action(["--unl"]) == "--unlock"  # argparse abbreviation
    assert snakemake_action(["-np"]) == "--dry-run"  # short-option cluster
    assert snakemake_action(["--cm", "results/kernels.json"]) == "--cleanup-metadata"
    assert snakemake_action(["-e", "dryrun"]) == "--executor"
    assert snakemake_action(["--report"]) == "--report"
    assert snakemake_action(["--version"]) == "--help/--version"
    for runs_jobs in ([], ["--profile", "profiles/slurm"], ["-j", "4"], ["--report", "--report-after-run"]):
        assert snakemake_action(runs_jobs) is None, runs_jobs
    assert snakemake_action(["--forcerun", "merge_kernels", "-e", "slurm"]) is None


@pytest.mark.slow
def test_generate_inputs_reports_not_applicable_tp(work):
    out = kb_nano(work, "generate-inputs", "--model", "qwen25-7b", "--tp", "8", "--num-tokens", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    why = "the model cannot be deployed at tp=8 (vLLM): tp=8 does not divide num_attention_heads=28"
    assert f"n/a rotary_embedding__qwen25-7b__tp8__n1: {why}" in out.stdout
    assert f"n/a rms_norm__qwen25-7b__tp8__n1: {why}" in out.stdout  # unsharded, but no such deployment
    one = kb_nano(
        work, "generate-inputs", "--model", "qwen25-7b", "--tp", "4", "--num-tokens", "1", "--target", "rms_norm"
    )
    assert one.returncode == 0 and ": 1 scenarios for qwen25-7b; 0 not applicable" in one.stdout, (
        one.stdout + one.stderr
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--atol", "nan"], "error: --atol nan is not a finite number"),
        (["--device", "cuda"], "no NVIDIA GPU is visible here"),
        (["--output-json", "results/mlflow/kernels.json"], "belongs to another kb-nano output"),
        (["--output-json", "/proc/nope/x.json"], "is not writable"),
        (["--num-runs", "0"], "--num-runs: num_runs"),
        (["--tp", "1", "1"], "--tp: tp"),
        (["--level", "2"], "--level only filters --list"),
        (["--map", "--tp", "0"], "--tp: tp.0"),
    ],
)
def test_more_bad_flags_give_one_line_errors(work, args, needle):
    out = kb_nano(work, "kernels", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_config_json_missing_a_shape_field_is_an_error(work, tmp_path):
    src = json.loads((work / "config/models/meta-llama/Llama-3.2-1B-Instruct/config.json").read_text())
    del src["hidden_size"]
    model = tmp_path / "nohidden"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(src))
    out = kb_nano(work, "kernels", "--model", str(model), "--dry-run")
    assert out.returncode == 2 and "field(s) hidden_size missing" in out.stderr, out.stderr


def test_garbage_tracking_uri_is_an_error(work):
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", "kernels", "--dry-run"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work), "MLFLOW_TRACKING_URI": "garbage!!"},
    )
    assert out.returncode == 2 and "not an MLflow store" in out.stderr, out.stderr


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a non-interactive shell does


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGINT, started with SIGINT ignored"])
def test_a_signal_to_kb_nano_alone_stops_the_whole_run(tmp_path, sig):
    # kill -INT / -TERM to the kb_nano process only (a script, nohup, a scheduler, a
    # background job whose shell set SIGINT to ignored): the Snakemake run below it stops
    # too, keeps what finished and leaves no process behind
    import signal
    import subprocess
    import sys
    import time

    import psutil

    work = copy_workflow(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kb_nano.cli",
            "kernels",
            "--target",
            "embedding",
            "--model",
            "llama31-8b",
            "qwen3-8b",
            "--tp",
            "1",
            "4",
            "--num-tokens",
            "1",
            "64",
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
        start_new_session=True,
        preexec_fn=_ignore_sigint if "ignored" in sig else None,
    )
    sig = sig.split(",")[0]
    try:
        deadline = time.monotonic() + 120
        while not list((work / "results/logs/kernels").rglob("*.log")) and time.monotonic() < deadline:
            time.sleep(0.2)  # a kernel job is running
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert descendants, "no Snakemake process started"
        t0 = time.monotonic()
        os.kill(proc.pid, getattr(signal, sig))
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 130, out
        assert time.monotonic() - t0 < 15, "took too long to stop (the run itself takes ~40 s)"
        assert "interrupted" in out and "Traceback" not in out.split("WorkflowError")[-1]
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not (work / ".snakemake/locks").exists() or not any((work / ".snakemake/locks").iterdir())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_bad_flag_value_is_one_line():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", "kernels", "--speedup-basis", "fastest"], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "invalid choice: 'fastest'" in out.stderr and "kb_nano kernels --help" in out.stderr


def test_cuda_only_settings_change_no_cpu_job():
    """On a CPU run the CUDA-only settings keep their defaults in the jobs' params (so
    setting them reruns nothing) and the CLI names them."""
    from workflow_helpers import REPO

    from kb_nano import workflow as kbw
    from kb_nano.config import load

    base = {**load(REPO), "device": "cpu", "num_warmup": 1, "num_runs": 2, "timeout_s": 5}
    changed = {**base, "speedup_basis": "kernel", "cuda_graph": False, "ci_target": 0.05}
    assert kbw.settings(REPO, changed) == kbw.settings(REPO, base)
    assert kbw.cpu_ignored(REPO, changed) == ["cuda_graph=False", "speedup_basis=kernel", "ci_target=0.05"]
    on_gpu = {**changed, "device": "cuda"}
    assert kbw.cpu_ignored(REPO, on_gpu) == [] and kbw.settings(REPO, on_gpu)["speedup_basis"] == "kernel"


@pytest.mark.parametrize(
    ("argv", "func", "kept"),
    [
        (["eval", "--dry-run"], "cmd_eval", "results/eval/"),
        (["e2e", "latency", "--dry-run"], "cmd_e2e", "results/e2e/"),
        (["kernels"], "cmd_kernels", "results/kernels/"),
        (["history"], "cmd_history", None),
    ],
)
def test_ctrl_c_names_where_that_commands_finished_work_is(monkeypatch, capsys, argv, func, kept):
    """A Ctrl-C ends any command with one line and status 130, naming the folder that
    command's finished shards are in (an interrupted `kb_nano eval` said results/kernels/)."""
    from kb_nano.cli import parser

    def interrupted(args, passthrough):
        raise KeyboardInterrupt

    monkeypatch.setattr(parser, func, interrupted)
    assert parser.main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("interrupted")
    assert (kept in err) if kept else ("kept" not in err)


@pytest.mark.slow
def test_sigint_to_the_workers_alone_ends_their_job_and_the_run(tmp_path):
    """SIGINT that reaches the measurement workers but not Snakemake (`pkill -INT` from a
    script, a sweep under nohup whose workers share a terminal's group): the job they served
    fails as interrupted (no row: the next run redoes it) and Snakemake ends the run, or,
    when only the candidate's worker got it, the job ends with a ``crashed`` row; either
    way nothing hangs and no process is left behind. (An engine that ran candidates inside Snakemake's job lost the
    interruption and froze the run.)"""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    import psutil

    work = copy_workflow(tmp_path)
    argv = ["kernels", "--target", "embedding", "--model", "llama31-8b", "qwen3-8b", "--tp", "1", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kb_nano.cli", *argv, "--num-tokens", "1", "64"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
        start_new_session=True,
    )
    try:

        def workers() -> list:
            """The measurement workers: forked by the workers' fork server, which the judge
            started, which the judge's fork server forked (four generations of fork-server
            command lines; the workers' fork server itself has three)."""
            found = []
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, AttributeError):
                    chain = [p, p.parent(), p.parent().parent(), p.parent().parent().parent()]
                    if all("forkserver" in " ".join(q.cmdline()) for q in chain):
                        found.append(p)
            return found

        deadline = time.monotonic() + 120
        while not (list((work / "results/logs/kernels").rglob("*.log")) and workers()):
            assert time.monotonic() < deadline, "no kernel job with workers started"
            time.sleep(0.2)
        time.sleep(1)  # the rest of the job's workers
        descendants = psutil.Process(proc.pid).children(recursive=True)
        hit = workers()
        for p in hit:
            os.kill(p.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=240)
        # the baseline's worker interrupted: the job fails without a row (Snakemake ends the
        # run); only the candidate's: its death is the candidate's row, the run goes on
        if proc.returncode == 1:
            assert "interrupted (SIGINT); no row, the next run redoes this job" in out
            assert "the Snakemake workflow failed" in out
        else:
            assert proc.returncode == 0 and "the candidate worker died of SIGINT" in out, out
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["Snakemake starting", "a fork server starting"])
def test_ctrl_c_while_kb_nano_starts_is_quiet(tmp_path, when):
    """Ctrl-C in the terminal (SIGINT to kb_nano's process group) while Snakemake is still
    importing or parsing, or while the judges' fork server is importing: the run ends
    with status 130, says it was interrupted, prints no traceback and leaves no process."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    work = copy_workflow(tmp_path)
    cmd = [sys.executable, "-m", "kb_nano.cli", "kernels", "--target", "rms_norm", "--model", "llama31-8b"]
    proc = subprocess.Popen(
        [*cmd, "--tp", "1", "--num-tokens", "1"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work), "XDG_CACHE_HOME": str(tmp_path / "cache")},
        start_new_session=True,
    )

    def started(p: psutil.Process) -> bool:
        cmdline = " ".join(p.cmdline())
        return "forkserver" in cmdline if "fork server" in when else "snakemake_main" in cmdline

    try:
        deadline, seen = time.monotonic() + 60, []
        while not seen and time.monotonic() < deadline and proc.poll() is None:
            try:
                seen = [p for p in psutil.Process(proc.pid).children(recursive=True) if started(p)]
            except psutil.Error:
                pass
            time.sleep(0.02)
        assert seen, f"{when}: not seen"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "interrupted" in out and "Traceback" not in out, out
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
