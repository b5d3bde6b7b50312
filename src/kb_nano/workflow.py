"""Helpers the Snakefile calls at parse time: config checks, candidate discovery,
job selection from the manifest. Torch-free and transformers-free (parse time must
stay cheap: see docs/architecture.md, "Parse time")."""

from __future__ import annotations

import functools
from pathlib import Path

from kb_nano import operators
from kb_nano.candidates import CandidateRef, discover
from kb_nano.errors import ConfigError, did_you_mean
from kb_nano.models.configs import INDEX_FILE, check_config_file, check_unique_keys, resolve
from kb_nano.paths import PACKAGE_DIR

# Harness files whose edits must rerun every kernel job (with the operator's own module).
HARNESS_MODULES = (
    *(
        f"kernels/{m}.py"
        for m in (
            "agreement",
            "blocks",
            "build",
            "checks",
            "compare",
            "cupti",
            "cupti_lib",
            "fields",
            "fork_sockets",
            "guard",
            "heap",
            "inputs",
            "job",
            "judge",
            "judge_process",
            "measure",
            "pool",
            "procs",
            "quiet_start",
            "sandbox",
            "schema",
            "seccomp",
            "shm",
            "signing",
            "timing",
            "verdict",
            "worker",
            "worker_process",
            "worker_server",
        )
    ),
    "candidates.py",
    "rows.py",
    "gpus.py",
    "operators/base.py",
)
MANIFEST_MODULES = (
    "models/configs.py",
    "models/module_tree.py",
    "models/attention_tree.py",
    "models/ffn_tree.py",
    "models/norm_tree.py",
    "kernels/manifest.py",
    "operators/__init__.py",
    "operators/base.py",
)
# Golden-tensor files a kernel job of a golden target reads through (with the harness modules).
GOLDEN_MODULES = ("models/golden_inputs.py", "models/golden.py")
# Modules an operator module's baseline computes with, beyond its own file and base.py
# (by the operator module's name): MoE's routing and experts, MLA's attention cores.
OPERATOR_PARTS = {"moe": ("operators/moe_parts.py",), "attention": ("operators/mla.py",)}


def check_config(config: dict) -> None:
    """Check the filter fields against the registry and that the tolerances, limits and
    roofline peaks are finite; raises :class:`~kb_nano.errors.ConfigError` naming the key."""
    for name in config.get("targets") or []:
        if name not in operators.CATALOG:
            known = ", ".join(operators.CATALOG)
            raise ConfigError(
                "targets", f"unknown target {name!r}{did_you_mean(name, operators.CATALOG)}; known: {known}"
            )
    import math

    numbers = {
        key: config[key] for key in ("atol", "rtol", "timeout_s", "memory_limit_gb", "ci_target", "max_timing_s")
    }
    numbers.update({f"roofline.{k}": v for k, v in config["roofline"].items()})
    for key, value in numbers.items():
        if isinstance(value, (int, float)) and not math.isfinite(value):
            raise ConfigError(key, f"{value} is not a finite number")
    categories = {e.category for e in operators.CATALOG.values()}
    for cat in config["categories"]:
        if cat not in categories:
            raise ConfigError(
                "categories",
                f"unknown category {cat!r}{did_you_mean(cat, categories)}; known: {', '.join(sorted(categories))}",
            )


def candidates(root: Path, config: dict) -> list[CandidateRef]:
    """Discovered candidates, narrowed by ``config['candidates']`` (ids or id prefixes).
    Raises :class:`~kb_nano.errors.ConfigError` (key ``candidates``) when a requested id
    matches nothing."""
    found = discover(root)
    wanted = config["candidates"]
    if not wanted:
        return found
    chosen = []
    for want in wanted:
        hits = [c for c in found if c.id == want or c.id.startswith(want)]
        if not hits:
            raise ConfigError(
                "candidates",
                f"{want!r} matches no file candidates/{{target}}/{{name}}.py{did_you_mean(want, [c.id for c in found])}; "
                f"known: {', '.join(c.id for c in found)}",
            )
        chosen += [c for c in hits if c not in chosen]
    return sorted(chosen, key=lambda c: c.id)


