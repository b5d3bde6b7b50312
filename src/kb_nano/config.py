"""The workflow's effective config, as the Snakefile sees it: ``config/config.yaml`` (the
embedded run's selection) updated with a ``--configfile``, every other key filled from its
``default:`` in ``workflow/schemas/config.schema.yaml`` (the one place of each key's default
and description). Torch-free; the CLI, the tests and anything else that needs the
effective config call :func:`load`."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

from kb_nano.errors import KbNanoError

DEFAULT_CONFIG = Path("config/config.yaml")
SCHEMA_FILE = Path("workflow/schemas/config.schema.yaml")


def read_yaml(path: Path) -> dict:
    """The mapping of a YAML config file. Raises ``KbNanoError`` (one line naming ``path``)
    when it is missing, unreadable, not YAML or not a mapping."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise KbNanoError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
        raise KbNanoError(f"{path}: cannot read the config file ({type(exc).__name__}: {why})") from None
    except yaml.YAMLError as exc:
        raise KbNanoError(f"{path}: not valid YAML ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(data, dict):
        raise KbNanoError(f"{path}: must be a YAML mapping of config keys (see {SCHEMA_FILE})")
    return data


@functools.lru_cache(maxsize=8)
def _schema(path: Path, mtime_ns: int) -> dict:
    return yaml.safe_load(path.read_text())


def schema(root: Path) -> dict:
    """The config's JSON schema of the workflow at ``root`` (a fresh copy: filling defaults
    from it never changes the next caller's). Raises ``KbNanoError`` when it is missing."""
    path = Path(root) / SCHEMA_FILE
    try:
        return copy.deepcopy(_schema(path, path.stat().st_mtime_ns))
    except FileNotFoundError:
        raise KbNanoError(f"{path}: the config schema is missing; is {root} a kb-nano checkout?") from None


def _validator(schema_: dict, fill: bool):
    """A Draft 2020-12 validator of ``schema_``; with ``fill``, one that first sets each
    missing property of an object to its ``default:`` and then descends into it (as
    ``snakemake.utils.validate(..., set_default=True)`` does), so a section that is absent
    becomes its default ``{}`` filled key by key."""
    from jsonschema import Draft202012Validator, validators

    if not fill:
        return Draft202012Validator(schema_)
    properties = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator, props, instance, subschema):
        if isinstance(instance, dict):  # (a wrong type is the type check's error, not a crash here)
            for name, sub in props.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from properties(validator, props, instance, subschema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})(schema_)


def fill_defaults(config: dict, root: Path):
    """Set every key missing from ``config`` (in place), nested sections key by key, to its
    schema default. Returns the schema's most relevant error of the filled config
    (``jsonschema.exceptions.ValidationError``), or None when it is valid."""
    from jsonschema.exceptions import best_match

    return best_match(_validator(schema(root), fill=True).iter_errors(config))


def first_error(config: dict, root: Path):
    """The schema's most relevant error of ``config`` as it is (no defaults filled), or None."""
    from jsonschema.exceptions import best_match

    return best_match(_validator(schema(root), fill=False).iter_errors(config))


def error_text(error) -> str:
    """One line for a schema ``error`` (:func:`first_error`): ``<key path>: <message>``,
    with a "did you mean" for each unknown key and, for a number YAML read as a string
    (``5e3``), how to write it."""
    import contextlib

    from kb_nano.errors import did_you_mean

    where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    hint = ""
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = (error.schema or {}).get("properties") or {}
        unknown = [k for k in error.instance if k not in allowed]
        if len(unknown) == 1:
            hint = did_you_mean(unknown[0], allowed)
        else:
            hint = "".join(did_you_mean(k, allowed).replace("did you mean", f"{k}: did you mean") for k in unknown)
    if error.validator == "type" and isinstance(error.instance, str):
        with contextlib.suppress(ValueError):
            float(error.instance)
            hint = f" (YAML reads {error.instance} as a string; write it with a decimal point, e.g. 5.0e3)"
    return f"{where}: {error.message}{hint}"


def check_schema(config: dict, root: Path) -> None:
    """The Snakefile's check before Snakemake's ``validate()``: a config that breaks the
    schema raises ``WorkflowError`` with one line (:func:`error_text`) instead of the
    schema dump ``validate()`` prints."""
    error = first_error(config, root)
    if error is not None:
        from snakemake.exceptions import WorkflowError

        raise WorkflowError(f"config {error_text(error)} (workflow/schemas/config.schema.yaml)")


def defaults(root: Path) -> dict:
    """Every key that has a schema default, at that default (sections filled key by key)."""
    config: dict = {}
    fill_defaults(config, root)
    return config


def load(root: Path, configfile: str | Path | None = None) -> dict:
    """The effective config of the workflow at ``root``: ``config/config.yaml`` updated with
    ``configfile`` as Snakemake layers them (nested sections such as ``e2e``, ``eval`` and
    ``golden`` merged key by key, ``snakemake.utils.update_config``; other keys replaced),
    then every key still missing set to its schema default (:func:`fill_defaults`). Not
    validated: a bad value is left for the caller's check. Raises ``KbNanoError`` for a
    config file that is missing or not a YAML mapping."""
    from snakemake.utils import update_config

    config = read_yaml(Path(root) / DEFAULT_CONFIG)
    if configfile:
        update_config(config, read_yaml(Path(configfile)))
    fill_defaults(config, root)
    return config
