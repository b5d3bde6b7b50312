"""The ``kb_nano`` command line: a front for the Snakemake workflow.

Each command turns its flags into Snakemake targets and ``--config`` overrides and runs
the same DAG as ``snakemake --cores all`` (never a second code path), then prints the
merged results. Arguments after ``--`` go to Snakemake unchanged
(``kb_nano kernels -- --profile profiles/slurm``).
"""


def main(argv: list[str] | None = None) -> int:
    """The ``kb_nano`` entry point (``pyproject.toml``'s script): :func:`kb_nano.cli.parser.main`,
    imported when called so that importing a submodule (``kb_nano.cli.flags``) does not
    import every command's module and no submodule imports this package back.
    Returns the process exit status."""
    from kb_nano.cli.parser import main as parser_main

    return parser_main(argv)
