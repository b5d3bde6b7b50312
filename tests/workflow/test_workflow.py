"""Real Snakemake runs of the Tier-1 workflow in temporary copies of the repository."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest
from workflow_helpers import copy_workflow, snakemake

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A workflow copy after one full (small) sweep."""
    work = copy_workflow(tmp_path_factory.mktemp("wf"))
    snakemake(work)
    return work


def _mtimes(work):
    return {p.relative_to(work).as_posix(): p.stat().st_mtime_ns for p in (work / "results/kernels").rglob("*.parquet")}


def test_sweep_writes_rows_for_every_scenario_and_candidate(swept):
    df = pd.read_parquet(swept / "results/kernels.parquet")
    doc = json.loads((swept / "results/kernels.json").read_text())
    # llama32-1b × tp1 × n1 × {rms_norm: 2 candidates, silu_and_mul: 2 candidates}
    assert sorted(df["candidate"]) == [
        "rms_norm/torch_fused",
        "rms_norm/triton_rowwise",
        "silu_and_mul/inplace",
        "silu_and_mul/triton_fused",
    ]
    assert len(doc["rows"]) == len(df) == 4
    by = df.set_index("candidate")
    assert by.loc["rms_norm/torch_fused", "status"] == "passed"
    assert by.loc["rms_norm/torch_fused", "input_shapes"] == json.dumps({"x": [1, 2048]})
    assert by.loc["rms_norm/triton_rowwise", "status"] == "skipped"
    assert "cuda" in by.loc["rms_norm/triton_rowwise", "error"]
    passed = df[df.status == "passed"]
    assert (passed.baseline_ms > 0).all() and (passed.candidate_ms > 0).all()
    assert (passed.speedup - passed.baseline_ms / passed.candidate_ms).abs().max() < 1e-9
    assert doc["summary"]["by_status"] == {"passed": 2, "skipped": 2}


def test_rerun_without_changes_does_nothing(swept):
    before = _mtimes(swept)
    proc = snakemake(swept, "--dry-run")
    assert "Nothing to be done" in proc.stdout + proc.stderr
    snakemake(swept)
    assert _mtimes(swept) == before


def test_editing_one_candidate_reruns_only_its_jobs(swept):
    before = _mtimes(swept)
    merged_before = (swept / "results/kernels.parquet").stat().st_mtime_ns
    time.sleep(0.05)
    cand = swept / "candidates/silu_and_mul/inplace.py"
    cand.write_text(cand.read_text() + "\n# touched by the incremental-rerun test\n")
    snakemake(swept)
    after = _mtimes(swept)
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert changed == ["results/kernels/silu_and_mul/inplace/silu_and_mul__llama32-1b__tp1__n1.parquet"]
    assert (swept / "results/kernels.parquet").stat().st_mtime_ns > merged_before
    row = pd.read_parquet(swept / "results/kernels.parquet").set_index("candidate").loc["silu_and_mul/inplace"]
    import hashlib

    assert row["candidate_sha256"] == hashlib.sha256(cand.read_bytes()).hexdigest()


