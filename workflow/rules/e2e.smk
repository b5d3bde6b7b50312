# Tier 2: vLLM's own benchmarks with candidates swapped into the engine (kb_nano.e2e_job).
# Planned lazily (input functions), so a Tier-1 run never depends on the e2e section.
# Named target: `snakemake e2e` (what `kb_nano e2e ...` builds with a config override).
from kb_nano import e2e_plan
from kb_nano.candidates import file_sha256 as candidate_sha256

E2E_OUTPUT_JSON = config["e2e"]["output_json"]
ENV_E2E = "../../envs/kb_nano_e2e.yaml"
E2E_HARNESS = [
    str(kbw.PACKAGE_DIR / f)
    for f in (
        "e2e_job.py",
        "vllm_plugin.py",
        "vllm_cli.py",
        "workloads.py",
        "candidates.py",
        "schema.py",
    )
]


@functools.lru_cache(maxsize=1)
def e2e_setup():
    """Device, models by key, workloads by name, variants of the configured e2e run."""
    try:
        device = e2e_plan.e2e_device(config)
        models = {}
        for spec in config["e2e"]["models"]:
            m = e2e_plan.model(spec, Path("."), config["e2e"]["load_format"])
            models[m.key] = m
        works = {w.name: w for w in e2e_plan.workloads(config)}
        variants = e2e_plan.variants(Path("."), config, device)
    except KbNanoError as exc:
        raise WorkflowError(f"kb-nano: {exc}") from None
    return device, models, works, variants


def e2e_shards(wildcards):
    _, models, works, variants = e2e_setup()
    return [
        e2e_plan.shard_path(m, tp, w, v)
        for m in models
        for tp in config["e2e"]["tp"]
        for w in works
        for v in variants
    ]


def e2e_job_inputs(wildcards):
    _, models, _, _ = e2e_setup()
    model = models[wildcards.model]
    return {
        "candidates": [
            str(c.path)
            for c in e2e_plan.variant_candidates(wildcards.variant, Path("."))
        ],
        "model_config": str(model.path / "config.json"),
        "harness": E2E_HARNESS,
    }


def e2e_params(wildcards):
    device, models, works, _ = e2e_setup()
    m = models[wildcards.model]
    cands = e2e_plan.variant_candidates(wildcards.variant, Path("."))
    e2e = config["e2e"]
    return {
        "model": {
            "key": m.key,
            "hub_id": m.hub_id,
            "path": str(m.path),
            "tokenizer": str(m.tokenizer),
            "load_format": m.load_format,
            "weights": m.weights,
        },
        "workload": works[wildcards.workload].params(),
        "candidates": [
            {"id": c.id, "path": str(Path(c.path).resolve())} for c in cands
        ],
        "engine": {
            "dtype": e2e["dtype"],
            "max_model_len": e2e["max_model_len"],
            "enforce_eager": e2e["enforce_eager"],
            "seed": e2e["seed"],
            "device": device,
            "timeout_s": e2e["timeout_s"],
        },
    }


def e2e_gpus(wildcards):
    return 0 if e2e_setup()[0] == "cpu" else int(wildcards.tp)


rule e2e_bench:
    input:
        unpack(e2e_job_inputs),
    output:
        shard="results/e2e/{model}/tp{tp}/{workload}/{variant}.parquet",
        json="results/e2e/{model}/tp{tp}/{workload}/{variant}.json",
    log:
        "results/logs/e2e/{model}/tp{tp}/{workload}/{variant}.log",
    wildcard_constraints:
        model="[A-Za-z0-9_.-]+",
        tp="[0-9]+",
        workload="[A-Za-z0-9_.+-]+",
        variant="[A-Za-z0-9_.+-]+",
    conda:
        ENV_E2E
    # vLLM on a CPU uses every core: one e2e job at a time unless --cores is larger.
    threads: workflow.cores
    resources:
        gpu=e2e_gpus,
    params:
        job=e2e_params,
    script:
        "../scripts/e2e_bench.py"


rule merge_e2e:
    input:
        shards=e2e_shards,
    output:
        parquet="results/e2e.parquet",
        json=E2E_OUTPUT_JSON,
    log:
        "results/logs/merge_e2e.log",
    localrule: True
    conda:
        ENV
    script:
        "../scripts/merge_e2e.py"


rule log_mlflow_e2e:
    input:
        parquet="results/e2e.parquet",
        json=E2E_OUTPUT_JSON,
        code=str(kbw.PACKAGE_DIR / "tracking.py"),
    output:
        marker_path("e2e"),
    log:
        "results/logs/log_mlflow_e2e.log",
    localrule: True
    conda:
        ENV
    params:
        tier="e2e",
        tracking_uri=TRACKING_URI,
        config={k: v for k, v in config.items() if k != "mlflow_tracking_uri"},
    script:
        "../scripts/log_mlflow.py"


rule e2e:
    input:
        "results/e2e.parquet",
        E2E_OUTPUT_JSON,
        marker_path("e2e"),
