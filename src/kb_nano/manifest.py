"""The scenario manifest (``results/inputs/llm.yaml``): operator × model × TP × num_tokens.

Generated from the configured models by :func:`generate`; written byte-identically for
the same inputs by :func:`write`; read cheaply (libyaml when present) by :func:`load`,
also at Snakefile parse time, so this module must not import torch at module level.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import yaml

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.models import config_sha256, load_config, model_facts, resolve

SCHEMA_VERSION = 1
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def scenario_id(target: str, model: str, tp: int, num_tokens: int) -> str:
    """Stable scenario id, e.g. ``rms_norm__llama31-8b__tp1__n64``."""
    return f"{target}__{model}__tp{tp}__n{num_tokens}"


def generate(models: list[str], tps: list[int], num_tokens: list[int], dtype: str, root: Path) -> dict:
    """Build the manifest for ``models`` (specs, see :func:`kb_nano.models.resolve`) ×
    ``tps`` × ``num_tokens`` × every registered operator.

    ``dtype`` ``auto`` uses each model's ``torch_dtype``. A scenario whose TP does not
    divide the sharded dimension (or whose operator the architecture does not use) is
    kept with ``applicable: false`` and the ``reason``.
    Raises ``KbNanoError`` for unknown models, unloadable configs, duplicate keys or a
    TP / token count listed twice (which would give duplicate scenario ids).
    """
    from kb_nano.operators.base import NotApplicable

    refs = [resolve(spec, root) for spec in models]
    keys = [r.key for r in refs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise KbNanoError(f"config models: {', '.join(dupes)} listed more than once (after resolving)")
    for what, values in (("tp", tps), ("num_tokens", num_tokens)):
        repeated = sorted({v for v in values if list(values).count(v) > 1})
        if repeated:
            raise KbNanoError(f"config {what}: {', '.join(map(str, repeated))} listed more than once")
    manifest = {"schema_version": SCHEMA_VERSION, "models": {}, "scenarios": []}
    for ref in refs:
        facts = model_facts(load_config(ref, root), ref)
        model_dtype = facts["dtype"] if dtype == "auto" else dtype
        # Operators derive dtype-dependent constructor args (the rotary cos/sin cache) from
        # facts: give them the scenario dtype, not the checkpoint's, when it is overridden.
        op_facts = {**facts, "dtype": model_dtype}
        manifest["models"][ref.key] = {
            "hub_id": ref.hub_id,
            "config_path": str(ref.config_path),
            "config_sha256": config_sha256(ref, root),
            **facts,
        }
        for name in operators.names():
            op = operators.get(name)
            for tp in tps:
                for n in num_tokens:
                    entry = {
                        "scenario_id": scenario_id(name, ref.key, tp, n),
                        "target": name,
                        "level": op.level,
                        "category": op.category,
                        "model": ref.key,
                        "hub_id": ref.hub_id,
                        "tp": tp,
                        "num_tokens": n,
                        "dtype": model_dtype,
                    }
                    try:
                        if not op.applies_to(op_facts):
                            raise NotApplicable(f"{facts['architecture']} does not use {name}")
                        args = op.init_args(op_facts, tp)
                        inputs = op.inputs(args, op_facts, tp, n, model_dtype)
                    except NotApplicable as exc:
                        entry.update(applicable=False, reason=str(exc))
                    else:
                        nbytes, flops = op.traffic(args, inputs, model_dtype)
                        entry.update(
                            applicable=True,
                            reason=None,
                            init_args=args,
                            inputs=inputs,
                            bytes_moved=int(nbytes),
                            flops=int(flops),
                        )
                    manifest["scenarios"].append(entry)
    return manifest


def dumps(manifest: dict) -> str:
    """Serialise deterministically (key order as built, block style)."""
    return yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=100)


def write(manifest: dict, path: Path) -> None:
    """Write atomically (temporary file + rename)."""
    atomic_write_text(path, dumps(manifest))


def load(path: Path) -> dict:
    """Read a manifest; raises ``KbNanoError`` if missing or not a kb-nano manifest."""
    try:
        data = yaml.load(Path(path).read_text(), Loader=_Loader)
    except FileNotFoundError:
        raise KbNanoError(f"{path}: manifest missing; run `kb_nano generate-inputs`") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise KbNanoError(f"{path}: not a kb-nano manifest of schema {SCHEMA_VERSION}; regenerate it")
    return data


def scenario_json(scenario: dict) -> str:
    """Canonical JSON of one scenario (passed to jobs as a Snakemake param)."""
    return json.dumps(scenario, sort_keys=True, separators=(",", ":"))


def digest(text: str) -> str:
    """SHA-256 hex digest of a string."""
    return hashlib.sha256(text.encode()).hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
