# Golden tensors (docs/architecture.md, "Data flow"): real inputs of attention, fused_moe and sampler
# captured from a model run. Built on request (`kb_nano capture-golden --model ID` or
# `snakemake results/golden/{model}`); kernel jobs read them through a param holding their
# digest (common.smk golden_param), not an input, so a kernel sweep never triggers a capture.
rule capture_golden:
    input:
        config=golden_model_config,
        prompts="config/golden/prompts.yaml",
        code=[
            str(kbw.PACKAGE_DIR / f)
            for f in (
                "models/golden.py",
                "models/ffn_tree.py",
                "operators/layers.py",
                "models/configs.py",
            )
        ],
    output:
        directory("results/golden/{model}"),
    log:
        "results/logs/capture_golden/{model}.log",
    wildcard_constraints:
        model="[a-z0-9][a-z0-9.-]*",
    conda:
        ENV
    threads: 8
    resources:
        mem_mb=16000,
    params:
        num_layers=GOLDEN["num_layers"],
        weights=lambda wildcards: GOLDEN["weights"].get(wildcards.model),
        hub_id=lambda wildcards: kbw.model_refs(Path("."), config)[
            wildcards.model
        ].hub_id,
    script:
        "../scripts/capture_golden.py"
