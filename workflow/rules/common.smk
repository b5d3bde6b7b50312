# Parse-time helpers: config checks, candidate discovery, job selection.
# Everything here is torch-free; the heavy work happens inside jobs (and in the manifest
# generation of inputs.smk, only when the manifest's inputs changed).
import functools
import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from kb_nano.kernels import job as kernel_job
from kb_nano import workflow as kbw
from kb_nano.errors import KbNanoError
from kb_nano.files import OUTPUT_DIRS, check_dirs
from kb_nano.interrupts import watch as watch_interrupts

ENV = "../../envs/kb_nano.yaml"

try:
    kbw.check_config(config)
    check_dirs(Path("."), OUTPUT_DIRS)  # before inputs.smk writes the manifest
    MANIFEST = kbw.manifest_path(
        config
    )  # one file per selection (targets, models, tp, ...)
    CANDIDATES = kbw.candidates(Path("."), config)
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None

if workflow.is_main_process:
    # a kernel job stopped by a Ctrl-C ends as interrupted, not as a failed job (kb_nano.interrupts)
    watch_interrupts()

SETTINGS = kbw.settings(config)
CANDIDATES_BY_ID = {c.id: c for c in CANDIDATES}


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


# ----------------------------------------------------------------------------- Tier 2 (e2e.smk)
from kb_nano.e2e import plan as e2e_plan
from kb_nano.eval import plan as eval_plan
from kb_nano.candidates import file_sha256 as candidate_sha256

# Tier 2/3 sections are optional for Tier-1 runs (a config/config.yaml without them still works).
E2E_OUTPUT_JSON = config.get("e2e", {}).get("output_json", "results/e2e.json")
EVAL_OUTPUT_JSON = config.get("eval", {}).get("output_json", "results/eval.json")
ENV_E2E = "../../envs/kb_nano_e2e.yaml"
E2E_HARNESS = [
    str(kbw.PACKAGE_DIR / f)
    for f in (
        "e2e/commands.py",
        "e2e/job.py",
        "e2e/vllm_plugin.py",
        "e2e/vllm_cli.py",
        "e2e/workloads.py",
        "e2e/schema.py",
        "candidates.py",
        "rows.py",
    )
]


@functools.lru_cache(maxsize=2)
def tier_plan(tier):
    """The jobs of an end-to-end tier (``e2e`` from the ``e2e`` config section, ``eval``
    from ``eval`` with its fixed workloads, kb_nano.eval.plan): device, models by key,
    workloads by name, variants, the TPs each model runs, skipped (model, tp, reason),
    the pairs of engine runs per job (eval smoke: 1) and the engine settings."""
    if tier not in config:
        raise WorkflowError(
            f"kb-nano: the config has no {tier}: section; copy it from config/config.yaml"
        )
    try:
        if tier == "eval":
            plan = eval_plan.plan(Path("."), config)
            ev = config["eval"]
            plan["engine"] = {
                "dtype": "auto",
                "max_model_len": plan["max_model_len"],
                # CUDA graphs as vLLM serves by default; eager only for CPU smoke runs
                "enforce_eager": bool(ev["smoke"]),
                "seed": ev["seed"],
                "device": plan["device"],
                "timeout_s": ev["timeout_s"],
            }
            return plan
        e2e = config["e2e"]
        device = e2e_plan.e2e_device(config)
        models = {}
        for spec in e2e["models"]:
            m = e2e_plan.model(spec, Path("."), e2e["load_format"])
            models[m.key] = m
        return {
            "device": device,
            "models": models,
            "workloads": {w.name: w for w in e2e_plan.workloads(config)},
            "variants": e2e_plan.variants(Path("."), config, device),
            "tps": {key: list(e2e["tp"]) for key in models},
            "skipped": [],
            "pairs": e2e["pairs"],
            "engine": {
                "dtype": e2e["dtype"],
                "max_model_len": e2e["max_model_len"],
                "enforce_eager": e2e["enforce_eager"],
                "seed": e2e["seed"],
                "device": device,
                "timeout_s": e2e["timeout_s"],
            },
        }
    except KbNanoError as exc:
        raise WorkflowError(f"kb-nano: {exc}") from None


def tier_shards(tier):
    plan = tier_plan(tier)
    dirs = [
        f"results/{tier}/{m}/tp{tp}/{w}"
        for m in plan["models"]
        for tp in plan["tps"][m]
        for w in plan["workloads"]
    ]
    check_job_dirs(dirs)
    return [
        f"{d}/{v}.parquet"
        for d in dirs
        for v in e2e_plan.job_variants(plan["variants"])
    ]


def e2e_job_inputs(wildcards):
    model = tier_plan(wildcards.tier)["models"][wildcards.model]
    return {
        "candidates": [
            str(c.path)
            for c in e2e_plan.variant_candidates(wildcards.variant, Path("."))
        ],
        "model_config": str(model.path / "config.json"),
        "harness": E2E_HARNESS,
    }


def e2e_params(wildcards):
    plan = tier_plan(wildcards.tier)
    m = plan["models"][wildcards.model]
    cands = e2e_plan.variant_candidates(wildcards.variant, Path("."))
    return {
        "model": {
            "key": m.key,
            "hub_id": m.hub_id,
            "path": str(m.path),
            "tokenizer": str(m.tokenizer),
            "load_format": m.load_format,
            "weights": m.weights,
        },
        "workload": plan["workloads"][wildcards.workload].params(),
        "candidates": [
            {"id": c.id, "path": str(Path(c.path).resolve())} for c in cands
        ],
        "engine": plan["engine"],
        "pairs": plan["pairs"],
    }


def e2e_gpus(wildcards):
    return 0 if tier_plan(wildcards.tier)["device"] == "cpu" else int(wildcards.tp)


def eval_skipped_rows():
    """One ``skipped`` row per workload x variant of every (model, TP) the eval plan skips."""
    plan = tier_plan("eval")
    return [
        {
            "model": key,
            "hub_id": plan["models"][key].hub_id,
            "tp": tp,
            "workload": w.name,
            "kind": w.kind,
            "workload_params": json.dumps(w.params(), sort_keys=True),
            "variant": variant,
            "candidates": (
                ""
                if variant == "baseline"
                else variant.replace("+", ",").replace(".", "/")
            ),
            "status": "skipped",
            "error": reason,
            "device": plan["device"],
        }
        for key, tp, reason in plan["skipped"]
        for w in plan["workloads"].values()
        for variant in plan["variants"]
    ]
