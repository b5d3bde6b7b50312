"""The ``kb_nano`` command line: a front for the Snakemake workflow.

Each command turns its flags into Snakemake targets and ``--config`` overrides and runs
the same DAG as ``snakemake --cores all`` (never a second code path), then prints the
merged results. Arguments after ``--`` go to Snakemake unchanged
(``kb_nano kernels -- --profile profiles/slurm``).
"""


def main(argv: list[str] | None = None) -> int:
    """The ``kb_nano`` entry point (``pyproject.toml``'s script): :func:`kb_nano.cli.parser.main`,
    imported when called so that importing a submodule does not import every command's
    module and no submodule imports this package back. Returns the process exit status.
    Called as the command (``argv`` None), it quiets a signal during its imports
    (:func:`kb_nano.interrupts.quiet_while_importing`) and ends past daemon threads
    (:func:`kb_nano.interrupts.end_past_daemon_threads`)."""
    from kb_nano.interrupts import end_past_daemon_threads, quiet_while_importing

    if argv is None:
        quiet_while_importing()
    from kb_nano.cli.parser import main as parser_main

    code = parser_main(argv)
    if argv is None:
        end_past_daemon_threads(code)
    return code
