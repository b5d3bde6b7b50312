"""Tier-2 job planning from the ``e2e`` config section (torch-free, Snakefile parse time).

A job is model × TP × workload × variant (docs/architecture.md); a candidate variant's
job runs the baseline too, alternately, ``pairs`` times. A variant is ``baseline`` (no
candidate) or a candidate set, named by its ids joined with ``+`` (``/`` -> ``.``), e.g.
``rms_norm.torch_fused+silu_and_mul.inplace``; the name spells the set, so editing one
candidate reruns exactly the jobs of the variants that contain it (its file is an input of
those jobs only), their baseline runs included. ``e2e.candidates`` empty = every candidate that can run inside vLLM on the
device (:func:`kb_nano.e2e.vllm_plugin.swappable`, ``supported_devices``) and whose target a
configured model uses, one per target: the one that passed Tier 1 fastest
(:func:`tier1_choice`) when it is faster than the baseline there (geometric-mean speedup
above 1 and at least one row significantly faster; a target whose best candidate is not
keeps vLLM's own kernel), so adding a
candidate file changes nothing until Tier 1 has measured it, and a candidate that failed
there is never swapped in.
"""

from __future__ import annotations

import ast
import contextlib
from dataclasses import dataclass
from pathlib import Path

from kb_nano.candidates import CandidateRef, discover
from kb_nano.e2e.workloads import Workload, from_dict
from kb_nano.errors import KbNanoError
from kb_nano.models.configs import resolve

BASELINE = "baseline"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
EMBEDDED_TOKENIZER = Path("config/models/kb-nano/tiny-llama")


@dataclass(frozen=True)
class E2EModel:
    """A model of an e2e job: ``key`` (path wildcard), its directory (config.json, maybe
    weights and tokenizer), and how vLLM loads it."""

    key: str
    hub_id: str | None
    path: Path  # directory, relative to the root when vendored
    load_format: str  # "dummy" (random weights) or vLLM's "auto"
    tokenizer: Path  # directory holding the tokenizer files

    @property
    def weights(self) -> str:
        """What the row says about weights."""
        return "random (--load-format dummy)" if self.load_format == "dummy" else str(self.path)


def model(spec: str, root: Path, load_format: str = "auto") -> E2EModel:
    """Resolve ``spec`` (key, vendored Hub id, directory or config.json) for vLLM.

    ``load_format`` ``auto``: the directory's weights when it holds ``*.safetensors`` /
    ``*.bin`` / ``*.pt`` files, else random weights (``dummy``); ``dummy`` forces random.
    The tokenizer is the directory's own, else the embedded tiny-Llama tokenizer
    (token ids < 16384: enough for vLLM's random prompts on any vocabulary that size or larger).
    Raises ``KbNanoError`` for an unknown model or an unknown load format."""
    if load_format not in ("auto", "dummy"):
        raise KbNanoError(f"e2e.load_format: {load_format!r} must be 'auto' or 'dummy'")
    ref = resolve(spec, root)
    directory = ref.config_path.parent
    full = directory if directory.is_absolute() else root / directory
    has_weights = any(p.suffix in WEIGHT_SUFFIXES for p in full.iterdir())
    fmt = "auto" if load_format == "auto" and has_weights else "dummy"
    tok = directory if any((full / f).is_file() for f in TOKENIZER_FILES) else EMBEDDED_TOKENIZER
    return E2EModel(ref.key, ref.hub_id, directory, fmt, tok)