def test_an_edit_that_keeps_the_mtime_reruns_the_job(swept):
    """A candidate whose bytes change but whose mtime does not (a checkout, `cp -p`,
    `touch -r`): Snakemake's mtime trigger misses it, the content hash in the job's params
    does not."""
    import os

    cand = swept / "candidates/silu_and_mul/inplace.py"
    stat = cand.stat()
    cand.write_text(cand.read_text() + "\n# edited, mtime kept\n")
    os.utime(cand, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    before = _mtimes(swept)
    snakemake(swept)
    after = _mtimes(swept)
    assert sorted(k for k in after if after[k] != before.get(k)) == [
        "results/kernels/silu_and_mul/inplace/silu_and_mul__llama32-1b__tp1__n1.parquet"
    ]


def test_a_helper_package_edit_that_keeps_the_mtime_reruns_its_targets_jobs(swept):
    """A `_` package next to the candidates (`_pkg/__init__.py`) is a helper like
    `_common.py`: adding it, and editing it with its mtime kept, reruns the target's jobs."""
    import os

    pkg = swept / "candidates/silu_and_mul/_pkg/__init__.py"
    pkg.parent.mkdir()
    pkg.write_text("SCALE = 1.0\n")
    silu = sorted(k for k in _mtimes(swept) if k.startswith("results/kernels/silu_and_mul/"))
    for edit in ("added", "edited with its mtime kept"):
        if edit != "added":
            stat = pkg.stat()
            pkg.write_text("SCALE = 3.0\n")
            os.utime(pkg, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        before = _mtimes(swept)
        snakemake(swept)
        after = _mtimes(swept)
        assert sorted(k for k in after if after[k] != before.get(k)) == silu, edit


def _manifest_file(work: Path) -> Path:
    """The one manifest a run of a fresh copy wrote (results/inputs/llm-<selection>.yaml)."""
    (path,) = (work / "results/inputs").glob("llm-*.yaml")
    return path


def test_manifest_is_byte_identical_when_regenerated_and_kept_when_inputs_unchanged(swept, tmp_path, monkeypatch):
    manifest = _manifest_file(swept)
    first = manifest.read_bytes()
    mtime = manifest.stat().st_mtime_ns
    snakemake(swept, "-n")
    assert manifest.stat().st_mtime_ns == mtime  # inputs unchanged: read back, not rewritten
    manifest.unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty_cache"))  # generated, not copied
    out = snakemake(swept, "-n")
    assert manifest.read_bytes() == first and "from the user cache" not in out.stderr + out.stdout
    from kb_nano.kernels.sandbox import abi_version

    if not abi_version():
        return  # no Landlock here: the user cache is not used (a candidate could write it)
    # another working directory with the same inputs copies it from the user cache
    (tmp_path / "other").mkdir()
    other = copy_workflow(tmp_path / "other")
    out = snakemake(other, "-n")
    assert f"{manifest.name} (from the user cache)" in out.stderr + out.stdout
    assert (other / "results/inputs" / manifest.name).read_bytes() == first


def test_manifest_digest_names_files_relative_and_includes_transformers(tmp_path, monkeypatch):
    from importlib import metadata

    from kb_nano.kernels.manifest import inputs_digest

    for d in ("a", "b"):
        (tmp_path / d / "config").mkdir(parents=True)
        (tmp_path / d / "config/m.json").write_text("{}")
    params = {"models": ["m"], "tp": [1]}
    digest = {d: inputs_digest(params, [tmp_path / d / "config/m.json"], tmp_path / d) for d in ("a", "b")}
    assert digest["a"] == digest["b"]  # the same inputs in two directories
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.1" if name == "transformers" else real(name))
    assert inputs_digest(params, [tmp_path / "a/config/m.json"], tmp_path / "a") != digest["a"]


def test_dry_run_on_a_fresh_copy_shows_every_kernel_job(tmp_path):
    """No checkpoint: the manifest is computed while parsing, so the first dry run already
    lists the kernel jobs (2 targets x 1 scenario x their candidates)."""
    work = copy_workflow(tmp_path)
    out = snakemake(work, "-n")
    assert _manifest_file(work).is_file()
    counts = dict(line.split()[:2] for line in out.stdout.splitlines() if line.startswith(("kernel_bench ", "total ")))
    assert int(counts["kernel_bench"]) == 4, out.stdout  # rms_norm x2, silu_and_mul x2 candidates
    (work / "small.yaml").write_text(
        (work / "small.yaml").read_text().replace("num_tokens:\n- 1", "num_tokens:\n- 1\n- 8")
    )
    out = snakemake(work, "-n")
    counts = dict(line.split()[:2] for line in out.stdout.splitlines() if line.startswith("kernel_bench "))
    assert int(counts["kernel_bench"]) == 8, out.stdout  # the manifest followed the config


def test_bad_candidates_become_rows_and_the_sweep_goes_on(tmp_path):
    work = copy_workflow(tmp_path, {"targets": ["silu_and_mul"], "timeout_s": 20})
    bad = work / "candidates/silu_and_mul"
    (bad / "broken_import.py").write_text("import torch\nraise ImportError('no such extension: my_kernels_C')\n")
    (bad / "segfaults.py").write_text(
        "import os, signal\nfrom torch import nn\n\n\nclass Segfaults(nn.Module):\n"
        "    def forward(self, x):\n        os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    (bad / "hangs.py").write_text(
        "import time\nfrom torch import nn\n\n\nclass Hangs(nn.Module):\n"
        "    def forward(self, x):\n        time.sleep(600)\n"
    )
    (bad / "wrong.py").write_text(
        "from torch import nn\n\n\nclass Wrong(nn.Module):\n    def forward(self, x):\n"
        "        d = x.shape[-1] // 2\n        return x[..., :d] * 2\n"
    )
    snakemake(work)
    df = pd.read_parquet(work / "results/kernels.parquet").set_index("candidate")
    assert df.loc["silu_and_mul/inplace", "status"] == "passed"
    assert df.loc["silu_and_mul/broken_import", "status"] == "import_error"
    assert "my_kernels_C" in df.loc["silu_and_mul/broken_import", "error"]
    assert df.loc["silu_and_mul/segfaults", "status"] == "crashed"
    assert "SIGSEGV" in df.loc["silu_and_mul/segfaults", "error"]
    assert df.loc["silu_and_mul/hangs", "status"] == "timeout"
    assert df.loc["silu_and_mul/wrong", "status"] == "incorrect"
    for error in df["error"].dropna():
        assert "\n" not in error


def test_not_applicable_tp_becomes_skipped_rows_with_reason(tmp_path):
    work = copy_workflow(
        tmp_path, {"models": ["qwen25-7b"], "tp": [8], "targets": ["silu_and_mul", "rotary_embedding"]}
    )
    snakemake(work)
    df = pd.read_parquet(work / "results/kernels.parquet")
    rot = df[df.target == "rotary_embedding"]
    assert set(rot.status) == {"skipped"}
    assert rot.error.str.contains("tp=8 does not divide num_attention_heads=28").all()


def test_every_engine_module_is_a_kernel_job_input():
    """An edit to any module of the Tier-1 engine reruns the kernel jobs (Snakemake inputs)."""
    from kb_nano import workflow as kbw

    # not job inputs: the manifest runs before the jobs (parse time; its code is an input of
    # the manifest itself, MANIFEST_MODULES), merge, table, providers and show after them (the merge rule, the
    # CLI's views)
    not_inputs = ("__init__.py", "manifest.py", "merge.py", "table.py", "providers.py", "show.py")
    engine = {f"kernels/{p.name}" for p in (kbw.PACKAGE_DIR / "kernels").glob("*.py") if p.name not in not_inputs}
    assert engine - set(kbw.HARNESS_MODULES) == set()


def test_lint_is_clean_and_files_are_snakefmt_formatted():
    import subprocess
    import sys

    from workflow_helpers import REPO

    lint = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "Congratulations" in lint.stdout + lint.stderr
    fmt = subprocess.run(
        [sys.executable, "-m", "snakefmt", "--check", "Snakefile", "workflow/"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_python_files_pass_ruff_check_and_format():
    """The repository's Python passes ``ruff check`` and ``ruff format --check`` with the
    configuration in pyproject.toml (``[tool.ruff]``)."""
    import subprocess
    import sys

    from workflow_helpers import REPO

    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def test_new_token_count_runs_only_new_scenarios_and_num_runs_reruns_all(swept):
    import yaml

    before = _mtimes(swept)
    small = swept / "small.yaml"
    original = small.read_text()
    try:
        cfg = yaml.safe_load(original)
        small.write_text(yaml.safe_dump({**cfg, "num_tokens": [1, 2]}))
        snakemake(swept)
        after = _mtimes(swept)
        assert {k: after[k] for k in before} == before
        assert sorted(set(after) - set(before)) == sorted(k.replace("__n1.", "__n2.") for k in before)
        small.write_text(yaml.safe_dump({**cfg, "num_tokens": [1, 2], "num_runs": 4}))
        snakemake(swept)
        rerun = _mtimes(swept)
        assert all(rerun[k] != after[k] for k in after)
    finally:
        small.write_text(original)


@pytest.mark.parametrize(
    "content",
    [
        b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
        b"",
        b"[]",
        b'{"schema_version": 1, "inputs_digest": "x"}',
        b'{"schema_version": 1, "models": {}, "scenarios": [{"target": "rms_norm"}]}',
    ],
)
def test_a_damaged_manifest_is_one_line_and_regenerated(tmp_path, monkeypatch, content):
    """Binary garbage, an empty file, a wrong structure: ``load`` names the file in one
    line, and ``cached`` regenerates instead of trusting it (the user cache too)."""
    from kb_nano import workflow
    from kb_nano.errors import KbNanoError
    from kb_nano.kernels import manifest

    bad = tmp_path / "llm.yaml"
    bad.write_bytes(content)
    with pytest.raises(KbNanoError, match="llm.yaml"):
        manifest.load(bad)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "w").mkdir()
    work = copy_workflow(tmp_path / "w")
    config = {"models": ["llama32-1b"], "tp": [1], "num_tokens": [1], "dtype": "auto"}
    params = {k: config.get(k) for k in ("models", "tp", "num_tokens", "dtype", "context_lens")}
    files = [work / f for f in workflow.model_config_files(work, config)] + [
        Path(f) for f in workflow.manifest_code_files()
    ]
    cache = manifest.user_cache_path(manifest.inputs_digest(params, files, work))
    cache.parent.mkdir(parents=True)
    cache.write_bytes(content)
    (work / "results/inputs").mkdir(parents=True)
    (work / "results/inputs/llm.yaml").write_bytes(content)
    data, how = workflow.manifest(work, config, Path("results/inputs/llm.yaml"))
    assert how == "generated" and data["scenarios"]


def test_manifest_holds_only_the_selected_operators(tmp_path, monkeypatch):
    """``targets`` / ``categories`` scope the manifest (a two-operator sweep need not run
    the other operators' shape rules); another selection is another manifest, and the
    unscoped one holds every operator."""
    from kb_nano import operators, workflow

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "w").mkdir()
    work = copy_workflow(tmp_path / "w")
    base = {"models": ["llama32-1b"], "tp": [1], "num_tokens": [1], "dtype": "auto"}
    path = Path("results/inputs/llm.yaml")

    def targets(config):
        data, how = workflow.manifest(work, config, path)
        return {s["target"] for s in data["scenarios"]}, how

    assert targets({**base, "targets": ["silu_and_mul", "rms_norm"]}) == ({"rms_norm", "silu_and_mul"}, "generated")
    assert targets({**base, "targets": ["rms_norm", "silu_and_mul"]}) == ({"rms_norm", "silu_and_mul"}, None)
    norms = {n for n, e in operators.CATALOG.items() if e.category == "norm"}
    assert targets({**base, "categories": ["norm"]}) == (norms, "generated")
    assert targets({**base, "targets": ["rms_norm"], "categories": ["activation"]}) == (set(), "generated")
    assert targets(base)[0] == set(operators.CATALOG)


def test_another_selection_never_rewrites_a_running_selections_manifest(tmp_path, monkeypatch):
    """Snakemake parses (and computes the manifest) before its lock refuses a second
    invocation: each selection has its own manifest file, so the second invocation's
    parse leaves the first's manifest (which its merge and MLflow run use) as it was."""
    from kb_nano import workflow

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "w").mkdir()
    work = copy_workflow(tmp_path / "w")
    base = {"models": ["llama32-1b"], "tp": [1], "num_tokens": [1], "dtype": "auto"}
    first, second = {**base, "targets": ["rms_norm"]}, {**base, "targets": ["silu_and_mul"]}
    assert workflow.manifest_path(first) != workflow.manifest_path(second)
    assert workflow.manifest_path(first) == workflow.manifest_path({**first, "num_warmup": 3})  # only the selection
    workflow.manifest(work, first, Path(workflow.manifest_path(first)))
    kept = (work / workflow.manifest_path(first)).read_bytes()
    workflow.manifest(work, second, Path(workflow.manifest_path(second)))
    assert (work / workflow.manifest_path(first)).read_bytes() == kept
    assert {
        s["target"] for s in workflow.manifest(work, second, Path(workflow.manifest_path(second)))[0]["scenarios"]
    } == {"silu_and_mul"}
