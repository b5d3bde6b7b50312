# Parse-time helpers: config checks, candidate discovery, job selection.
# Everything here is torch-free; the heavy work happens inside jobs.
import functools
import json
import os
from pathlib import Path

from snakemake.exceptions import WorkflowError

from kb_nano import kernel_job
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


@functools.lru_cache(maxsize=4)
def _manifest_at(path, mtime_ns):
    data = load_manifest(path)
    return data, {s["scenario_id"]: s for s in data["scenarios"]}


def manifest_data():
    """The manifest and its scenarios by id, once the generate_inputs checkpoint has
    produced it; read once per file version, not once per job."""
    path = checkpoints.generate_inputs.get().output[0]
    return _manifest_at(path, os.stat(path).st_mtime_ns)


def selected():
    return kbw.select(manifest_data()[0], CANDIDATES, config)


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
    scenario = manifest_data()[1].get(wildcards.scenario)
    if scenario is None:
        raise WorkflowError(
            f"kb-nano: scenario {wildcards.scenario} is not in {MANIFEST}"
        )
    return json.dumps(scenario, sort_keys=True)