def model_config_files(root: Path, config: dict) -> list[str]:
    """The models index and the config.json of every configured model (job inputs of
    the manifest rule). Raises ``KbNanoError`` for an unknown model, a config.json
    that is not valid JSON or has bad shape fields, or two models of one key."""
    refs = [resolve(spec, root) for spec in config["models"]]
    for ref in refs:
        check_config_file(ref, root)
    check_unique_keys(refs)
    return [str(INDEX_FILE)] + [str(ref.config_path) for ref in refs]


def model_refs(root: Path, config: dict) -> dict:
    """Model key -> :class:`kb_nano.models.configs.ModelRef` of every configured model (the
    ``capture_golden`` rule maps its ``{model}`` wildcard through it)."""
    return {ref.key: ref for ref in (resolve(spec, root) for spec in config["models"])}


def golden_param(root: Path, scenario: dict, config: dict) -> dict | None:
    """The golden tensors a kernel job of ``scenario`` reads, as its Snakemake param
    ``{"path": sidecar, "sha256": digest of the tensors}`` (a new capture changes the digest
    and so reruns the job), or None: operator without golden data, ``use_golden: false``,
    or nothing captured for the model (``kb_nano capture-golden``)."""
    from kb_nano.models.golden import GOLDEN_TARGETS, sidecar_path

    if not config["use_golden"] or scenario["target"] not in GOLDEN_TARGETS:
        return None
    meta = _sidecar(sidecar_path(root, scenario["model"], scenario["target"]))
    if meta is None:
        return None
    return {"path": str(sidecar_path(Path("."), scenario["model"], scenario["target"])), "sha256": meta["sha256"]}


def _sidecar(path: Path) -> dict | None:
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    return _sidecar_at(path, mtime)


@functools.lru_cache(maxsize=256)
def _sidecar_at(path: Path, mtime_ns: int) -> dict | None:
    from kb_nano.models.golden import read_sidecar

    return read_sidecar(path)


def _wanted(scenario: dict, config: dict) -> bool:
    targets = config.get("targets") or []
    categories = config.get("categories") or []
    return (not targets or scenario["target"] in targets) and (not categories or scenario["category"] in categories)


def select(manifest: dict, cands: list[CandidateRef], config: dict) -> tuple[list, list]:
    """Split the manifest into jobs and not-applicable pairs for the configured filters.

    Returns ``(jobs, not_applicable)``: ``jobs`` are ``(scenario, candidate)`` pairs of
    applicable scenarios; ``not_applicable`` are ``(scenario, candidate)`` pairs whose
    scenario the manifest marks ``applicable: false``.
    """
    by_target: dict[str, list[CandidateRef]] = {}
    for c in cands:
        by_target.setdefault(c.target, []).append(c)
    jobs, skipped = [], []
    for s in manifest["scenarios"]:
        if not _wanted(s, config):
            continue
        for c in by_target.get(s["target"], []):
            (jobs if s["applicable"] else skipped).append((s, c))
    return jobs, skipped


def shard_path(scenario_id: str, cand: CandidateRef) -> str:
    """Output shard of one kernel job."""
    return f"results/kernels/{cand.target}/{cand.name}/{scenario_id}.parquet"


def job_dirs(shard_dirs) -> list[str]:
    """The directories the jobs writing into ``shard_dirs`` (``results/<tier>/...``) create:
    those and their log directories (``results/logs/<tier>/...``), each once."""
    dirs = sorted(set(map(str, shard_dirs)))
    return [*dirs, *(f"results/logs/{d.removeprefix('results/')}" for d in dirs)]


def kernel_job_dirs(cands: list[CandidateRef], config: dict) -> list[str]:
    """The directories the kernel jobs of ``config``'s targets and categories may write
    (:func:`job_dirs`): ``results/kernels/<target>/<name>`` of each candidate, its log
    directory. Known before the manifest, so the CLI checks them before Snakemake starts."""
    wanted = [
        c for c in cands if _wanted({"target": c.target, "category": operators.CATALOG[c.target].category}, config)
    ]
    return job_dirs(str(Path(shard_path("x", c)).parent) for c in wanted)


