"""Snakemake adapter: plots of the merged kernel results (see kb_nano.tracking.plots and
kb_nano.tracking.perf_plots)."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

from pathlib import Path

from kb_nano.tracking import read_parquet_rows
from kb_nano.tracking.plots import kernel_plots

rows = read_parquet_rows(Path(snakemake.input.parquet))
out = snakemake.output
kernel_plots(rows, Path(out.speedup), Path(out.bandwidth), Path(out.perf_time), Path(out.perf_gbs))
with open(snakemake.log[0], "w") as log:
    print(f"{snakemake.params.tier}: plotted {len(rows)} rows -> {', '.join(out)}", file=log)
