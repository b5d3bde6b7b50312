"""Tier 2's plan from the ``e2e`` config section and the jobs built from a plan
(kb_nano.e2e.plan.plan, kb_nano.e2e.tier_jobs): what the Snakefile's input functions return."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from workflow_helpers import REPO

from kb_nano.config import load
from kb_nano.e2e import plan as e2e_plan
from kb_nano.e2e import tier_jobs
from kb_nano.errors import KbNanoError

TINY = "config/models/kb-nano/tiny-llama"


def _config(**e2e) -> dict:
    """The embedded config with its e2e section on a CPU, one named candidate, and ``e2e``."""
    config = load(REPO)
    config["e2e"].update({"device": "cpu", "candidates": ["rms_norm/torch_fused"], **e2e})
    return config


def test_plan_of_a_small_config():
    plan = e2e_plan.plan(REPO, _config(tp=[1, 2], pairs=2, seed=7, timeout_s=60))
    assert plan["device"] == "cpu"
    assert list(plan["models"]) == ["tiny-llama"] and plan["models"]["tiny-llama"].path == Path(TINY)
    assert list(plan["workloads"]) == ["latency-smoke", "throughput-smoke", "serve-smoke"]
    assert plan["variants"] == ["baseline", "rms_norm.torch_fused"]
    assert plan["tps"] == {"tiny-llama": [1, 2]}  # Tier 2 runs every configured TP
    assert plan["skipped"] == [] and plan["pairs"] == 2
    assert plan["engine"] == {
        "dtype": "auto",
        "max_model_len": 512,
        "enforce_eager": True,
        "seed": 7,
        "device": "cpu",
        "timeout_s": 60,
    }
    only = e2e_plan.plan(REPO, _config(baseline_only=True))
    assert only["variants"] == ["baseline"]


def test_a_config_file_without_the_section_plans_the_schema_defaults(tmp_path):
    """config/config.yaml has no e2e: section: the schema's defaults are the embedded
    Tier-2 run (the tiny Llama, its three smoke workloads), and a config file that sets
    one key of the section keeps the others."""
    assert "e2e" not in yaml.safe_load((REPO / "config/config.yaml").read_text())
    (tmp_path / "one.yaml").write_text("e2e: {pairs: 5, device: cpu, baseline_only: true}\n")
    plan = e2e_plan.plan(REPO, load(REPO, tmp_path / "one.yaml"))
    assert list(plan["models"]) == ["tiny-llama"] and plan["pairs"] == 5 and plan["variants"] == ["baseline"]
    assert list(plan["workloads"]) == ["latency-smoke", "throughput-smoke", "serve-smoke"]
    assert plan["engine"]["max_model_len"] == 512 and plan["engine"]["timeout_s"] == 900


def test_variant_ids_spell_the_candidate_set():
    assert e2e_plan.variant_ids("baseline") == []
    assert e2e_plan.variant_ids("rms_norm.torch_fused+silu_and_mul.inplace") == [
        "rms_norm/torch_fused",
        "silu_and_mul/inplace",
    ]


def test_shards_are_model_x_tp_x_workload_x_job_variant():
    plan = e2e_plan.plan(REPO, _config(tp=[1, 2]))
    shards = tier_jobs.shard_paths("e2e", plan)
    assert len(shards) == 2 * 3  # the candidate variant's job runs the baseline too: no baseline job
    assert shards[0] == "results/e2e/tiny-llama/tp1/latency-smoke/rms_norm.torch_fused.parquet"
    assert shards[-1] == "results/e2e/tiny-llama/tp2/serve-smoke/rms_norm.torch_fused.parquet"
    baseline = tier_jobs.shard_paths("e2e", e2e_plan.plan(REPO, _config(baseline_only=True)))
    assert [s.rsplit("/", 1)[1] for s in baseline] == ["baseline.parquet"] * 3


def test_job_inputs_and_params():
    plan = e2e_plan.plan(REPO, _config(pairs=2))
    inputs = tier_jobs.job_inputs(plan, "e2e", "tiny-llama", "rms_norm.torch_fused", REPO)
    assert inputs["candidates"] == ["candidates/rms_norm/torch_fused.py"]
    assert inputs["model_config"] == f"{TINY}/config.json"
    assert [Path(p).relative_to(tier_jobs.PACKAGE_DIR).as_posix() for p in inputs["harness"]] == list(
        tier_jobs.HARNESS_MODULES
    )
    assert all(Path(p).is_file() for p in inputs["harness"])
    assert tier_jobs.job_inputs(plan, "e2e", "tiny-llama", "baseline", REPO)["candidates"] == []

    params = tier_jobs.job_params(plan, "e2e", "tiny-llama", "throughput-smoke", "rms_norm.torch_fused", REPO)
    assert params["model"] == {
        "key": "tiny-llama",
        "hub_id": None,
        "path": TINY,
        "tokenizer": TINY,
        "load_format": "dummy",  # no weights in the directory
        "weights": "random (--load-format dummy)",
    }
    assert params["workload"] == plan["workloads"]["throughput-smoke"].params()
    assert params["candidates"] == [
        {"id": "rms_norm/torch_fused", "path": str((REPO / "candidates/rms_norm/torch_fused.py").resolve())}
    ]
    assert params["engine"] == plan["engine"] and params["pairs"] == 2


def test_unplanned_paths_name_the_config_field():
    plan = e2e_plan.plan(REPO, _config())
    with pytest.raises(KbNanoError, match=r"e2e.models: 'tiny-lama' is not planned \(did you mean 'tiny-llama'"):
        tier_jobs.job_params(plan, "e2e", "tiny-lama", "latency-smoke", "baseline", REPO)
    with pytest.raises(KbNanoError, match=r"e2e.workloads: 'nope' is not planned.*planned: latency-smoke"):
        tier_jobs.job_params(plan, "e2e", "tiny-llama", "nope", "baseline", REPO)
    with pytest.raises(KbNanoError, match="no candidate file for rms_norm/nope"):
        tier_jobs.job_inputs(plan, "e2e", "tiny-llama", "rms_norm.nope", REPO)


def test_job_gpus_one_per_tp_rank_on_cuda_none_on_cpu():
    assert tier_jobs.job_gpus({"device": "cpu"}, "4") == 0
    assert tier_jobs.job_gpus({"device": "cuda"}, "4") == 4
