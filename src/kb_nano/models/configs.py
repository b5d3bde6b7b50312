"""Model references: short keys, vendored Hugging Face configs, local paths.

A model is named in ``config.yaml`` or on the command line by
- a short key from ``config/models/models.yaml`` (``llama31-8b``) or a unique prefix of one,
- a Hugging Face Hub id whose ``config.json`` is vendored under ``config/models/{hub_id}/``,
- a local directory holding ``config.json``, or a path to a ``config.json`` file
  (a relative path is relative to the workflow root).
Configs are loaded with ``transformers.AutoConfig`` so any real config file works; the
Hub itself is never contacted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from kb_nano.errors import KbNanoError, did_you_mean

MODELS_DIR = Path("config/models")
INDEX_FILE = MODELS_DIR / "models.yaml"
_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: its short ``key`` (used in scenario ids), the Hub id if known,
    and the path of its ``config.json`` (relative to the workflow root when vendored)."""

    key: str
    hub_id: str | None
    config_path: Path


def load_index(root: Path) -> dict[str, str]:
    """Read ``config/models/models.yaml`` under ``root``: short key -> Hub id.

    Raises ``KbNanoError`` if the file is missing or malformed.
    """
    path = root / INDEX_FILE
    try:
        index = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise KbNanoError(f"{path}: missing; it maps model keys to Hub ids (restore it from git)") from None
    except yaml.YAMLError as exc:
        raise KbNanoError(f"{path}: not valid YAML ({_one_line(exc)})") from None
    if not isinstance(index, dict) or not all(isinstance(v, str) for v in index.values()):
        raise KbNanoError(f"{path}: must map each short key to a Hub id string")
    for key in index:
        if not _KEY_RE.match(str(key)) or "__" in str(key):
            raise KbNanoError(f"{path}: key {key!r} must be lowercase letters, digits, '.' and '-'")
    return {str(k): v for k, v in index.items()}


def slug(name: str) -> str:
    """Turn a directory or Hub name into a model key (``Llama-3.1-8B`` -> ``llama-3.1-8b``)."""
    key = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.")
    return key or "model"


def resolve(spec: str, root: Path) -> ModelRef:
    """Resolve one model spec (key, key prefix, vendored Hub id, directory or config.json;
    relative paths are relative to ``root``).

    Raises ``KbNanoError`` naming the spec and the accepted forms when nothing matches,
    or listing the matches when a key prefix is ambiguous.
    """
    index = load_index(root)
    if spec in index:
        return _vendored(spec, index[spec], root)
    by_hub = {hub: key for key, hub in index.items()}
    if spec in by_hub:
        return _vendored(by_hub[spec], spec, root)
    prefixed = sorted(k for k in index if k.startswith(spec))
    if len(prefixed) == 1:
        return _vendored(prefixed[0], index[prefixed[0]], root)
    if len(prefixed) > 1:
        raise KbNanoError(f"model {spec!r} is ambiguous: matches {', '.join(prefixed)}; give a longer key")
    # A relative path is taken from the workflow root, as load_config/config_sha256 read it
    # and as the workflow (which runs in the root) sees it.
    path = Path(spec)
    local = path if path.is_absolute() else root / path
    if local.is_dir() and (local / "config.json").is_file():
        return ModelRef(slug(local.resolve().name), None, path / "config.json")
    if local.is_file() and local.suffix == ".json":
        name = local.resolve().parent.name if local.name == "config.json" else local.stem
        return ModelRef(slug(name), None, path)
    vendored = root / MODELS_DIR / spec / "config.json"
    if vendored.is_file():
        return ModelRef(slug(spec.split("/")[-1]), spec, vendored.relative_to(root))
    if spec.endswith(".json") or spec.startswith(("/", "./", "../", "~")):  # meant as a path
        raise KbNanoError(f"model {spec!r}: no such file; give a config.json or a directory holding one")
    raise KbNanoError(
        f"unknown model {spec!r}{did_you_mean(spec, [*index, *by_hub])}: use a key from {INDEX_FILE} ({', '.join(sorted(index))}), "
        f"a Hub id vendored under {MODELS_DIR}/, or a path to a config.json or its directory"
    )


