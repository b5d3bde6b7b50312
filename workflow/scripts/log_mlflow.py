"""Snakemake adapter: log one merged result set as an MLflow run (see kb_nano.tracking).

The only MLflow writer of the workflow; idempotent (a run per digest of its inputs)."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

import json
import sys
from pathlib import Path

from kb_nano.errors import KbNanoError
from kb_nano.tracking import log_e2e, log_kernels

with open(snakemake.log[0], "w") as log:
    tier = snakemake.params.tier
    try:
        common = dict(
            parquet=Path(snakemake.input.parquet),
            json_path=Path(snakemake.input.json),
            tracking_uri=snakemake.params.tracking_uri,
            root=Path.cwd(),
            config=dict(snakemake.params.config),
            marker=Path(snakemake.output[0]),
        )
        if tier == "kernels":
            record = log_kernels(
                **common,
                manifest=Path(snakemake.input.manifest),
                manifest_digest=snakemake.params.manifest_digest,
                plots=[Path(p) for p in snakemake.input.plots],
                tables=[Path(p) for p in snakemake.input.table],
            )
        else:
            record = log_e2e(**common, tier=tier)
    except KbNanoError as exc:
        print(f"error: {exc}", file=log)
        print(f"kb-nano error: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # e.g. a corrupt SQLite store: say so in one line; the rows are kept
        import traceback

        traceback.print_exc(file=log)
        first = " ".join(str(exc).split())[:200]
        print(
            f"kb-nano error: MLflow logging failed ({type(exc).__name__}: {first}); the merged results are "
            f"kept; check the store {snakemake.params.tracking_uri} (details: {snakemake.log[0]})",
            file=sys.stderr,
        )
        sys.exit(1)
    where = f"{record['experiment']} ({record['tracking_uri']})"
    if record.get("recorded_in"):
        runs = ", ".join(h["run_id"] for h in record["recorded_in"])
        print(f"nothing new measured, no run created: every row is already in {runs} in {where}", file=log)
    else:
        what = "created run" if record["created"] else "unchanged inputs; kept run"
        print(f"{what} {record['run_id']} in {where}", file=log)
    print(json.dumps(record, sort_keys=True), file=log)
