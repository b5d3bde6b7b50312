"""The ``kb_nano`` command line: a front for the Snakemake workflow.

Each command turns its flags into Snakemake targets and ``--config`` overrides and runs
the same DAG as ``snakemake --cores all`` (never a second code path), then prints the
merged results. Arguments after ``--`` go to Snakemake unchanged
(``kb_nano kernels -- --profile profiles/slurm``).
"""

from kb_nano.cli.parser import build_parser, main  # noqa: F401