def _vendored(key: str, hub_id: str, root: Path) -> ModelRef:
    path = MODELS_DIR / hub_id / "config.json"
    if not (root / path).is_file():
        raise KbNanoError(f"{INDEX_FILE}: {key} -> {hub_id}, but {path} does not exist; vendor its config.json")
    return ModelRef(key, hub_id, path)


REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def check_config_file(ref: ModelRef, root: Path) -> None:
    """Cheap check (no transformers import) that the model's config.json parses as a JSON
    object with ``model_type``, the fields shapes come from, and sane shape values
    (:func:`check_shape_fields`). Raises ``KbNanoError`` naming the file otherwise."""
    path = ref.config_path if ref.config_path.is_absolute() else root / ref.config_path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KbNanoError(f"{path}: not a readable JSON config ({_one_line(exc)})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise KbNanoError(f"{path}: not a Hugging Face config.json (no 'model_type' field)")
    # transformers fills absent fields with its defaults (hidden_size 4096 for Llama):
    # shapes must come from the file itself.
    # A multimodal file's text_config lists only the fields that differ from its text
    # config class's defaults (Gemma-3's has no head counts or vocab_size): there the
    # defaults are the model's, as the Hub file relies on them.
    # GPT-2's n_embd / n_head / n_layer, MPT's d_model / n_heads: names of the config class's
    # attribute_map (:func:`field_aliases`, looked up only when a standard name is absent)
    missing = [] if isinstance(data.get("text_config"), dict) else [k for k in REQUIRED_FIELDS if k not in data]
    aliases = field_aliases(data["model_type"]) if missing else {}
    missing = [k for k in missing if aliases.get(k) not in data]
    if missing:
        raise KbNanoError(f"{path}: field(s) {', '.join(missing)} missing; kb-nano derives shapes from them")
    for fields in (data, data.get("text_config")):
        if isinstance(fields, dict):
            check_shape_fields(fields, path, aliases)


@functools.cache
def field_aliases(model_type) -> dict[str, str]:
    """The ``attribute_map`` of the transformers config class of ``model_type``: a standard
    field name -> the name its config.json uses (GPT-2: ``hidden_size`` -> ``n_embd``; MPT,
    DBRX: ``d_model``, ``n_heads``), as the config object resolves them; ``{}`` for a
    ``model_type`` transformers does not know. Imports transformers (its config classes)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return {}
    return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})


def check_unique_keys(refs: list[ModelRef]) -> None:
    """Raise ``KbNanoError`` when two of ``refs`` have one key (two local config folders
    of one name): their scenario ids would collide."""
    keys = [r.key for r in refs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        same = "; ".join(f"{k}: {', '.join(str(r.config_path) for r in refs if r.key == k)}" for k in dupes)
        raise KbNanoError(
            f"config models: more than one model has the key {', '.join(dupes)} ({same}); a local config's key "
            "is its folder name: rename one folder"
        )


# fields of a multimodal checkpoint's top level its text decoder inherits when its
# ``text_config`` does not set them
TEXT_INHERITS = ("architectures", "torch_dtype", "dtype", "tie_word_embeddings")


def config_fields(ref: ModelRef, root: Path) -> dict:
    """The fields of a model's config.json as a plain dict (what ``AutoConfig`` reads). For a
    multimodal checkpoint (a ``text_config``: Gemma-3, Llama-4) the text decoder's fields,
    which kb-nano measures, as transformers fills them (:func:`load_config`, defaults and
    :data:`TEXT_INHERITS` included)."""
    path = ref.config_path if ref.config_path.is_absolute() else root / ref.config_path
    data = json.loads(path.read_text())
    if not isinstance(data.get("text_config"), dict):
        return data
    # the text_config of a multimodal file lists only non-default fields (Gemma-3 has no
    # vocab_size there): the text config transformers builds from it holds them all
    return load_config(ref, root).to_dict()


# Packages transformers imports when installed although reading a config needs neither:
# torchvision (its ops import torch._dynamo) through transformers' image and video utilities,
# scikit-learn through its generation utilities. docs/measured.md has what they cost.
OPTIONAL_IMPORTS = ("torchvision", "sklearn")


@contextlib.contextmanager
def config_imports_only():
    """Within this block a first ``import transformers`` sees :data:`OPTIONAL_IMPORTS` as not
    installed (``sys.modules[name] = None``, which ``importlib.util.find_spec`` reads as
    absent), so loading configs and building modules on the meta device does not import
    them. transformers caches its availability checks, so the process keeps that view of
    them afterwards; the names are importable again after the block. Does nothing when
    transformers is imported already. For processes that only read configs (the manifest's
    generation); never around code that needs image processors."""
    if "transformers" in sys.modules:
        yield
        return
    hidden = [name for name in OPTIONAL_IMPORTS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


@contextlib.contextmanager
def quiet_transformers():
    """Within this block transformers logs errors only: its warnings about config fields
    kb-nano does not use (generation flags such as ``cache_implementation``, the
    ``torch_dtype`` key of older config.json files) stay off the terminal while configs are
    read and models built on the meta device. The verbosity is restored after."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_config(ref: ModelRef, root: Path):
    """Load the ``transformers`` config of ``ref`` with ``AutoConfig`` (no network); for a
    multimodal checkpoint its text decoder's config (``get_text_config()``, with
    :data:`TEXT_INHERITS` from the top level).

    Raises ``KbNanoError`` when the file is not a loadable Hugging Face config, or a shape
    field's value is not a positive integer (:func:`check_shape_fields`).
    """
    from transformers import AutoConfig

    path = ref.config_path if ref.config_path.is_absolute() else root / ref.config_path
    file = path if path.name == "config.json" else path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        data = None  # AutoConfig reports it
    if isinstance(data, dict):
        for fields in (data, data.get("text_config")):
            if isinstance(fields, dict):
                check_shape_fields(fields, file, field_aliases(fields.get("model_type")))
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path))
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for bad files
        raise KbNanoError(f"{path}: not a loadable Hugging Face config.json ({_one_line(exc)})") from None
    text = config.get_text_config()
    if text is not config:  # a multimodal checkpoint: its text decoder (config_fields)
        with quiet_transformers():  # TEXT_INHERITS reads the deprecated torch_dtype
            for name in TEXT_INHERITS:
                if getattr(text, name, None) is None and getattr(config, name, None) is not None:
                    setattr(text, name, getattr(config, name))
    return text


