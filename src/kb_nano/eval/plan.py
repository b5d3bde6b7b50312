"""Tier 3: the standardized eval sweep — fixed workloads × model × TP × {baseline, candidates}.

The workloads are fixed so numbers from different runs, people and machines compare
(they cannot be edited in the config; only ``--num-prompts`` and the explicit, recorded
``--smoke`` change them):

======================  ==========  =====================================================
workload                kind        vLLM settings
======================  ==========  =====================================================
``prefill-heavy``       throughput  ``--random-input-len 1024 --random-output-len 512``
``balanced``            throughput  ``--random-input-len 512 --random-output-len 512``
``decode-heavy``        throughput  ``--random-input-len 512 --random-output-len 1024``
``single-request``      latency     ``--batch-size 1 --input-len 128 --output-len 128``
``fixed-batch-32``      latency     ``--batch-size 32 --input-len 128 --output-len 128``
======================  ==========  =====================================================

Throughput workloads use ``--num-prompts`` (default 1000) and ``--random-range-ratio 0``;
latency workloads vLLM's own defaults of ``--num-iters-warmup 10 --num-iters 30``.
``--smoke`` (for a CPU) divides every length by :data:`SMOKE_LENGTH_DIVISOR`, runs
:data:`SMOKE_NUM_PROMPTS` prompts, 1 + 3 latency iterations and one pair of runs, and
appends ``.smoke`` to the workload names, so smoke rows never mix with real ones; the rows' workload
parameters record the settings used.

Every (model, TP, workload) is one job that runs the baseline and the candidates
alternately, ``eval.pairs`` times (:mod:`kb_nano.e2e.job`); the ratio is that of the
medians over the pairs with a 95% rerun interval (:mod:`kb_nano.e2e.merge`). A TP that
exceeds the device pool (``--gpu-pool``; 1 on a CPU, where vLLM runs one engine) or that
does not divide the model's attention heads is not run: it becomes a ``skipped`` row
with the reason. Torch-free (Snakefile parse time).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kb_nano.e2e.workloads import Workload
from kb_nano.errors import KbNanoError, did_you_mean

EVAL_WORKLOADS = (
    Workload(name="prefill-heavy", kind="throughput", random_input_len=1024, random_output_len=512, num_prompts=1000),
    Workload(name="balanced", kind="throughput", random_input_len=512, random_output_len=512, num_prompts=1000),
    Workload(name="decode-heavy", kind="throughput", random_input_len=512, random_output_len=1024, num_prompts=1000),
    Workload(
        name="single-request",
        kind="latency",
        input_len=128,
        output_len=128,
        batch_size=1,
        num_iters_warmup=10,
        num_iters=30,
    ),
    Workload(
        name="fixed-batch-32",
        kind="latency",
        input_len=128,
        output_len=128,
        batch_size=32,
        num_iters_warmup=10,
        num_iters=30,
    ),
)
DEFAULT_NUM_PROMPTS = 1000
SMOKE_LENGTH_DIVISOR = 16
SMOKE_NUM_PROMPTS = 16
SMOKE_SUFFIX = ".smoke"
# The model of a smoke run when --model is not given: the embedded tiny Llama of Tier 2.
SMOKE_MODEL = "config/models/kb-nano/tiny-llama"


def workloads(num_prompts: int = DEFAULT_NUM_PROMPTS, smoke: bool = False) -> list[Workload]:
    """The fixed eval workloads. ``num_prompts`` below :data:`DEFAULT_NUM_PROMPTS` needs
    ``smoke`` (raises ``KbNanoError``): a real eval is never silently scaled down."""
    if num_prompts < 1:
        raise KbNanoError(f"--num-prompts: {num_prompts} must be positive")
    if num_prompts < DEFAULT_NUM_PROMPTS and not smoke:
        raise KbNanoError(
            f"--num-prompts {num_prompts}: fewer than the standard {DEFAULT_NUM_PROMPTS} prompts "
            "only with --smoke (which is recorded in every row)"
        )
    out = []
    for w in EVAL_WORKLOADS:
        if not smoke:
            out.append(replace(w, num_prompts=num_prompts) if w.kind == "throughput" else w)
            continue
        d = SMOKE_LENGTH_DIVISOR
        out.append(
            replace(
                w,
                name=w.name + SMOKE_SUFFIX,
                input_len=max(1, w.input_len // d),
                output_len=max(1, w.output_len // d),
                random_input_len=max(1, w.random_input_len // d),
                random_output_len=max(1, w.random_output_len // d),
                num_prompts=num_prompts if num_prompts != DEFAULT_NUM_PROMPTS else SMOKE_NUM_PROMPTS,
                num_iters_warmup=1,
                num_iters=3,
            )
        )
    return out


def select_workloads(works: list[Workload], names: list[str]) -> list[Workload]:
    """The workloads named in ``names`` (``eval.workloads``, ``--workload``; without the
    ``.smoke`` suffix), in the sweep's order; all of them when ``names`` is empty. Raises
    ``KbNanoError`` naming an unknown workload and the known ones."""
    known = [w.name.removesuffix(SMOKE_SUFFIX) for w in works]
    for name in names:
        if name.removesuffix(SMOKE_SUFFIX) not in known:
            raise KbNanoError(
                f"--workload {name}: not a standard eval workload{did_you_mean(name, known)}; known: {', '.join(known)}"
            )
    wanted = {n.removesuffix(SMOKE_SUFFIX) for n in names}
    return [w for w, k in zip(works, known) if not wanted or k in wanted]


def max_model_len(works: list[Workload]) -> int:
    """The longest sequence any workload needs (prompt + generated tokens)."""
    return max(
        (w.random_input_len + w.random_output_len) if w.kind != "latency" else (w.input_len + w.output_len)
        for w in works
    )


def tp_skip_reason(tp: int, pool: int, device: str, heads: int, kv_heads: int) -> str | None:
    """Why ``tp`` cannot run (None when it can): more devices than the pool, or a degree that
    does not divide the attention heads (vLLM requires it) or exceeds them."""
    if tp > pool:
        where = "one CPU engine (vLLM on a CPU runs at tp 1 here)" if device == "cpu" else f"--gpu-pool {pool}"
        return f"tp={tp} needs {tp} devices; the pool is {where}"
    if tp > heads or heads % tp:
        return f"tp={tp} does not divide num_attention_heads={heads}"
    if kv_heads % tp and tp % kv_heads:
        return f"tp={tp} neither divides nor is a multiple of num_key_value_heads={kv_heads}"
    return None


def model_heads(config_path: Path) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)`` from a config.json (no transformers)."""
    import json

    cfg = json.loads(Path(config_path).read_text())
    heads = int(cfg["num_attention_heads"])
    return heads, int(cfg.get("num_key_value_heads") or heads)


