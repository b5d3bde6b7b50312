# Parse-time helpers: config checks, candidate discovery, job selection.
# Everything here is torch-free; the heavy work happens inside jobs (and in the manifest
# generation of inputs.smk, only when the manifest's inputs changed).
import functools
import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from kb_nano import workflow as kbw
from kb_nano.errors import KbNanoError

MANIFEST = "results/inputs/llm.yaml"
ENV = "../../envs/kb_nano.yaml"

try:
    kbw.check_config(config)
    CANDIDATES = kbw.candidates(Path("."), config)
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None

SETTINGS = kbw.settings(config)
CANDIDATES_BY_ID = {c.id: c for c in CANDIDATES}


def manifest_data():
    """The manifest and its scenarios by id (inputs.smk computes them at parse time)."""
    return MANIFEST_DATA, SCENARIOS


@functools.cache
def selected():
    return kbw.select(manifest_data()[0], CANDIDATES, config)


def kernel_shards(wildcards):
    jobs, _ = selected()
    return [kbw.shard_path(s["scenario_id"], c) for s, c in jobs]


def not_applicable_pairs(wildcards):
    _, skipped = selected()
    return [[s["scenario_id"], c.id] for s, c in skipped]


@functools.cache
def _target_inputs(target):
    """Helpers next to the target's candidates and the harness files (same for every job
    of a target: computed once, not once per job)."""
    return {
        "helpers": sorted(str(p) for p in Path("candidates", target).glob("_*.py")),
        "harness": kbw.harness_files(target),
    }


def kernel_job_inputs(wildcards):
    return {
        "candidate": f"candidates/{wildcards.target}/{wildcards.name}.py",
        **_target_inputs(wildcards.target),
    }


def _scenario(wildcards):
    scenario = manifest_data()[1].get(wildcards.scenario)
    if scenario is None:
        raise WorkflowError(
            f"kb-nano: scenario {wildcards.scenario} is not in {MANIFEST}"
        )
    return scenario


def scenario_param(wildcards):
    return json.dumps(_scenario(wildcards), sort_keys=True)


def golden_param(wildcards):
    """Golden tensors of the job's model and operator when captured (else None)."""
    return kbw.golden_param(Path("."), _scenario(wildcards), config)


GOLDEN = kbw.golden_settings(config)


def golden_model_config(wildcards):
    ref = kbw.model_refs(Path("."), config).get(wildcards.model)
    if ref is None:
        raise WorkflowError(
            f"kb-nano: capture_golden: model {wildcards.model!r} is not in config models; "
            f"use `kb_nano capture-golden --model {wildcards.model}`"
        )
    return str(ref.config_path)
