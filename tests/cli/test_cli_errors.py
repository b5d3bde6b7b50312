"""Bad flags, config files, candidate folders and model configs give one-line errors."""

from __future__ import annotations

import json
import os

import pytest
from workflow_helpers import kb_nano


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--target", "rms_nrom"], "unknown target 'rms_nrom'"),
        (["--model", "llama99"], "unknown model 'llama99'"),
        (["--category", "nope"], "unknown category 'nope'"),
        (["--category", "norms"], "unknown category 'norms' (did you mean 'norm'?)"),
        (["--model", "./no/such/config.json"], "no such file"),
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


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--atol", "nan"], "error: --atol nan is not a finite number"),
        (["--device", "cuda"], "no NVIDIA GPU is visible here"),
        (["--output-json", "results/mlflow/kernels.json"], "belongs to another kb-nano output"),
        (["--output-json", "/proc/nope/x.json"], "is not writable"),
        (["--output-json", "/proc/x.json"], "cannot create a file in /proc"),  # root may "access" /proc
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


def test_bad_shape_values_and_two_models_of_one_key_stop_before_snakemake(work, tmp_path):
    """A head count of -4, and two local config folders of one name, are one line from the
    preflight (exit 2), not a Snakemake WorkflowError with a file and line."""
    src = json.loads((work / "config/models/meta-llama/Llama-3.2-1B-Instruct/config.json").read_text())
    bad = tmp_path / "negheads"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**src, "num_attention_heads": -4}))
    for command in ("kernels", "generate-inputs"):
        out = kb_nano(work, command, "--model", str(bad), *(["--dry-run"] if command == "kernels" else []))
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "field 'num_attention_heads' is -4; expected a positive integer" in out.stderr
    bad_rope = tmp_path / "ropetheta"
    bad_rope.mkdir()
    (bad_rope / "config.json").write_text(json.dumps({**src, "rope_theta": "x"}))  # was a ValueError traceback
    out = kb_nano(work, "kernels", "--model", str(bad_rope), "--dry-run")
    assert out.returncode == 2 and "field 'rope_theta' is \"x\"; expected a positive number" in out.stderr
    for d in ("a", "b"):
        (tmp_path / d / "mm").mkdir(parents=True)
        (tmp_path / d / "mm" / "config.json").write_text(json.dumps(src))
    out = kb_nano(work, "kernels", "--model", str(tmp_path / "a/mm"), str(tmp_path / "b/mm"), "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "more than one model has the key mm" in out.stderr and "WorkflowError" not in out.stdout


def test_garbage_tracking_uri_is_an_error(work):
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


def test_a_bad_flag_value_is_one_line():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", "kernels", "--speedup-basis", "fastest"], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "invalid choice: 'fastest'" in out.stderr and "kb_nano kernels --help" in out.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["kernels", "--targt", "rms_norm"],
            "unrecognized arguments: --targt rms_norm (--targt: did you mean '--target'?)",
        ),
        (["e2e", "latency", "--input-lenn", "3"], "--input-lenn 3 (--input-lenn: did you mean '--input-len'?)"),
        (["history", "--limt", "3"], "unrecognized arguments: --limt 3 (--limt: did you mean '--limit'?) (see"),
    ],
)
def test_a_mistyped_flag_names_the_closest_one(work, argv, needle):
    """A misspelt option is one line from the subcommand's parser naming the flag it
    resembles (and, where Snakemake runs, that its own options go after --)."""
    out = kb_nano(work, *argv)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and needle in lines[0], out.stderr
    assert ("go after --" in lines[0]) == (argv[0] != "history")
