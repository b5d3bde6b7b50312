"""Snakemake adapter: merge kernel shards into results/kernels.parquet and the JSON."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

from pathlib import Path

from kb_nano.kernels.manifest import load
from kb_nano.kernels.merge import merge
from kb_nano.kernels.signing import key

scenarios = {s["scenario_id"]: s for s in load(Path(snakemake.input.manifest))["scenarios"]}
not_applicable = [(scenarios[sid], cid) for sid, cid in snakemake.params.not_applicable]
rows = merge(
    [Path(p) for p in snakemake.input.shards],
    not_applicable,
    Path(snakemake.output.parquet),
    Path(snakemake.output.json),
    scenarios,
    secret=key(Path(".")),
)
with open(snakemake.log[0], "w") as log:
    print(
        f"merged {len(snakemake.input.shards)} shards + {len(not_applicable)} not-applicable rows = {len(rows)} rows",
        file=log,
    )