def harness_files(target: str) -> list[str]:
    """Library files a kernel job of ``target`` depends on (absolute paths of the
    installed package): editing one reruns those jobs."""
    module = operators.CATALOG[target].module.split(".")[-1]
    from kb_nano.models.golden import GOLDEN_TARGETS

    files = [
        *HARNESS_MODULES,
        f"operators/{module}.py",
        *OPERATOR_PARTS.get(module, ()),
        *(GOLDEN_MODULES if target in GOLDEN_TARGETS else ()),
    ]
    return [str(PACKAGE_DIR / f) for f in files]


def manifest_code_files() -> list[str]:
    """Library files the manifest depends on (shape rules of every operator)."""
    # every module of the operators package: the shape rules import helpers beyond the
    # catalog's modules (hf_modules builds the L3/L4 configs that decide init_args and applicability)
    ops = sorted(p.relative_to(PACKAGE_DIR).as_posix() for p in (PACKAGE_DIR / "operators").glob("*.py"))
    return [str(PACKAGE_DIR / f) for f in dict.fromkeys((*MANIFEST_MODULES, *ops))]


def manifest_params(config: dict) -> dict:
    """The manifest's generation parameters from ``config``: ``models``, ``tp``,
    ``num_tokens``, ``dtype``, ``context_lens`` and, when ``targets`` or ``categories``
    narrow the run, ``targets`` (the operators selected, in catalog order: a sweep of two
    cheap operators need not import transformers' model classes, as the shape rules of
    ``decoder_layer`` and ``model`` do)."""
    params = {k: config.get(k) for k in ("models", "tp", "num_tokens", "dtype", "context_lens")}
    if config.get("targets") or config.get("categories"):
        params["targets"] = [
            n for n in operators.names() if _wanted({"target": n, "category": operators.CATALOG[n].category}, config)
        ]
    return params


