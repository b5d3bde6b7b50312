# Parse-time helpers: config checks, candidate discovery, job selection.
# Everything here is torch-free; the heavy work happens inside jobs (and in the manifest
# generation of inputs.smk, only when the manifest's inputs changed).
import functools
import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from kb_nano.candidates import candidate_digest, helper_files
from kb_nano.kernels import job as kernel_job
from kb_nano import checks
from kb_nano import workflow as kbw
from kb_nano.errors import KbNanoError
from kb_nano.files import check_dirs
from kb_nano.interrupts import watch as watch_interrupts

ENV = "../../envs/kb_nano.yaml"

try:
    # the checks `kb_nano` runs before it starts Snakemake (kb_nano.checks), so a bad config
    # gets the same one line here; before inputs.smk writes the manifest
    checks.check_effective(Path("."), config)
    MANIFEST = kbw.manifest_path(
        config
    )  # one file per selection (targets, models, tp, ...)
    CANDIDATES = kbw.candidates(Path("."), config)
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None

if workflow.is_main_process:
    # a kernel job stopped by a Ctrl-C ends as interrupted, not as a failed job (kb_nano.interrupts)
    watch_interrupts()

SETTINGS = kbw.settings(Path("."), config)
CANDIDATES_BY_ID = {c.id: c for c in CANDIDATES}


def kb_errors(fn):
    """``fn`` with a KbNanoError raised as Snakemake's WorkflowError (one line, no traceback)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KbNanoError as exc:
            raise WorkflowError(f"kb-nano: {exc}") from None

    return wrapped


@functools.cache
@kb_errors
def host_checked(tier):
    """The checks of kb_nano.checks.check_host for ``tier`` (a GPU for a cuda device when its
    jobs run here, the MLflow server), once, as the DAG plans the tier's jobs: in the main
    Snakemake process only (a cluster job's re-parse needs neither), when the executor is
    known (a dry run or a cluster executor runs no job of the tier on this host)."""
    if workflow.is_main_process:
        here = workflow.local_exec and not workflow.dryrun and not workflow.touch
        checks.check_host(Path("."), config, tier, jobs_here=here)


def manifest_data():
    """The manifest and its scenarios by id (inputs.smk computes them at parse time)."""
    return MANIFEST_DATA, SCENARIOS


def check_job_dirs(shard_dirs):
    """A file where the jobs' output and log directories go (results/kernels/<target>/<name>
    and results/logs/kernels/<target>/<name>, ...): one line naming it, before Snakemake
    scans or creates them."""
    try:
        check_dirs(Path("."), kbw.job_dirs(shard_dirs))
    except KbNanoError as exc:
        raise WorkflowError(f"kb-nano: {exc}") from None


@functools.cache
def selected():
    jobs, skipped = kbw.select(manifest_data()[0], CANDIDATES, config)
    check_job_dirs(
        str(Path(kbw.shard_path(s["scenario_id"], c)).parent) for s, c in jobs
    )
    return jobs, skipped


def kernel_shards(wildcards):
    host_checked("kernels")
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
        "helpers": [str(p) for p in helper_files(Path("candidates", target))],
        "harness": kbw.harness_files(target),
    }


def kernel_job_inputs(wildcards):
    # (also here: a shard asked for as a target evaluates no kernel_shards)
    host_checked("kernels")
    return {
        "candidate": f"candidates/{wildcards.target}/{wildcards.name}.py",
        **_target_inputs(wildcards.target),
    }


def candidate_sha256_param(wildcards):
    """The hash of the candidate file and its helpers (None while it is missing: its input
    says so). A changed param reruns the job, so an edit that keeps a file's mtime (a
    checkout, a copy with `cp -p`, `touch -r`) is measured again."""
    path = Path(kernel_job_inputs(wildcards)["candidate"])
    return candidate_digest(path) if path.is_file() else None


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


# ----------------------------------------------------------------------------- Tiers 2 and 3 (e2e.smk, eval.smk)
# Planned in the tier packages (kb_nano.e2e.plan, kb_nano.eval.plan, kb_nano.e2e.tier_jobs);
# lazily, by these input functions, so a Tier-1 run never depends on the e2e/eval sections.
from kb_nano.e2e import plan as e2e_plan
from kb_nano.e2e import tier_jobs
from kb_nano.eval import plan as eval_plan

# (the Snakefile's validate() filled both sections from the schema's defaults)
E2E_OUTPUT_JSON = config["e2e"]["output_json"]
EVAL_OUTPUT_JSON = config["eval"]["output_json"]
ENV_E2E = "../../envs/kb_nano_e2e.yaml"
TIER_PLANS = {"e2e": e2e_plan.plan, "eval": eval_plan.plan}


@functools.lru_cache(maxsize=2)
@kb_errors
def tier_plan(tier):
    """The plan of tier ``e2e`` (kb_nano.e2e.plan.plan) or ``eval`` (kb_nano.eval.plan.plan)."""
    host_checked(tier)
    return TIER_PLANS[tier](Path("."), config)


def tier_shards(tier):
    shards = tier_jobs.shard_paths(tier, tier_plan(tier))
    check_job_dirs(list(dict.fromkeys(str(Path(p).parent) for p in shards)))
    return shards


@kb_errors
def e2e_job_inputs(wildcards):
    return tier_jobs.job_inputs(
        tier_plan(wildcards.tier),
        wildcards.tier,
        wildcards.model,
        wildcards.variant,
        Path("."),
    )


@kb_errors
def e2e_params(wildcards):
    return tier_jobs.job_params(
        tier_plan(wildcards.tier),
        wildcards.tier,
        wildcards.model,
        wildcards.workload,
        wildcards.variant,
        Path("."),
    )


def e2e_gpus(wildcards):
    return tier_jobs.job_gpus(tier_plan(wildcards.tier), wildcards.tp)


def eval_skipped_rows():
    return eval_plan.skipped_rows(tier_plan("eval"))
