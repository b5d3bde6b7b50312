rule kernel_bench:
    input:
        unpack(kernel_job_inputs),
    output:
        "results/kernels/{target}/{name}/{scenario}.parquet",
    log:
        "results/logs/kernels/{target}/{name}/{scenario}.log",
    wildcard_constraints:
        target="[a-z0-9_]+",
        name="[A-Za-z0-9_]+",
        scenario="[A-Za-z0-9_.-]+",
    conda:
        ENV
    threads: 1
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
    params:
        scenario=scenario_param,
        settings=SETTINGS,
        golden=golden_param,
    script:
        "../scripts/kernel_bench.py"


rule merge_kernels:
    input:
        shards=kernel_shards,
        manifest=MANIFEST,
    output:
        parquet="results/kernels.parquet",
        json=config["output_json"],
    log:
        "results/logs/merge_kernels.log",
    localrule: True
    conda:
        ENV
    params:
        not_applicable=not_applicable_pairs,
    script:
        "../scripts/merge_kernels.py"