def manifest_path(config: dict) -> str:
    """Where the manifest of ``config``'s selection lives, relative to the workflow root:
    ``results/inputs/llm-<12 hex digits>.yaml``, named by the SHA-256 of
    :func:`manifest_params`. One file per selection, so an invocation with another
    selection (one Snakemake's lock then refuses, which parses first) never rewrites the
    manifest a running invocation merges and logs; a changed config.json or shape rule
    rewrites the same file (:func:`manifest`)."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(manifest_params(config), sort_keys=True).encode()).hexdigest()
    return f"results/inputs/llm-{digest[:12]}.yaml"


def manifest(root: Path, config: dict, path: Path) -> tuple[dict, bool]:
    """The scenario manifest of ``config`` at parse time (:func:`kb_nano.kernels.manifest.cached`)
    at ``path`` (:func:`manifest_path`), of the operators ``targets`` and ``categories``
    select (all when neither is set): read from ``path`` when its inputs (the
    :func:`manifest_params`, the models' config.json files, the operators' shape code)
    are unchanged, else copied from the user cache or regenerated. Returns ``(manifest,
    how)``: ``how`` None (read from ``path``), ``"cache"`` or ``"generated"``. Raises
    ``KbNanoError``."""
    from kb_nano.kernels.manifest import cached

    files = [root / f for f in model_config_files(root, config)] + [Path(f) for f in manifest_code_files()]
    return cached(root / path, root, manifest_params(config), files)


def missing_shard_candidates(jobs: list) -> list[tuple[str, str]]:
    """``(path, target)`` of each candidate file with a shard of ``jobs`` (``(scenario,
    CandidateRef)`` pairs, :func:`select`) not written yet, in job order: the workers the
    judge can start ahead (:func:`kb_nano.kernels.job.warm_candidates`)."""
    out: dict = {}
    for scenario, cand in jobs:
        if cand.id not in out and not Path(shard_path(scenario["scenario_id"], cand)).exists():
            out[cand.id] = (str(cand.path), cand.target)
    return list(out.values())


CUDA_ONLY = ("cuda_graph", "speedup_basis", "ci_target", "max_timing_s")  # settings a CPU run has no use for


def _cuda_only_defaults(root: Path) -> dict:
    from kb_nano.config import defaults

    return {k: v for k, v in defaults(root).items() if k in CUDA_ONLY}


def runs_on_cpu(config: dict) -> bool:
    """Whether kernel jobs of ``config`` run on a CPU: ``device: cpu``, or ``auto`` on a
    host with no GPU in its pool (:func:`kb_nano.gpus.pool`; torch-free)."""
    from kb_nano import gpus

    device = str(config["device"])
    return device == "cpu" or (device == "auto" and not gpus.pool())


def cpu_ignored(root: Path, config: dict) -> list[str]:
    """The CUDA-only settings of ``config`` set away from their schema defaults on a CPU
    run (:data:`CUDA_ONLY`), as ``key=value`` (empty on CUDA)."""
    changed = [f"{k}={config[k]}" for k, v in _cuda_only_defaults(root).items() if config[k] != v]
    return changed if changed and runs_on_cpu(config) else []  # the GPU pool (nvidia-smi) only when it matters


def settings(root: Path, config: dict) -> dict:
    """The measurement settings handed to every kernel job (a Snakemake param, so a
    change reruns the jobs) from the effective ``config`` of the workflow at ``root``.
    On a CPU run the CUDA-only ones (:data:`CUDA_ONLY`) keep their schema defaults: they
    change nothing there, so they rerun nothing."""
    if cpu_ignored(root, config):
        config = {**config, **_cuda_only_defaults(root)}
    return {
        "device": config["device"],
        # None (null in the config) = each operator's own tolerance (kb_nano.kernels.compare.tolerance).
        "atol": None if config["atol"] is None else float(config["atol"]),
        "rtol": None if config["rtol"] is None else float(config["rtol"]),
        "num_warmup": int(config["num_warmup"]),
        "num_runs": int(config["num_runs"]),
        "num_trials": int(config["num_trials"]),
        "timeout_s": float(config["timeout_s"]),
        "cuda_graph": bool(config["cuda_graph"]),
        "speedup_basis": str(config["speedup_basis"]),
        "ci_target": float(config["ci_target"]),
        "max_timing_s": float(config["max_timing_s"]),
        "float32_matmul_precision": str(config["float32_matmul_precision"]),
        "memory_limit_gb": None if config["memory_limit_gb"] is None else float(config["memory_limit_gb"]),
        "roofline": {k: v for k, v in config["roofline"].items() if v is not None},
        # None = a fresh seed from the OS for every measurement; a number replays that row's seed
        "seed": None if config["seed"] is None else int(config["seed"]),
    }


def golden_settings(config: dict, num_layers: int | None = None, weights: tuple[str, str] | None = None) -> dict:
    """A copy of the ``golden`` config block: ``num_layers`` (decoder layers kept, 0 = all)
    and ``weights`` (model key -> directory of local weights); defaults from the schema.
    ``num_layers`` and ``weights`` (``(model key, directory)``) override it (``kb_nano
    capture-golden --num-layers/--weights``). Raises ``KbNanoError`` for a negative
    ``num_layers`` or a directory without ``*.safetensors``/``*.bin`` files."""
    from kb_nano.errors import KbNanoError

    out = {"num_layers": int(config["golden"]["num_layers"]), "weights": dict(config["golden"]["weights"])}
    if num_layers is not None:
        if num_layers < 0:
            raise KbNanoError("--num-layers: must be >= 0 (0 = all layers of the config)")
        out["num_layers"] = num_layers
    if weights is not None:
        key, given = weights
        path = Path(given).resolve()
        if not path.is_dir() or not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise KbNanoError(f"--weights {given}: not a directory with *.safetensors or *.bin weight files")
        out["weights"][key] = str(path)
    return out


def start_manifest(root: Path, effective: dict) -> None:
    """Bring the selection's manifest up to date in a background thread of this process
    (:func:`manifest`) while Snakemake starts: generating one imports torch and
    transformers (seconds), which then overlaps Snakemake's own start-up; the Snakefile's
    parse waits for the file under the manifest's lock and reads it. A failure here is
    left to that parse, which reports it."""
    import contextlib
    import sys
    import threading

    from kb_nano.kernels.manifest import written_note

    def run() -> None:
        with contextlib.suppress(Exception):
            path = manifest_path(effective)
            data, how = manifest(root, effective, Path(path))
            if how is not None and threading.main_thread().is_alive():  # (not after an interrupt ended kb_nano)
                print(written_note(path, data, how), file=sys.stderr)

    threading.Thread(target=run, name="kb_nano-manifest", daemon=True).start()
