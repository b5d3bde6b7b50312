# Parse-time helpers: config checks, candidate discovery, job selection.
# Everything here is torch-free; the heavy work happens inside jobs.
import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from kb_nano import workflow as kbw
from kb_nano.errors import KbNanoError
from kb_nano.manifest import load as load_manifest

MANIFEST = "results/inputs/llm.yaml"
ENV = "../../envs/kb_nano.yaml"

try:
    kbw.check_config(config)
    CANDIDATES = kbw.candidates(Path("."), config)
    MODEL_FILES = kbw.model_config_files(Path("."), config)
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None

SETTINGS = kbw.settings(config)
CANDIDATES_BY_ID = {c.id: c for c in CANDIDATES}


def manifest_data():
    """The manifest, once the generate_inputs checkpoint has produced it."""
    return load_manifest(checkpoints.generate_inputs.get().output[0])


def selected():
    return kbw.select(manifest_data(), CANDIDATES, config)


def kernel_shards(wildcards):
    jobs, _ = selected()
    return [kbw.shard_path(s["scenario_id"], c) for s, c in jobs]


def not_applicable_pairs(wildcards):
    _, skipped = selected()
    return [[s["scenario_id"], c.id] for s, c in skipped]


def kernel_job_inputs(wildcards):
    checkpoints.generate_inputs.get()
    return {
        "candidate": f"candidates/{wildcards.target}/{wildcards.name}.py",
        "helpers": sorted(
            str(p) for p in Path("candidates", wildcards.target).glob("_*.py")
        ),
        "harness": kbw.harness_files(wildcards.target),
    }


def scenario_param(wildcards):
    for s in manifest_data()["scenarios"]:
        if s["scenario_id"] == wildcards.scenario:
            return json.dumps(s, sort_keys=True)
    raise WorkflowError(f"kb-nano: scenario {wildcards.scenario} is not in {MANIFEST}")
