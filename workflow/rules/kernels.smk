if os.environ.get("KB_NANO_PRESTART_JUDGE") == "1" and workflow.is_main_process:
    # the prestarted judge starts the workers of candidates with shards to write all at once
    kernel_job.warm_candidates(kbw.missing_shard_candidates(selected()[0]))


rule kernel_bench:
    # run: (no conda:, it runs in the Snakemake process's environment, which imports
    # kb_nano at parse time anyway): with force-use-threads (profiles/default) jobs are
    # threads of the Snakemake process; each hands its scenario to the judge process of
    # its device, which keeps one worker per candidate between jobs (kb_nano.kernels.job).
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
    threads: 1
    resources:
        gpu=0 if config["device"] == "cpu" else 1,
    params:
        scenario=scenario_param,
        candidate_sha256=candidate_sha256_param,
        settings=SETTINGS,
        golden=golden_param,
    run:
        kernel_job.run_job(input, output, params, wildcards, threads, resources, log)


# Every selected shard as a target: Snakemake does not rebuild a missing input of an
# up-to-date merge, so without this a deleted shard would never be measured again.
rule kernels_measured:
    input:
        kernel_shards,
    localrule: True


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
