checkpoint generate_inputs:
    input:
        models=MODEL_FILES,
        code=kbw.manifest_code_files(),
    output:
        MANIFEST,
    log:
        "results/logs/generate_inputs.log",
    localrule: True
    conda:
        ENV
    params:
        models=config["models"],
        tp=config["tp"],
        num_tokens=config["num_tokens"],
        dtype=config["dtype"],
        context_lens=config.get("context_lens"),
    script:
        "../scripts/generate_inputs.py"