def device(config: dict) -> str:
    """``cpu`` or ``cuda``: ``eval.device`` (auto = cuda when an NVIDIA GPU is visible)."""
    from kb_nano.e2e.plan import e2e_device

    return e2e_device({"e2e": {"device": config["eval"]["device"]}})


def candidates(root: Path, config: dict, dev: str, model_specs: list[str]):
    """The candidate variant's candidates: ``eval.candidates`` (or, per target the models
    use, the one that passed Tier 1 fastest: :func:`kb_nano.e2e.plan.tier1_choice`),
    narrowed to ``eval.categories``.
    Raises ``KbNanoError`` when nothing is left or a category is unknown."""
    from kb_nano import operators
    from kb_nano.e2e.plan import candidate_set

    ev = config["eval"]
    cands = candidate_set(root, ev["candidates"], dev, model_specs)
    cats = ev["categories"]
    known = {e.category for e in operators.CATALOG.values()}
    for cat in cats:
        if cat not in known:
            raise KbNanoError(
                f"eval.categories: unknown category {cat!r}{did_you_mean(cat, known)}; known: {', '.join(sorted(known))}"
            )
    if not cands and not ev["candidates"]:  # (before the categories: those leaving none is the next error)
        from kb_nano.e2e.plan import describe_choice

        raise KbNanoError(f"eval: {describe_choice(root, dev, [], model_specs)}")
    if cats:
        cands = [c for c in cands if operators.CATALOG[c.target].category in cats]
    if not cands:
        raise KbNanoError(
            "eval: no candidate that vLLM can run matches the models, --candidates and --category; "
            "docs/e2e.md lists the targets vLLM can swap"
        )
    return cands


def default_models(root: Path, config: dict, dev: str) -> list[str]:
    """``eval.models``, else (smoke) the embedded tiny Llama, else the configured Tier-1
    ``models`` that at least one candidate of the run applies to."""
    from kb_nano.e2e.plan import candidate_set, used_targets

    ev = config["eval"]
    if ev["models"]:
        return list(ev["models"])
    if ev["smoke"]:
        return [SMOKE_MODEL]
    targets = {c.target for c in candidate_set(root, ev["candidates"], dev)}  # raises for unknown ids
    if not targets and not ev["candidates"]:
        from kb_nano.e2e.plan import describe_choice

        raise KbNanoError(f"eval: {describe_choice(root, dev, [], None)}")
    chosen = [spec for spec in config["models"] if targets & used_targets(root, [spec])]
    if not chosen:
        raise KbNanoError("eval: none of the configured models uses a target of the candidates; pass --model")
    return chosen


