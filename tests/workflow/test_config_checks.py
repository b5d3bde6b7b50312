"""A bad config stops plain `snakemake` with the one line `kb_nano` gives before it starts
Snakemake (kb_nano.checks): the CLI names the file (or flag) that set the key, the
Snakefile says `config <key>`, and what follows is the same."""

from __future__ import annotations

import pytest
from workflow_helpers import copy_workflow, kb_nano, snakemake


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("checks"))


def _cli_line(out) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stdout + out.stderr
    return lines[0]


def _same_line(work, cfg, cli_args=("--dry-run",), snakemake_args=("--dry-run",)) -> str:
    """The CLI's error for config file ``cfg``, checked against plain `snakemake`'s; returns
    the part after the key's origin (``<key>: <detail>``)."""
    line = _cli_line(kb_nano(work, "kernels", "--configfile", str(cfg), *cli_args))
    assert line.startswith(f"error: {cfg}: "), line
    message = line.removeprefix(f"error: {cfg}: ")
    out = snakemake(work, str(cfg), *snakemake_args, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and f"kb-nano: config {message}\n" in text, text
    assert "Traceback (most recent call last)" not in text
    return message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "output_json: results/kernels/x.json\n",
            "output_json: results/kernels/x.json: that path belongs to another kb-nano output; pick another",
        ),
        (
            "output_json: notes.json\n",
            "output_json: notes.json: inside the workflow directory but not under results/; it could overwrite a "
            "workflow file; pick a path under results/ or outside the workflow",
        ),
        (
            "e2e:\n  output_json: results/eval.json\n",
            "e2e.output_json: results/eval.json: that path belongs to another kb-nano output; pick another",
        ),
        ("candidates: [rms_norm/nope]\n", "candidates: 'rms_norm/nope' matches no file candidates/{target}/{name}.py"),
        ("atol: .nan\n", "atol: nan is not a finite number"),
    ],
)
def test_a_bad_config_is_the_same_line_for_snakemake_and_the_cli(work, tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert _same_line(work, cfg).startswith(message)
    assert not (work / "results/kernels/x.json").exists()


def test_an_unreachable_tracking_server_is_the_same_line(work, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # (the discard port: nothing answers)
    line = _cli_line(kb_nano(work, "kernels", "--dry-run"))
    assert line.startswith("error: MLflow tracking server http://127.0.0.1:9 is unreachable"), line
    out = snakemake(work, "--dry-run", check=False)
    assert out.returncode != 0 and f"kb-nano: {line.removeprefix('error: ')}\n" in out.stdout + out.stderr


@pytest.mark.slow
def test_device_cuda_needs_a_gpu_only_when_jobs_run_here(work, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
    cfg = tmp_path / "cuda.yaml"
    cfg.write_text("device: cuda\n")
    message = _same_line(work, cfg, cli_args=(), snakemake_args=())
    assert message == "device: cuda: no NVIDIA GPU is visible here; use auto or cpu"
    assert not list((work / "results").glob("kernels/*/*/*.parquet"))  # no job ran
    # a dry run plans the jobs, which needs no GPU
    assert kb_nano(work, "kernels", "--configfile", str(cfg), "--dry-run").returncode == 0
    snakemake(work, str(cfg), "--dry-run")
    cfg.write_text("e2e:\n  device: cuda\n")  # the e2e device matters to the e2e jobs only
    snakemake(work, str(cfg), "--dry-run")
    out = snakemake(work, str(cfg), "--cores", "2", "e2e", check=False)  # (after --configfile: its own option)
    assert "kb-nano: config e2e.device: cuda: no NVIDIA GPU is visible here; use auto or cpu" in out.stderr
