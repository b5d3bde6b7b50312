"""The checks that give a bad effective config one line before any job runs, shared by the
CLI and the Snakefile, so ``kb_nano kernels --configfile bad.yaml`` and ``snakemake
--configfile bad.yaml`` stop on the same message. The CLI calls :func:`check_effective`
before Snakemake starts; ``workflow/rules/common.smk`` calls it while the Snakefile is
parsed, and :func:`check_host` as it plans a tier's jobs in the main Snakemake process
(a cluster job's re-parse runs on a node that needs neither a GPU of its own for
checking nor the MLflow server). Torch-free: this runs at parse time.

Errors about one config key are :class:`~kb_nano.errors.ConfigError` (``config <key>:
...``; the CLI names the flag or file that set the key); the others are
:class:`~kb_nano.errors.KbNanoError` naming their file, model or server."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kb_nano import gpus
from kb_nano import workflow as kbw
from kb_nano.errors import ConfigError
from kb_nano.files import OUTPUT_DIRS, blocking_file, check_dirs, not_a_directory

TIERS = ("kernels", "e2e", "eval")
# directories under results/ that kb-nano's own outputs own: no tier's merged JSON goes there
OWNED_DIRS = ("mlflow", "inputs", "golden", "kernels", "e2e", "eval", "logs", "plots", "mlflow-artifacts", ".locks")


def tier_key(tier: str, key: str) -> str:
    """The config key ``key`` of ``tier``: top-level for ``kernels`` (``output_json``), in the
    tier's section otherwise (``e2e.output_json``)."""
    return key if tier == "kernels" else f"{tier}.{key}"


def tier_value(config: dict, tier: str, key: str):
    """The value of ``key`` of ``tier`` in the effective ``config`` (:func:`tier_key`)."""
    return config[key] if tier == "kernels" else config[tier][key]


def check_effective(root: Path, config: dict, *, tiers: tuple = (), host: bool = False, jobs_here: bool = True) -> None:
    """Check the effective ``config`` of the workflow at ``root`` (schema-valid, defaults
    filled: :func:`kb_nano.config.load`) before any job runs: the filters and finite numbers
    (:func:`kb_nano.workflow.check_config`), the ``candidates`` (each names a file), the
    ``models`` (each resolves, its config.json readable), no file where kb-nano writes a
    directory (:func:`kb_nano.files.check_dirs`) and each tier's ``output_json``
    (:func:`check_output_json`). With ``host`` also what this host must provide for the
    ``tiers`` it runs (:func:`check_host`). Raises ``ConfigError`` / ``KbNanoError`` (one
    line) at the first problem."""
    kbw.check_config(config)
    kbw.candidates(root, config)
    kbw.model_config_files(root, config)
    check_dirs(root, OUTPUT_DIRS)  # a file named like one of them: one line, before anything is written
    for tier in TIERS:
        check_output_json(root, config, tier)
    if host:
        for tier in tiers:
            check_host(root, config, tier, jobs_here=jobs_here)


def check_host(root: Path, config: dict, tier: str, *, jobs_here: bool = True) -> None:
    """What the host that runs ``tier`` (``kernels``, ``e2e`` or ``eval``) must provide: a
    visible NVIDIA GPU (:func:`kb_nano.gpus.pool`) when the tier's ``device`` is ``cuda``
    and its jobs run here (``jobs_here`` False: a dry run, or jobs submitted to a
    cluster), and an answering MLflow tracking server when the store is one (the tier's
    log rule writes to it: :func:`kb_nano.tracking.store.check_reachable`). Raises
    ``ConfigError`` (key ``device`` / ``<tier>.device``) or ``KbNanoError``."""
    from kb_nano.tracking.store import check_reachable, is_server, resolve_tracking_uri

    device = str(tier_value(config, tier, "device"))
    cuda = device.startswith("cuda") if tier == "kernels" else device == "cuda"
    if cuda and jobs_here and not gpus.pool():
        raise ConfigError(tier_key(tier, "device"), f"{device}: no NVIDIA GPU is visible here; use auto or cpu")
    uri = resolve_tracking_uri(root, config)
    if is_server(uri):
        check_reachable(uri)


def check_output_json(root: Path, config: dict, tier: str) -> None:
    """The merged JSON of ``tier`` (its ``output_json``, relative to ``root`` unless
    absolute) must land in a writable place that no other output uses: not a file of the
    workflow itself (only under ``results/`` or outside the workflow directory), not
    another tier's JSON or any Parquet/manifest/MLflow output, not a directory, no
    Snakemake wildcard braces. Creates its parent directory. Raises ``ConfigError`` (key
    ``output_json`` / ``<tier>.output_json``, the detail led by the path)."""
    output_json = str(tier_value(config, tier, "output_json"))
    key = tier_key(tier, "output_json")
    path = Path(output_json) if Path(output_json).is_absolute() else root / output_json
    real, results = path.resolve(), (root / "results").resolve()
    reserved = {root / f"results/{t}.parquet" for t in TIERS}
    reserved |= {root / str(other) for t in TIERS if t != tier and (other := tier_value(config, t, "output_json"))}
    reserved |= {root / f"results/{t}.json" for t in TIERS if t != tier}
    if real in {p.resolve() for p in reserved} or any(
        (results / d) == real or (results / d) in real.parents for d in OWNED_DIRS
    ):
        raise ConfigError(key, f"{output_json}: that path belongs to another kb-nano output; pick another")
    if root.resolve() in real.parents and results not in real.parents:
        raise ConfigError(
            key,
            f"{output_json}: inside the workflow directory but not under results/; "
            "it could overwrite a workflow file; pick a path under results/ or outside the workflow",
        )
    if path.is_dir():
        raise ConfigError(key, f"{output_json}: is a directory; give a file path ending in .json")
    blocker = blocking_file(path.parent)
    if blocker is not None:
        raise ConfigError(key, f"{output_json}: {not_a_directory(blocker, root)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            key, f"{output_json}: {path.parent} is not writable ({exc.strerror}); pick another path"
        ) from None
    try:  # a file made and removed: os.access says yes to root on /proc or a read-only mount
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            key, f"{output_json}: cannot create a file in {path.parent} ({exc.strerror}); pick another path"
        ) from None
    if "{" in output_json or "}" in output_json:
        raise ConfigError(key, f"{output_json}: braces are Snakemake wildcards; use a plain path")
