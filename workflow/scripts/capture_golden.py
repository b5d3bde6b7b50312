"""Snakemake adapter: capture the golden tensors of one model (see kb_nano.models.golden)."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

import hashlib
import sys
from pathlib import Path

from kb_nano.errors import KbNanoError
from kb_nano.models.configs import ModelRef, config_fields
from kb_nano.models.golden import capture

with open(snakemake.log[0], "w") as log:
    model = snakemake.wildcards.model
    try:
        config_path = Path(snakemake.input.config)
        meta = {
            "model": model,
            "hub_id": snakemake.params.hub_id,
            "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest(),
        }
        weights = Path(snakemake.params.weights) if snakemake.params.weights else None
        # the text decoder's fields of a multimodal file (Llama-4, Gemma-3), else the file's
        ref = ModelRef(model, snakemake.params.hub_id, config_path)
        written = capture(
            config_fields(ref, Path(".")),
            meta,
            Path("."),
            Path(snakemake.output[0]),
            num_layers=int(snakemake.params.num_layers),
            weights=weights,
            num_threads=snakemake.threads,
        )
    except KbNanoError as exc:
        print(f"error: {exc}", file=log)
        print(f"kb-nano error: {exc}", file=sys.stderr)
        sys.exit(1)
    for path in written:
        print(f"wrote {path}", file=log)
