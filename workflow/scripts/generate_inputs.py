"""Snakemake adapter: write the scenario manifest (results/inputs/llm.yaml)."""

import sys
from pathlib import Path

from kb_nano.errors import KbNanoError
from kb_nano.manifest import generate, write

with open(snakemake.log[0], "w") as log:
    try:
        manifest = generate(
            models=list(snakemake.params.models),
            tps=[int(t) for t in snakemake.params.tp],
            num_tokens=[int(n) for n in snakemake.params.num_tokens],
            dtype=snakemake.params.dtype,
            root=Path("."),
            context_lens=snakemake.params.context_lens,
        )
    except KbNanoError as exc:
        print(f"error: {exc}", file=log)
        print(f"kb-nano error: {exc}", file=sys.stderr)
        sys.exit(1)
    write(manifest, Path(snakemake.output[0]))
    n = len(manifest["scenarios"])
    na = sum(not s["applicable"] for s in manifest["scenarios"])
    print(f"{n} scenarios ({na} not applicable) for {', '.join(manifest['models'])}", file=log)
