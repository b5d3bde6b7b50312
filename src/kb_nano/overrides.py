"""The config override of one ``kb_nano`` invocation: the values of its flags
(:mod:`kb_nano.flags`) as config keys, the models ``--model`` selects, and the preflight
that gives bad input one line before Snakemake starts, naming the flag or the config file
that set a bad key."""

from __future__ import annotations

import sys
from pathlib import Path

from kb_nano import flags, operators
from kb_nano.checks import check_effective
from kb_nano.config import DEFAULT_CONFIG, error_text, first_error
from kb_nano.errors import ConfigError, KbNanoError, did_you_mean


def user_paths(specs: list[str], root: Path) -> list[str]:
    """``--model`` values as the workflow reads them: one that exists relative to the
    user's directory but not to the workflow's (nor its ``config/models``) is a path the
    user typed, made absolute; keys, Hub ids and workflow-relative paths stay as given."""
    here = [Path(s) for s in specs]
    return [
        str(p.resolve()) if p.exists() and not (root / p).exists() and not (root / "config/models" / p).exists() else s
        for p, s in zip(here, specs, strict=True)
    ]


def select_models(requested: list[str], configured: list[str], root: Path, where: str = "config") -> list[str]:
    """Model specs for a run: each requested value keeps the configured models whose key
    starts with it (``llama31`` -> ``llama31-8b``; a note on stderr names the models a
    prefix chose); a value matching none is resolved on its own (key, vendored Hub id or
    path). Raises ``KbNanoError`` for an unknown model, or ``configured`` (the ``models`` of
    the config file ``where``) not a list of names."""
    from kb_nano.models.configs import resolve

    if not isinstance(configured, list) or not all(isinstance(spec, str) for spec in configured):
        shown = str(configured)[:60]
        raise KbNanoError(f"{where}: models: {shown} is not a list of model names (keys, Hub ids or config paths)")
    keys = {spec: resolve(spec, root).key for spec in configured}
    chosen: list[str] = []
    for want in user_paths(requested, root):
        hits = [spec for spec, key in keys.items() if key.startswith(want) or spec == want]
        if not hits:
            resolve(want, root)
            hits = [want]
        elif want not in hits and want not in [keys[h] for h in hits]:  # a prefix: say what it chose
            chosen_keys = ", ".join(keys[h] for h in hits)
            print(f"note: --model {want} selects the configured {chosen_keys} (key prefix)", file=sys.stderr)
        chosen += [h for h in hits if h not in chosen]
    return chosen


def section(args, table, root: Path) -> dict:
    """The keys of a config section (``e2e``, ``eval``) that the flags of ``table`` given
    in ``args`` set (:func:`kb_nano.flags.given`), ``--model`` values as the workflow reads
    them (:func:`user_paths`)."""
    out = flags.given(args, table)
    if args.model:
        out["models"] = user_paths(args.model, root)
    return out


def config_overrides(args, root: Path, base: dict) -> dict:
    """The top-level config keys the flags of ``kernels`` / ``generate-inputs`` set
    (:data:`kb_nano.flags.KERNELS`; ``--model`` through :func:`select_models`).
    Raises ``KbNanoError`` for an unknown target, category or model."""
    cfg = flags.given(args, flags.KERNELS)
    if "models" in cfg:
        cfg["models"] = select_models(cfg["models"], base["models"], root, args.configfile or str(DEFAULT_CONFIG))
    for name in cfg.get("targets", []):
        operators.check_target(name, where="--target")
    categories = sorted({e.category for e in operators.CATALOG.values()})
    for cat in cfg.get("categories", []):
        if cat not in categories:
            raise KbNanoError(
                f"--category: unknown category {cat!r}{did_you_mean(cat, categories)}; known: {', '.join(categories)}"
            )
    return cfg


def preflight(
    root: Path, base: dict, overrides: dict, source: str | None, dry_run: bool = False, tier: str = "kernels"
) -> dict:
    """Check the effective config (``base`` with the flags' ``overrides``) before Snakemake
    starts, so bad input gets one line: the schema (``workflow/schemas/config.schema.yaml``),
    then the checks the Snakefile runs too (:func:`kb_nano.checks.check_effective`: filters,
    candidates, models, files where kb-nano writes directories, every tier's output path;
    for ``tier``, a GPU for ``cuda`` unless ``dry_run``, and the MLflow server). An error
    about a config key names the flag that set it, else the config file ``source``
    (``--configfile``; None: the embedded ``config/config.yaml``). Returns the effective config. Raises ``KbNanoError``."""
    config = {**base, **overrides}
    source = source or str(DEFAULT_CONFIG)
    error = first_error(config, root)
    if error is not None:
        key = error.absolute_path[0] if error.absolute_path else None
        origin = flags.FLAG_FOR_KEY.get(key, key) if key in overrides else source
        raise KbNanoError(f"{origin}: {error_text(error)}")
    try:
        check_effective(root, config, tiers=(tier,), host=True, jobs_here=not dry_run)
    except ConfigError as exc:  # "config KEY: DETAIL" -> the flag or the file that set KEY
        flag = _flag_that_set(exc.key, base, overrides)
        raise KbNanoError(f"{flag} {exc.detail}" if flag else f"{source}: {exc.key}: {exc.detail}") from None
    return config


def _flag_that_set(key: str, base: dict, overrides: dict) -> str | None:
    """The flag that set the dotted config ``key`` in ``overrides`` (a section's key when
    the override changed it from ``base``, the whole section being an override), or None
    when the config file set it."""
    top, _, rest = key.partition(".")
    if top not in overrides:
        return None
    if rest:
        given, before = overrides[top], base.get(top)
        for part in rest.split("."):
            given = given.get(part) if isinstance(given, dict) else None
            before = before.get(part) if isinstance(before, dict) else None
        if given == before:
            return None
    return flags.FLAG_FOR_KEY.get(key, key)