def _supported_devices(path: Path) -> tuple[str, ...]:
    """The candidate's ``supported_devices`` class attribute read from its source without
    importing it (parse time stays torch-free); ``("cpu", "cuda")`` when absent."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return ("cpu", "cuda")
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "supported_devices" for t in node.targets):
            try:
                return tuple(ast.literal_eval(node.value))
            except ValueError:
                break
    return ("cpu", "cuda")


def applicable(root: Path, device: str) -> tuple[list[CandidateRef], list[tuple[CandidateRef, str]]]:
    """Split discovered candidates into those that can run inside vLLM on ``device``
    (``cpu``/``cuda``) and ``(candidate, reason)`` for the rest."""
    from kb_nano.e2e.vllm_plugin import swappable

    ok, skipped = [], []
    for c in discover(root):
        can, why = swappable(c.target)
        if not can:
            skipped.append((c, f"not swappable into vLLM: {why}"))
        elif device not in _supported_devices(root / c.path):
            skipped.append((c, f"supports {', '.join(_supported_devices(root / c.path))}; this run is on {device}"))
        else:
            ok.append(c)
    return ok, skipped


def used_targets(root: Path, model_specs: list[str]) -> set[str]:
    """Operators at least one of the models uses (each operator's ``applies_to`` on the
    model's config facts; e.g. ``gelu_and_mul`` only for GeGLU models). Loads the configs
    with transformers (called only when e2e jobs are planned, not at every parse)."""
    from kb_nano import operators
    from kb_nano.models.configs import load_config, model_facts

    used: set[str] = set()
    for spec in model_specs:
        ref = resolve(spec, root)
        facts = model_facts(load_config(ref, root), ref)
        used |= {name for name in operators.names() if operators.get(name).applies_to(facts)}
    return used


TIER1_RESULTS = Path("results/kernels.parquet")  # the latest merged Tier-1 rows


def tier1_choice(
    root: Path, device: str, model_specs: list[str] | None = None, allowed: list[CandidateRef] | None = None
) -> dict[str, dict]:
    """Per target, the candidate Tier 1 found fastest among those that passed it, from the
    latest merged Tier-1 results (:data:`TIER1_RESULTS`, as ``kb_nano kernels`` last
    wrote them) on ``device`` (``cpu`` | ``cuda``): ``{target: {"id", "geomean", "rows",
    "faster"}}`` (``faster``: its scored rows whose 95% rerun interval lies above 1).

    Ranked: the candidates of ``allowed`` (default: every candidate file), by the rows
    measured with the file as it is now (``candidate_sha256``; rows of an edited file
    are stale). A candidate qualifies when every such row on that device is ``passed``
    or ``skipped`` and at least one is ``passed``; its score is the geometric mean of
    ``speedup`` over its passed rows of ``model_specs`` (all its passed rows when it has
    none of those models: Tier 2 often runs a smaller model than Tier 1); ties go to the
    first id. Empty when the file is missing or unreadable."""
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kb_nano.candidates import file_sha256
    from kb_nano.rows import geomean

    columns = ["candidate", "candidate_sha256", "target", "model", "device", "status", "speedup", "significant"]
    try:
        rows = pq.read_table(Path(root) / TIER1_RESULTS, columns=columns).to_pylist()
    except (OSError, ValueError, KeyError, pa.ArrowException):  # missing, unreadable, or without those columns
        return {}
    keys = {resolve(spec, root).key for spec in model_specs or []}
    current = {}
    for c in discover(root) if allowed is None else allowed:
        with contextlib.suppress(OSError):
            current[c.id] = (c.target, file_sha256(Path(root) / c.path))
    by_cand: dict[str, list[dict]] = {}
    for r in rows:
        cid = r["candidate"]
        # a row without a device (a job's own crashed row: the judge died) counts on every device
        on_device = r["device"] is None or str(r["device"]).split(":")[0] == device
        if cid in current and r["candidate_sha256"] == current[cid][1] and on_device:
            by_cand.setdefault(cid, []).append(r)
    best: dict[str, dict] = {}
    for cid, rs in sorted(by_cand.items()):
        passed = [
            r
            for r in rs
            if r["status"] == "passed"
            and isinstance(r["speedup"], float)
            and math.isfinite(r["speedup"])
            and r["speedup"] > 0
        ]
        if not passed or any(r["status"] not in ("passed", "skipped") for r in rs):
            continue
        scored = [r for r in passed if r["model"] in keys] or passed
        score = geomean(r["speedup"] for r in scored)
        target = current[cid][0]
        if score is not None and (target not in best or score > best[target]["geomean"]):
            faster = sum(bool(r["significant"]) and r["speedup"] > 1 for r in scored)
            best[target] = {"id": cid, "geomean": score, "rows": len(scored), "faster": faster}
    return best


def _faster(choice: dict) -> bool:
    """Whether a :func:`tier1_choice` entry beat the baseline: geometric-mean speedup above 1
    and at least one row significantly faster (a mean above 1 from noise alone swaps in a
    kernel no better than vLLM's)."""
    return choice["geomean"] > 1.0 and choice["faster"] > 0


def _scored(choice: dict) -> str:
    return (
        f"{choice['id']} ({choice['geomean']:.3g}x over {choice['rows']} rows, {choice['faster']} significantly faster)"
    )


def describe_choice(root: Path, device: str, cands: list[CandidateRef], model_specs: list[str] | None) -> str:
    """One line saying which candidates the default candidate variant swaps in
    (:func:`candidate_set`) and why, naming the targets whose fastest candidate that passed
    Tier 1 is not faster than the baseline (left out)."""
    ok, _ = applicable(root, device)
    used = used_targets(root, model_specs) if model_specs else None
    choice = tier1_choice(root, device, model_specs, [c for c in ok if used is None or c.target in used])
    slower = [_scored(v) for t, v in sorted(choice.items()) if not _faster(v)]
    left_out = f"; not faster than the baseline, left out: {', '.join(slower)}" if slower else ""
    if not cands:
        return (
            f"no candidate that vLLM can run passed Tier 1 faster than the baseline on {device} in "
            f"{TIER1_RESULTS} (with its current file; it holds the last `kb_nano kernels` run's selection)"
            f"{left_out}: run `kb_nano kernels` over these models first, or name them with --candidates"
        )
    parts = [_scored(choice[c.target]) if c.target in choice else c.id for c in cands]
    return (
        f"candidates: the fastest per target that passed Tier 1 on {device} ({TIER1_RESULTS}): "
        + ", ".join(parts)
        + left_out
    )


def candidate_set(
    root: Path, requested: list[str], device: str, model_specs: list[str] | None = None
) -> list[CandidateRef]:
    """The candidates of the non-baseline variant: ``requested`` ids/prefixes, or by
    default, per target that vLLM can swap and (with ``model_specs``) those models use,
    the candidate that passed Tier 1 fastest (:func:`tier1_choice`; none without Tier-1
    results) when it beat the baseline (:func:`_faster`). Raises ``KbNanoError`` for an id that matches nothing, a candidate that
    cannot be swapped into vLLM (with the reason), or two of one target."""
    ok, skipped = applicable(root, device)
    if not requested:
        used = used_targets(root, model_specs) if model_specs else None
        pool = [c for c in ok if used is None or c.target in used]
        choice = tier1_choice(root, device, model_specs, pool)
        chosen = {v["id"] for v in choice.values() if _faster(v)}
        return sorted((c for c in pool if c.id in chosen), key=lambda c: c.id)
    found = discover(root)
    reasons = {c.id: why for c, why in skipped}
    out: list[CandidateRef] = []
    for want in requested:
        hits = [c for c in found if c.id == want or c.id.startswith(want)]
        if not hits:
            raise KbNanoError(
                f"--candidates: {want!r} matches no candidates/{{target}}/{{name}}.py; "
                f"known: {', '.join(c.id for c in found)}"
            )
        for c in hits:
            if c.id in reasons:
                raise KbNanoError(f"--candidates: {c.id}: {reasons[c.id]}")
            if c not in out:
                out.append(c)
    targets = [c.target for c in out]
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise KbNanoError(f"--candidates: one variant takes one candidate per target; several for {', '.join(dup)}")
    return sorted(out, key=lambda c: c.id)


def variant_name(cands: list[CandidateRef]) -> str:
    """``baseline`` for no candidates, else the ids joined by ``+`` with ``/`` -> ``.``."""
    return "+".join(c.id.replace("/", ".") for c in cands) if cands else BASELINE


def variant_ids(name: str) -> list[str]:
    """The candidate ids a variant name spells, in order (inverse of :func:`variant_name`;
    ``[]`` for ``baseline``). Only the name is read: no candidate file is looked up."""
    return [] if name == BASELINE else [part.replace(".", "/", 1) for part in name.split("+")]


def variant_candidates(name: str, root: Path) -> list[CandidateRef]:
    """The candidates a variant name spells (:func:`variant_ids`), found under ``root``.
    Raises ``KbNanoError`` for an id without a candidate file."""
    if name == BASELINE:
        return []
    by_id = {c.id: c for c in discover(root)}
    out = []
    for cid in variant_ids(name):
        if cid not in by_id:
            raise KbNanoError(f"variant {name!r}: no candidate file for {cid}")
        out.append(by_id[cid])
    return out


def workloads(config: dict) -> list[Workload]:
    """The configured workloads (``e2e.workloads``), checked; raises ``KbNanoError``."""
    items = [from_dict(w, where=f"e2e.workloads[{i}]") for i, w in enumerate(config["e2e"]["workloads"])]
    names = [w.name for w in items]
    if len(set(names)) != len(names):
        raise KbNanoError("e2e.workloads: workload names must be unique")
    return items


def variants(root: Path, config: dict, device: str) -> list[str]:
    """Variant names of the run: ``baseline`` plus the candidate set (unless
    ``e2e.baseline_only`` or the set is empty)."""
    e2e = config["e2e"]
    out = [BASELINE]
    if not e2e["baseline_only"]:
        cands = candidate_set(root, e2e["candidates"], device, e2e["models"])
        if cands:
            out.append(variant_name(cands))
    return out


def job_variants(variants: list[str]) -> list[str]:
    """The ``variant`` of each job of a model × TP × workload: the candidate variant, whose
    job also runs the baseline (alternately, :func:`kb_nano.e2e.job.run`), or ``baseline``
    alone when there is no candidate variant."""
    return [v for v in variants if v != BASELINE] or [BASELINE]


def e2e_device(config: dict) -> str:
    """``cpu`` or ``cuda`` for the e2e jobs: ``e2e.device`` (auto = cuda when an NVIDIA GPU
    is visible, else cpu)."""
    device = config["e2e"]["device"]
    if device != "auto":
        return device
    import os

    from kb_nano.gpus import POOL_ENV, pool

    # GPUs of the host (CUDA_VISIBLE_DEVICES / nvidia-smi); a fake KB_NANO_GPU_IDS pool is not a GPU
    return "cuda" if pool({k: v for k, v in os.environ.items() if k != POOL_ENV}) else "cpu"


def engine_settings(
    *, dtype: str, max_model_len: int, enforce_eager: bool, seed: int | None, device: str, timeout_s: float
) -> dict:
    """The ``engine`` settings every job of a tier gets (:func:`kb_nano.e2e.job.run`):
    vLLM's ``--dtype``, ``--max-model-len``, ``--enforce-eager`` and ``--seed``, the
    device (``cpu`` | ``cuda``) and the job's timeout in seconds."""
    return {
        "dtype": dtype,
        "max_model_len": max_model_len,
        "enforce_eager": enforce_eager,
        "seed": seed,
        "device": device,
        "timeout_s": timeout_s,
    }


def plan(root: Path, config: dict) -> dict:
    """The Tier-2 run of ``config['e2e']``: ``device`` (:func:`e2e_device`), ``models``
    (key -> :class:`E2EModel`, loaded as ``e2e.load_format`` says), ``workloads`` (name ->
    Workload, :func:`workloads`), ``variants`` (:func:`variants`), ``tps`` (model key ->
    ``e2e.tp``: Tier 2 runs every configured TP), ``skipped`` (always empty: Tier 2 skips
    no TP; Tier 3's plan has the same keys, :func:`kb_nano.eval.plan.plan`), ``pairs``
    (``e2e.pairs``) and ``engine`` (:func:`engine_settings` from the ``e2e`` section).
    ``config`` is an effective config (:func:`kb_nano.config.load`: every key of the
    section present). Raises ``KbNanoError`` for an unknown model or load format, bad
    workloads or candidates."""
    e2e = config["e2e"]
    device = e2e_device(config)
    models = {}
    for spec in e2e["models"]:
        m = model(spec, root, e2e["load_format"])
        models[m.key] = m
    return {
        "device": device,
        "models": models,
        "workloads": {w.name: w for w in workloads(config)},
        "variants": variants(root, config, device),
        "tps": {key: list(e2e["tp"]) for key in models},
        "skipped": [],
        "pairs": e2e["pairs"],
        "engine": engine_settings(
            dtype=e2e["dtype"],
            max_model_len=e2e["max_model_len"],
            enforce_eager=e2e["enforce_eager"],
            seed=e2e["seed"],
            device=device,
            timeout_s=e2e["timeout_s"],
        ),
    }


def invocation(root: Path, base: dict, kind: str, section: dict, fields: dict, baseline_only: bool) -> dict:
    """The ``e2e`` section of one ``kb_nano e2e {kind}`` run: the effective config's
    ``base['e2e']`` updated with ``section`` (the flags' keys), ``baseline_only``, and one
    workload of ``kind`` from ``fields`` (the workload flags) over the first configured
    workload of that kind (else vLLM's defaults). Planned once here (:func:`plan`), so an
    unknown model, load format or candidate is a one-line ``KbNanoError`` before
    Snakemake starts; when no candidate is named, prints which ones the default chose
    (:func:`describe_choice`), and raises ``KbNanoError`` when it chose none (a run of the
    baseline alone is ``--baseline``)."""
    from kb_nano.e2e.workloads import from_flags

    e2e = {**base["e2e"], **section, "baseline_only": baseline_only}
    configured = [from_dict(w, where="e2e.workloads") for w in e2e["workloads"]]
    default = next((w for w in configured if w.kind == kind), None)
    e2e["workloads"] = [Workload.params(from_flags(kind, default, **fields))]
    planned = plan(root, {**base, "e2e": e2e})
    if not e2e["candidates"] and not baseline_only:
        chosen = candidate_set(root, [], planned["device"], e2e["models"])
        line = describe_choice(root, planned["device"], chosen, e2e["models"])
        if not chosen:
            raise KbNanoError(f"e2e: {line}; --baseline measures the baseline alone")
        print(line)
    return e2e
