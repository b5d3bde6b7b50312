"""The scenario manifest, Tier 1's plan: operator × model × TP × num_tokens, one file per
selection (``results/inputs/llm-<selection>.yaml``, :func:`kb_nano.workflow.manifest_path`).

Generated from the configured models by :func:`generate`; written byte-identically for
the same inputs by :func:`write`, in JSON syntax (valid YAML) with one scenario per line,
so :func:`load` reads 10,000 scenarios in well under a second; :func:`cached` is what the
Snakefile calls at parse time: it regenerates the file only when its inputs changed. This
module must not import torch at module level.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from pathlib import Path

import yaml

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.files import atomic_write_text
from kb_nano.models.configs import (
    check_unique_keys,
    config_fields,
    config_imports_only,
    config_sha256,
    load_config,
    model_facts,
    resolve,
)
from kb_nano.paths import PACKAGE_DIR

SCHEMA_VERSION = 1
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def scenario_id(target: str, model: str, tp: int, num_tokens: int, variant: str = "") -> str:
    """Stable scenario id, e.g. ``rms_norm__llama31-8b__tp1__n64``; an operator variant
    (see ``Operator.variants``) and non-standard semantics (``Operator.semantics``) add a
    suffix: ``attention__llama31-8b__tp1__n8__ctx1024``, ``rms_norm__gemma2-2b__tp1__n64__gemma``."""
    return f"{target}__{model}__tp{tp}__n{num_tokens}" + (f"__{variant}" if variant else "")


def generate(
    models: list[str],
    tps: list[int],
    num_tokens: list[int],
    dtype: str,
    root: Path,
    context_lens: list[int] | None = None,
    targets: list[str] | None = None,
) -> dict:
    """Build the manifest for ``models`` (specs, see :func:`kb_nano.models.configs.resolve`) ×
    ``tps`` × ``num_tokens`` × every registered operator (or the operators named in
    ``targets``, in registry order) × its variants.

    Variants are the extra axes an operator declares (``Operator.variants``): ``attention``
    has a prefill scenario and one decode scenario per ``context_lens`` entry (default
    :data:`kb_nano.operators.attention.DEFAULT_CONTEXT_LENS`); a variant scenario records
    ``variant`` (its id suffix) and its extra fields (``context_len``). Every scenario
    records the operator's default tolerance for its dtype (``atol``, ``rtol``), which the
    measurement uses unless the config sets a global one.

    ``dtype`` ``auto`` uses each model's ``torch_dtype``. A scenario whose TP does not
    divide the sharded dimension, whose operator the architecture does not use, or whose
    model cannot be deployed at that TP at all (:func:`_undeployable`) is kept with
    ``applicable: false`` and the ``reason``; so is one whose operator call is the same
    at a lower TP of the model (an unsharded norm: same init args, inputs, dtype and
    semantics), naming the scenario that measures it (:func:`_same_call`).
    Raises ``KbNanoError`` for unknown models, unloadable configs, duplicate keys or a
    TP / token count listed twice (which would give duplicate scenario ids).
    """
    from kb_nano.operators.base import NotApplicable, tolerance_for

    refs = [resolve(spec, root) for spec in models]
    check_unique_keys(refs)
    options = {"context_lens": None if context_lens is None else [int(c) for c in context_lens]}
    for what, values in (("tp", tps), ("num_tokens", num_tokens), ("context_lens", context_lens or [])):
        repeated = sorted({v for v in values if list(values).count(v) > 1})
        if repeated:
            raise KbNanoError(f"config {what}: {', '.join(map(str, repeated))} listed more than once")
    manifest = {"schema_version": SCHEMA_VERSION, "models": {}, "scenarios": []}
    names = [n for n in operators.names() if targets is None or n in targets]
    tree = any(operators.get(n).reads_module_tree for n in names)
    for ref in refs:
        facts = model_facts(load_config(ref, root), ref)
        if tree:  # what the model's own modules compute (norm form, attention layer kinds)
            from kb_nano.models import module_tree

            facts.update(module_tree.read(config_fields(ref, root)))
        model_dtype = facts["dtype"] if dtype == "auto" else dtype
        # Operators derive dtype-dependent constructor args (the rotary cos/sin cache) from
        # facts: give them the scenario dtype, not the checkpoint's, when it is overridden.
        # L3/L4 baselines build the transformers classes from the config.json fields themselves.
        op_facts = {**facts, "dtype": model_dtype, "hf_config": config_fields(ref, root)}
        manifest["models"][ref.key] = {
            "hub_id": ref.hub_id,
            "config_path": str(ref.config_path),
            "config_sha256": config_sha256(ref, root),
            **facts,
        }
        deployable_reason = {tp: _undeployable(facts, tp) for tp in tps}
        deployable = {tp for tp, why in deployable_reason.items() if why is None}
        calls: dict[str, dict] = {}  # one model's applicable calls: measured once, at the lowest TP
        for name in names:
            op = operators.get(name)
            atol, rtol = tolerance_for(op, model_dtype)
            variants = op.variants(op_facts, options)
            kinds = op.layer_kinds(op_facts)
            for tp, (kind, overrides) in ((tp, k) for tp in sorted(tps) for k in kinds):  # (lowest TP first)
                kind_facts = {**op_facts, **overrides}
                semantics = op.semantics(kind_facts)
                for n, (variant, extra) in ((n, v) for n in num_tokens for v in variants):
                    suffix = "__".join(filter(None, (variant, kind or semantics)))
                    entry = {
                        "scenario_id": scenario_id(name, ref.key, tp, n, suffix),
                        "target": name,
                        "level": op.level,
                        "category": op.category,
                        "model": ref.key,
                        "hub_id": ref.hub_id,
                        "tp": tp,
                        "num_tokens": n,
                        **({"variant": variant, **extra} if variant else {}),
                        **({"layer_kind": kind} if kind else {}),
                        **({"semantics": semantics} if semantics else {}),
                        "dtype": model_dtype,
                        "atol": atol,
                        "rtol": rtol,
                    }
                    try:
                        if tp not in deployable:
                            raise NotApplicable(deployable_reason[tp])
                        if not op.applies_to(kind_facts):
                            raise NotApplicable(f"{facts['architecture']} does not use {name}")
                        args = op.init_args(kind_facts, tp)
                        inputs = op.inputs(args, kind_facts, tp, n, model_dtype, **extra)
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
                        _same_call(entry, calls)
                    manifest["scenarios"].append(entry)
    return manifest


def _same_call(entry: dict, calls: dict[str, dict]) -> None:
    """Mark ``entry`` (an applicable scenario) not applicable when ``calls`` (the model's
    applicable scenarios so far, by call) holds one with the same operator call at another
    TP (everything but ``scenario_id`` and ``tp``: an unsharded norm at TP 1 and 4);
    else record it there. Measuring the call twice would give two rows of one number."""
    key = json.dumps({k: v for k, v in entry.items() if k not in ("scenario_id", "tp")}, sort_keys=True)
    first = calls.setdefault(key, entry)
    if first is not entry:
        for k in ("init_args", "inputs", "bytes_moved", "flops"):
            del entry[k]
        entry.update(
            applicable=False,
            reason=f"same call as tp={first['tp']} ({first['scenario_id']}), measured there: "
            f"{entry['target']} is not sharded over TP",
        )


def _undeployable(facts: dict, tp: int) -> str | None:
    """Why vLLM could not run the model at tensor-parallel degree ``tp``, or None: the
    attention heads must split evenly over the ranks and the KV heads either split evenly
    or be replicated a whole number of times (vLLM ``QKVParallelLinear``). Every
    scenario of such a model x TP is not applicable, whatever its operator (an
    unsharded rms_norm at that TP measures a deployment that cannot exist)."""
    from kb_nano.operators.base import NotApplicable, kv_heads_per_rank, shard

    try:
        shard(int(facts["num_attention_heads"]), tp, "num_attention_heads")
        kv_heads_per_rank(int(facts["num_key_value_heads"]), tp)
    except NotApplicable as exc:
        return f"the model cannot be deployed at tp={tp} (vLLM): {exc}"
    return None


def dumps(manifest: dict) -> str:
    """Serialise deterministically (key order as built): JSON, which is also YAML, with the
    header fields indented and one scenario per line (readable and grep-able; parses ~30x
    faster than YAML block style, which took 17 s for 8,640 scenarios with libyaml)."""
    head = json.dumps({k: v for k, v in manifest.items() if k != "scenarios"}, indent=2)
    rows = ",\n    ".join(json.dumps(s, separators=(", ", ": ")) for s in manifest.get("scenarios", []))
    text = head[: -len("\n}")] + ',\n  "scenarios": [\n    ' + rows + "\n  ]\n}\n"
    # YAML 1.1 readers (PyYAML) read 1e-05 as a string: give exponent floats a dot (1.0e-05).
    return _JSON_TOKEN.sub(lambda m: m.group(0) if m.group(0).startswith('"') else f"{m[1]}.0{m[2]}", text)


# A JSON string (kept as is) or a float in exponent notation without a dot.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|(?<![\d.])(-?\d+)([eE][-+]?\d+)')


def write(manifest: dict, path: Path) -> None:
    """Write atomically (temporary file + rename)."""
    atomic_write_text(path, dumps(manifest))


def load(path: Path) -> dict:
    """Read a manifest; raises ``KbNanoError`` if missing or not a kb-nano manifest."""
    try:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except ValueError:  # a hand-written or older YAML manifest
            data = yaml.load(text, Loader=_Loader)
    except FileNotFoundError:
        raise KbNanoError(f"{path}: manifest missing; run `kb_nano generate-inputs`") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise KbNanoError(
            f"{path}: not a readable manifest ({' '.join(str(exc).split())[:120]}); delete it (it is regenerated)"
        ) from None
    scenarios = data.get("scenarios") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or data.get("schema_version") != SCHEMA_VERSION
        or not isinstance(data.get("models"), dict)
        or not isinstance(scenarios, list)
        or not all(
            isinstance(e, dict)
            and isinstance(e.get("scenario_id"), str)
            and isinstance(e.get("target"), str)
            and isinstance(e.get("applicable"), bool)
            for e in scenarios
        )
    ):
        raise KbNanoError(
            f"{path}: not a kb-nano manifest of schema {SCHEMA_VERSION} (models, scenarios with "
            "scenario_id, target, applicable); delete it (it is regenerated)"
        )
    return data


def summary_lines(path: Path) -> list[str]:
    """``kb_nano generate-inputs``'s summary of the manifest at ``path``: its scenario count
    for its models, then each not-applicable scenario with the reason."""
    manifest = load(path)
    scenarios = manifest["scenarios"]
    na = [s for s in scenarios if not s["applicable"]]
    head = f"{path}: {len(scenarios)} scenarios for {', '.join(manifest['models'])}; {len(na)} not applicable"
    return [head, *(f"  n/a {s['scenario_id']}: {s['reason']}" for s in na)]


def scenario_json(scenario: dict) -> str:
    """Canonical JSON of one scenario (passed to jobs as a Snakemake param)."""
    return json.dumps(scenario, sort_keys=True, separators=(",", ":"))


def digest(text: str) -> str:
    """SHA-256 hex digest of a string."""
    return hashlib.sha256(text.encode()).hexdigest()


def inputs_digest(params: dict, files: list[Path], root: Path | None = None) -> str:
    """SHA-256 over the generation parameters (canonical JSON), the installed transformers
    version (it supplies the configs' defaults) and the bytes of ``files`` (model
    config.json files, the models index, the operators' shape code), each named by its
    path relative to ``root`` or to the kb_nano package, so the same inputs give the same
    digest in any working directory."""
    from importlib import metadata

    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = None
    h = hashlib.sha256(json.dumps({**params, "transformers": transformers}, sort_keys=True).encode())
    for f in files:
        f = Path(f)
        name = str(f)
        for base in ([Path(root).resolve()] if root is not None else []) + [PACKAGE_DIR]:
            with contextlib.suppress(ValueError):
                name = str(f.resolve().relative_to(base))
                break
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def user_cache_path(digest: str) -> Path:
    """Where :func:`cached` keeps a copy of each manifest it generates:
    ``$XDG_CACHE_HOME/kb_nano/manifests/<digest>.yaml`` (a fresh working directory with
    the same inputs, e.g. another checkout's sweep, reads it instead of importing
    transformers again: 4.4 s on the 2-core CPU)."""
    from kb_nano.files import user_cache_dir

    return user_cache_dir("manifests", f"{digest}.yaml")


def cached(path: Path, root: Path, params: dict, files: list[Path]) -> tuple[dict, str | None]:
    """The manifest for ``params`` (``models``, ``tp``, ``num_tokens``, ``dtype``,
    ``context_lens``, ``targets``; see :func:`generate`): read from ``path`` when it records the same
    :func:`inputs_digest`; else copied from the user cache (:func:`user_cache_path`) when
    that holds one with the digest; else generated. A manifest not read from ``path`` is
    written there atomically (and a generated one to the user cache too, best effort).
    The user cache is used only where Landlock confines candidates
    (:func:`kb_nano.kernels.sandbox.abi_version`), since it outlives the working directory.
    Generation and the copy hold a lock (``.<name>.lock`` beside ``path``, :mod:`filelock`), so two
    processes asking at once generate once. Returns ``(manifest, how)``: ``how`` is None
    (read from ``path``), ``"cache"`` or ``"generated"``. Raises ``KbNanoError`` as
    :func:`generate` does."""
    from filelock import FileLock

    from kb_nano.kernels.sandbox import abi_version

    digest_now = inputs_digest(params, files, root)
    found = _read_current(Path(path), digest_now)
    if found is not None:
        return found, None
    # One generator per manifest: `kb_nano kernels` starts generating while Snakemake starts,
    # and the Snakefile's parse then waits here for the file instead of generating it twice.
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(path).with_name(f".{Path(path).name}.lock")), thread_local=False):
        return _cached_locked(Path(path), root, params, digest_now, abi_version() > 0)


def written_note(path, data: dict, how: str) -> str:
    """The line saying that :func:`cached` wrote the manifest at ``path`` (``how``:
    ``"generated"`` or ``"cache"``), with its scenario counts."""
    n_na = sum(not s["applicable"] for s in data["scenarios"])
    source = " (from the user cache)" if how == "cache" else ""
    return f"kb-nano: wrote {path}{source}: {len(data['scenarios'])} scenarios ({n_na} not applicable)"


def _read_current(path: Path, digest_now: str) -> dict | None:
    """The manifest at ``path`` when it records ``digest_now``, else None."""
    if not path.is_file():
        return None
    try:
        data = load(path)
    except KbNanoError:
        return None
    return data if data.get("inputs_digest") == digest_now else None


def _cached_locked(path: Path, root: Path, params: dict, digest_now: str, shared: bool) -> tuple[dict, str | None]:
    """:func:`cached` under its lock. ``shared``: the user cache may be read and written
    (without Landlock a candidate could write it, and every later directory would read it)."""
    for where, how in ((path, None), *(((user_cache_path(digest_now), "cache"),) if shared else ())):
        data = _read_current(where, digest_now)
        if data is not None:
            if how is not None:
                write(data, path)
            return data, how
    with config_imports_only():
        manifest = generate(
            models=list(params["models"]),
            tps=[int(t) for t in params["tp"]],
            num_tokens=[int(n) for n in params["num_tokens"]],
            dtype=params["dtype"],
            root=root,
            context_lens=params.get("context_lens"),
            targets=params.get("targets"),
        )
    manifest = {
        "schema_version": manifest["schema_version"],
        "inputs_digest": digest_now,
        **{k: v for k, v in manifest.items() if k != "schema_version"},
    }
    write(manifest, path)
    if shared:
        with contextlib.suppress(OSError):  # a read-only or full cache only costs the next directory the generation
            write(manifest, user_cache_path(digest_now))
    return manifest, "generated"
