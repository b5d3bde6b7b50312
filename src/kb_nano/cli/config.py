"""The CLI's config: the embedded default and ``--configfile`` layered with the flags, and the checks that give bad input one line before Snakemake starts."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from kb_nano import gpus, operators
from kb_nano import workflow as kbw
from kb_nano.cli import flags
from kb_nano.config import first_error, load
from kb_nano.errors import KbNanoError, did_you_mean
from kb_nano.files import OUTPUT_DIRS, blocking_file, check_dirs, not_a_directory


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def base_config(root: Path, configfile: str | None) -> dict:
    """The effective config before the flags: ``config/config.yaml`` updated with
    ``--configfile`` as Snakemake layers them, every other key at its schema default
    (:func:`kb_nano.config.load`). Raises ``KbNanoError`` for an unreadable config file."""
    return load(root, configfile)


def select_models(requested: list[str], configured: list[str], root: Path) -> list[str]:
    """Model specs for a run: each requested value keeps the configured models whose key
    starts with it (``llama31`` -> ``llama31-8b``; a note on stderr names the models a
    prefix chose); a value matching none is resolved on its own (key, vendored Hub id or
    path). Raises ``KbNanoError`` for an unknown model."""
    from kb_nano.models.configs import resolve

    keys = {spec: resolve(spec, root).key for spec in configured}
    chosen: list[str] = []
    # Paths on the command line are relative to the user's directory, not the workflow root.
    requested = [
        str(Path(w).resolve()) if Path(w).exists() and not (root / "config/models" / w).exists() else w
        for w in requested
    ]
    for want in requested:
        hits = [spec for spec, key in keys.items() if key.startswith(want) or spec == want]
        if not hits:
            resolve(want, root)
            hits = [want]
        elif want not in hits and want not in [keys[h] for h in hits]:  # a prefix: say what it chose
            chosen_keys = ", ".join(keys[h] for h in hits)
            print(f"note: --model {want} selects the configured {chosen_keys} (key prefix)", file=sys.stderr)
        chosen += [h for h in hits if h not in chosen]
    return chosen


def config_overrides(args, root: Path, base: dict) -> dict:
    """The top-level config keys the flags of ``kernels`` / ``generate-inputs`` set
    (:data:`kb_nano.cli.flags.KERNELS`; ``--model`` through :func:`select_models`).
    Raises ``KbNanoError`` for an unknown target, category or model."""
    cfg = flags.given(args, flags.KERNELS)
    if "models" in cfg:
        cfg["models"] = select_models(cfg["models"], base["models"], root)
    for name in cfg.get("targets", []):
        operators.check_target(name, where="--target")
    categories = sorted({e.category for e in operators.CATALOG.values()})
    for cat in cfg.get("categories", []):
        if cat not in categories:
            raise KbNanoError(f"--category: unknown category {cat!r}; known: {', '.join(categories)}")
    return cfg


def preflight(root: Path, base: dict, overrides: dict, source: str, dry_run: bool = False) -> dict:
    """Check the effective config before Snakemake starts, so bad input gets one line:
    schema (``workflow/schemas/config.schema.yaml``), targets/categories, candidate files,
    models, output paths of every tier, files where kb-nano writes directories
    (:func:`kb_nano.files.check_dirs`), a GPU for ``cuda`` (not needed for a ``dry_run``).
    Returns the effective config. Raises ``KbNanoError``."""
    config = {**base, **overrides}
    error = first_error(config, root)
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        key = error.absolute_path[0] if error.absolute_path else None
        origin = flags.FLAG_FOR_KEY.get(key, key) if key in overrides else source
        hint = ""
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = (error.schema or {}).get("properties") or {}
            unknown = [k for k in error.instance if k not in allowed]
            hint = did_you_mean(unknown[0], allowed) if unknown else ""
        if error.validator == "type" and isinstance(error.instance, str):
            with contextlib.suppress(ValueError):
                float(error.instance)
                hint = f" (YAML reads {error.instance} as a string; write it with a decimal point, e.g. 5.0e3)"
        raise KbNanoError(f"{origin}: {where}: {error.message}{hint}")
    try:
        kbw.check_config(config)
    except KbNanoError as exc:  # "config KEY: ..." -> the flag or the file that set KEY
        message = str(exc).removeprefix("config ")
        key = message.split(":", 1)[0].split(".")[0]
        raise KbNanoError(f"{flags.FLAG_FOR_KEY.get(key, key) if key in overrides else source}: {message}") from None
    kbw.candidates(root, config)
    kbw.model_config_files(root, config)
    if str(config["device"]).startswith("cuda") and not gpus.pool():
        raise KbNanoError(f"device {config['device']!r}: no NVIDIA GPU is visible here; use --device auto or cpu")
    check_dirs(root, OUTPUT_DIRS)  # a file named like one of them: one line, before anything is written
    for tier, where in (("kernels", config), ("e2e", config["e2e"]), ("eval", config["eval"])):
        _check_output_json(root, where["output_json"], tier, config)
    for section in ("e2e", "eval"):
        dev = (overrides.get(section) or {}).get("device")
        if dev == "cuda" and not gpus.pool() and not dry_run:  # planning needs no GPU
            raise KbNanoError("--device cuda: no NVIDIA GPU is visible here; use --device auto or cpu")
    from kb_nano.tracking import check_reachable, is_server, resolve_tracking_uri

    uri = resolve_tracking_uri(root, config)
    if is_server(uri):
        check_reachable(uri)
    return config


def _check_output_json(root: Path, output_json: str, tier: str = "kernels", config: dict | None = None) -> None:
    """The merged JSON of ``tier`` must land in a writable place that no other output
    uses: not a file of the workflow itself (only under ``results/`` or outside the
    workflow directory), not another tier's JSON or any Parquet/manifest/MLflow output,
    not a directory. Raises ``KbNanoError`` (one line)."""
    path = Path(output_json) if Path(output_json).is_absolute() else root / output_json
    real, results = path.resolve(), (root / "results").resolve()
    others = {
        t: (c or {}).get("output_json")
        for t, c in (("kernels", config), ("e2e", (config or {}).get("e2e")), ("eval", (config or {}).get("eval")))
        if t != tier
    }
    reserved = {root / f"results/{t}.parquet" for t in ("kernels", "e2e", "eval")}
    reserved |= {root / o for o in others.values() if o}
    reserved |= {root / f"results/{t}.json" for t in ("kernels", "e2e", "eval") if t != tier}
    owned = ("mlflow", "inputs", "golden", "kernels", "e2e", "eval", "logs", "plots", "mlflow-artifacts", ".locks")
    if real in {p.resolve() for p in reserved} or any(
        (results / d) == real or (results / d) in real.parents for d in owned
    ):
        raise KbNanoError(f"--output-json {output_json}: that path belongs to another kb-nano output; pick another")
    if root.resolve() in real.parents and results not in real.parents:
        raise KbNanoError(
            f"--output-json {output_json}: inside the workflow directory but not under results/; "
            "it could overwrite a workflow file; pick a path under results/ or outside the workflow"
        )
    if path.is_dir():
        raise KbNanoError(f"--output-json {output_json}: is a directory; give a file path ending in .json")
    blocker = blocking_file(path.parent)
    if blocker is not None:
        raise KbNanoError(f"--output-json {output_json}: {not_a_directory(blocker, root)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KbNanoError(
            f"--output-json {output_json}: {path.parent} is not writable ({exc.strerror}); pick another path"
        ) from None
    if not os.access(path.parent, os.W_OK):
        raise KbNanoError(f"--output-json {output_json}: {path.parent} is not writable; pick another path")
    if "{" in output_json or "}" in output_json:
        raise KbNanoError(f"--output-json {output_json}: braces are Snakemake wildcards; use a plain path")