def plan(root: Path, config: dict) -> dict:
    """The eval sweep of ``config['eval']``: ``device``, ``models`` (key -> E2EModel),
    ``workloads`` (name -> Workload), ``variants`` (``baseline`` + the candidate set),
    ``candidates`` (that set), ``model_specs`` (the models as configured),
    ``tps`` (model key -> the TPs that run), ``skipped`` (``[model key, tp, reason]``),
    ``max_model_len`` (:func:`max_model_len` of the workloads), ``pairs`` (engine-run pairs
    per job: ``eval.pairs``, 1 with ``smoke``) and ``engine``
    (:func:`kb_nano.e2e.plan.engine_settings`: vLLM's own dtype, ``max_model_len``, CUDA
    graphs as vLLM serves by default, eager only with ``smoke`` (CPU runs), ``eval.seed``,
    ``eval.timeout_s``). The keys of Tier 2's plan are a subset
    (:func:`kb_nano.e2e.plan.plan`), so both tiers' jobs are built alike
    (:mod:`kb_nano.e2e.tier_jobs`). ``config`` is an effective config
    (:func:`kb_nano.config.load`). Raises ``KbNanoError`` for bad settings."""
    from kb_nano.e2e.plan import BASELINE, engine_settings, model, variant_name

    ev = config["eval"]
    dev = device(config)
    every = workloads(int(ev["num_prompts"]), bool(ev["smoke"]))
    works = select_workloads(every, ev["workloads"])
    specs = default_models(root, config, dev)
    models = {}
    for spec in specs:
        m = model(spec, root, "auto")
        models[m.key] = m
    pool = 1 if dev == "cpu" else int(ev["gpu_pool"])
    tps, skipped = {}, []
    for key, m in models.items():
        heads, kv = model_heads((m.path if m.path.is_absolute() else root / m.path) / "config.json")
        tps[key] = []
        for tp in ev["tp"]:
            why = tp_skip_reason(int(tp), pool, dev, heads, kv)
            if why:
                skipped.append([key, int(tp), why])
            else:
                tps[key].append(int(tp))
    cands = candidates(root, config, dev, specs)
    longest = max_model_len(every)  # (a subset runs the engine the whole sweep runs)
    return {
        "device": dev,
        "models": models,
        "workloads": {w.name: w for w in works},
        "variants": [BASELINE, variant_name(cands)],
        "candidates": cands,
        "model_specs": specs,
        "tps": tps,
        "skipped": skipped,
        "max_model_len": longest,
        "pairs": 1 if ev["smoke"] else int(ev["pairs"]),
        "engine": engine_settings(
            dtype="auto",
            max_model_len=longest,
            enforce_eager=bool(ev["smoke"]),
            seed=ev["seed"],
            device=dev,
            timeout_s=ev["timeout_s"],
        ),
    }


def skipped_rows(plan: dict) -> list[dict]:
    """The result rows of what ``plan`` (:func:`plan`) does not run: one ``status: skipped``
    row per workload x variant of every skipped (model, TP), its ``error`` the reason
    (:func:`tp_skip_reason`); the columns a job's row has for the same model, TP, workload
    and variant (``candidates``: the variant's ids joined by ``,``, empty for the baseline),
    without measurements."""
    import json

    from kb_nano.e2e.plan import variant_ids

    return [
        {
            "model": key,
            "hub_id": plan["models"][key].hub_id,
            "tp": tp,
            "workload": w.name,
            "kind": w.kind,
            "workload_params": json.dumps(w.params(), sort_keys=True),
            "variant": variant,
            "candidates": ",".join(variant_ids(variant)),
            "status": "skipped",
            "error": reason,
            "device": plan["device"],
        }
        for key, tp, reason in plan["skipped"]
        for w in plan["workloads"].values()
        for variant in plan["variants"]
    ]


def invocation(base: dict, section: dict, *, dry_run: bool, pool_given: bool) -> dict:
    """The ``eval`` section of one ``kb_nano eval`` run: the effective config's
    ``base['eval']`` updated with ``section`` (the flags' keys). Its jobs run here on GPUs
    (a device other than ``cpu``, not ``dry_run``, a GPU visible) and ``--gpu-pool`` not
    given (``pool_given``): ``gpu_pool`` at most the host's GPUs (:func:`kb_nano.gpus.pool`)."""
    from kb_nano import gpus

    ev = {**base["eval"], **section}
    if not pool_given and not dry_run and ev["device"] != "cpu" and gpus.pool():
        ev["gpu_pool"] = min(int(ev["gpu_pool"]), len(gpus.pool()))
    return ev


def announce(root: Path, config: dict, *, dry_run: bool) -> dict:
    """:func:`plan` of the effective ``config`` as ``kb_nano eval`` starts it: raises
    ``KbNanoError`` when vLLM is not installed (unless ``dry_run``,
    :func:`kb_nano.e2e.installed.require_vllm`), says on stderr which (model, TP) it skips
    and why, and, when no candidate is named, which ones the default chose
    (:func:`kb_nano.e2e.plan.describe_choice`). Returns the plan."""
    import sys

    from kb_nano.e2e.installed import require_vllm
    from kb_nano.e2e.plan import describe_choice

    planned = plan(root, config)
    if not dry_run:
        require_vllm()
    for key, tp, why in planned["skipped"]:
        print(f"skip {key} tp={tp}: {why}", file=sys.stderr)
    if not config["eval"]["candidates"]:
        print(describe_choice(root, planned["device"], planned["candidates"], planned["model_specs"]))
    return planned