def config_sha256(ref: ModelRef, root: Path) -> str:
    """SHA-256 of the model's config.json bytes (recorded in the manifest)."""
    path = ref.config_path if ref.config_path.is_absolute() else root / ref.config_path
    return hashlib.sha256(path.read_bytes()).hexdigest()


# The integer fields the operators' shapes come from: each must be a positive integer
# when the config sets it (missing required ones are reported by model_facts itself).
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
# expert counts: 0 means a dense model (kb_nano.operators.moe.num_experts)
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts")


def check_shape_fields(fields: dict, path: Path, aliases: dict[str, str] | None = None) -> None:
    """Every field of :data:`SHAPE_FIELDS` that ``fields`` (a config.json's object, or its
    ``text_config``) sets to a value other than null is a positive integer, and every one
    of :data:`EXPERT_COUNT_FIELDS` a non-negative one (``true`` is not an integer here), and
    every ``rope_theta`` / ``factor`` (top level, ``rope_parameters``, ``rope_scaling``) a
    positive number.
    Raises ``KbNanoError`` naming ``path``, the field, its value and what is expected: a
    head count of -4 or 0 would otherwise fail later as a traceback inside an operator's
    shape rule, or inside transformers. ``aliases`` (:func:`field_aliases`): a field is
    checked under the name the config class maps it to as well (GPT-2's ``n_embd``)."""
    aliases = aliases or {}
    for names, least, what in ((SHAPE_FIELDS, 1, "a positive integer"), (EXPERT_COUNT_FIELDS, 0, "an integer >= 0")):
        for field in (f for name in names for f in (name, aliases.get(name)) if f):
            value = fields.get(field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise KbNanoError(f"{path}: field {field!r} is {json.dumps(value)}; expected {what}")
    # rotary numbers, at the top level or in rope_parameters / rope_scaling (per layer type too)
    rope = [(k, fields) for k in ("rope_parameters", "rope_scaling") if isinstance(fields.get(k), dict)]
    places = [("", fields)] + [(f"{k}.", d) for k, d in rope]
    places += [(f"{k}.{t}.", v) for k, d in rope for t, v in d.items() if isinstance(v, dict)]
    for prefix, where in places:
        for field in ("rope_theta", "factor"):
            value = where.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise KbNanoError(
                    f"{path}: field {prefix + field!r} is {json.dumps(value)}; expected a positive number"
                )


def model_facts(config, ref: ModelRef) -> dict:
    """The kernel-relevant facts of a ``transformers`` config as a plain dict.

    Keys: architecture, model_type, dtype (e.g. ``bfloat16``), hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
    rms_norm_eps, hidden_act, max_position_embeddings, num_hidden_layers, rope
    (``rope_parameters`` of transformers 5: rope_type, rope_theta and scaling fields),
    partial_rotary_factor, tie_word_embeddings. ``head_dim`` falls back to
    hidden_size / num_attention_heads as in the transformers Llama code.
    ``intermediate_size`` and ``rms_norm_eps`` are None where the config has none (GPT-NeoX,
    Falcon: the operators that need them then say ``not covered``; the norms read their
    eps from the model's own norm modules first), and ``max_position_embeddings`` where the
    model has no position limit (Bloom, MPT: ALiBi). Every field is read through the config
    object, so the names of its class's ``attribute_map`` count (GPT-2's ``n_embd``,
    ``n_positions``; MPT's ``d_model``). Raises ``KbNanoError`` naming a required
    field the config lacks (its values were checked by :func:`load_config`).
    """

    def need(field):
        value = getattr(config, field, None)
        if value is None:
            raise KbNanoError(f"{ref.config_path}: field {field!r} is missing; kb-nano needs it to derive shapes")
        return value

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    try:
        head_dim = getattr(config, "head_dim", None) or hidden // heads
    except Exception as exc:  # (Gemma-4: a head_dim per layer type, ambiguous at the top level)
        raise KbNanoError(
            f"{ref.config_path}: not supported: transformers gives no single head_dim ({type(exc).__name__})"
        ) from None
    dtype = getattr(config, "dtype", None) or "bfloat16"  # (transformers 5: torch_dtype is an alias of dtype)
    dtype = str(dtype).removeprefix("torch.")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in rope and getattr(config, "rope_theta", None) is not None:
        rope["rope_theta"] = config.rope_theta
    rope.setdefault("rope_type", "default")
    architectures = getattr(config, "architectures", None) or [type(config).__name__]
    return {
        "architecture": architectures[0],
        "model_type": config.model_type,
        "dtype": dtype,
        "hidden_size": hidden,
        "intermediate_size": _optional(config, "intermediate_size", int),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "vocab_size": int(need("vocab_size")),
        "rms_norm_eps": _optional(config, "rms_norm_eps", float),
        "hidden_act": str(getattr(config, "hidden_act", "silu")),
        # None where the model has no position limit (Bloom, MPT: ALiBi, no position table)
        "max_position_embeddings": _optional(config, "max_position_embeddings", int),
        "num_hidden_layers": int(need("num_hidden_layers")),
        "rope": {k: _plain(v) for k, v in sorted(rope.items())},
        # transformers 5 keeps partial_rotary_factor in rope_parameters (older: an attribute).
        "partial_rotary_factor": float(
            rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        ),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }


def _optional(config, field: str, kind):
    """``kind(config.field)``, or None where the config has no such field (or it is null)."""
    value = getattr(config, field, None)
    return None if value is None else kind(value)


def _plain(value):
    if isinstance(value, float) and value.is_integer():
        return float(value)
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
