"""The ``kb_nano`` command line: a front for the Snakemake workflow.

Each command turns its flags into Snakemake targets and ``--config`` overrides and runs
the same DAG as ``snakemake --cores all`` (never a second code path), then prints the
merged results. Arguments after ``--`` go to Snakemake unchanged
(``kb_nano kernels -- --profile profiles/slurm``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kb_nano import gpus, operators
from kb_nano import workflow as kbw
from kb_nano.errors import KbNanoError
from kb_nano.paths import find_workflow_root

DEFAULT_CONFIG = Path("config/config.yaml")


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise KbNanoError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KbNanoError(f"{path}: cannot read the config file ({type(exc).__name__}: {exc.strerror if isinstance(exc, OSError) else 'not UTF-8'})") from None
    except yaml.YAMLError as exc:
        raise KbNanoError(f"{path}: not valid YAML ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(data, dict):
        raise KbNanoError(f"{path}: must be a YAML mapping of config keys (see config/config.yaml)")
    return data


def _base_config(root: Path, configfile: str | None) -> dict:
    """``config/config.yaml`` updated with ``--configfile`` as Snakemake layers them:
    nested sections (``e2e``, ``eval``, ``golden``) are merged key by key
    (``snakemake.utils.update_config``), other keys replaced."""
    from snakemake.utils import update_config

    config = _read_yaml(root / DEFAULT_CONFIG)
    if configfile:
        update_config(config, _read_yaml(Path(configfile)))
    return config


def select_models(requested: list[str], configured: list[str], root: Path) -> list[str]:
    """Model specs for a run: each requested value keeps the configured models whose key
    starts with it (``llama31`` -> ``llama31-8b``); a value matching none is resolved on
    its own (key, vendored Hub id or path). Raises ``KbNanoError`` for an unknown model."""
    from kb_nano.models import resolve

    keys = {spec: resolve(spec, root).key for spec in configured}
    chosen: list[str] = []
    # Paths on the command line are relative to the user's directory, not the workflow root.
    requested = [str(Path(w).resolve()) if Path(w).exists() and not (root / "config/models" / w).exists() else w for w in requested]
    for want in requested:
        hits = [spec for spec, key in keys.items() if key.startswith(want) or spec == want]
        if not hits:
            resolve(want, root)
            hits = [want]
        chosen += [h for h in hits if h not in chosen]
    return chosen


def _overrides(args, root: Path, base: dict) -> dict:
    cfg: dict = {}
    if getattr(args, "model", None):
        cfg["models"] = select_models(args.model, base.get("models") or [], root)
    for flag, key in (("tp", "tp"), ("num_tokens", "num_tokens")):
        if getattr(args, flag, None):
            cfg[key] = args.__dict__[flag]
    for flag, key in (("target", "targets"), ("category", "categories"), ("candidate", "candidates")):
        if getattr(args, flag, None):
            cfg[key] = getattr(args, flag)
    for flag in ("num_warmup", "num_runs", "num_trials", "atol", "rtol", "device", "output_json", "timeout_s", "dtype",
                 "cuda_graph", "speedup_basis", "float32_matmul_precision", "memory_limit_gb", "seed"):
        value = getattr(args, flag, None)
        if value is not None:
            cfg[flag] = value
    for name in cfg.get("targets", []):
        operators.check_target(name, where="--target")
    categories = sorted({e.category for e in operators.CATALOG.values()})
    for cat in cfg.get("categories", []):
        if cat not in categories:
            raise KbNanoError(f"--category: unknown category {cat!r}; known: {', '.join(categories)}")
    return cfg


_FLAG_FOR_KEY = {
    "models": "--model", "tp": "--tp", "num_tokens": "--num-tokens", "targets": "--target",
    "categories": "--category", "candidates": "--candidate", "num_warmup": "--num-warmup",
    "num_runs": "--num-runs", "atol": "--atol", "rtol": "--rtol", "device": "--device",
    "timeout_s": "--timeout-s", "output_json": "--output-json", "dtype": "--dtype",
    "num_trials": "--num-trials", "cuda_graph": "--cuda-graph", "float32_matmul_precision": "--float32-matmul-precision",
    "memory_limit_gb": "--memory-limit-gb", "seed": "--seed", "speedup_basis": "--speedup-basis",
}


def preflight(root: Path, base: dict, overrides: dict, source: str, dry_run: bool = False) -> dict:
    """Check the effective config before Snakemake starts, so bad input gets one line:
    schema (``workflow/schemas/config.schema.yaml``), targets/categories, candidate files,
    models, output paths of every tier, a GPU for ``cuda`` (not needed for a ``dry_run``).
    Returns the effective config. Raises ``KbNanoError``."""
    import jsonschema

    config = {**base, **overrides}
    schema = yaml.safe_load((root / "workflow/schemas/config.schema.yaml").read_text())
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        key = error.absolute_path[0] if error.absolute_path else None
        origin = _FLAG_FOR_KEY.get(key, key) if key in overrides else source
        hint = ""
        if error.validator == "type" and isinstance(error.instance, str):
            with contextlib.suppress(ValueError):
                float(error.instance)
                hint = f" (YAML reads {error.instance} as a string; write it with a decimal point, e.g. 5.0e3)"
        raise KbNanoError(f"{origin}: {where}: {error.message}{hint}")
    kbw.check_config(config)
    kbw.candidates(root, config)
    kbw.model_config_files(root, config)
    if str(config["device"]).startswith("cuda") and not gpus.pool():
        raise KbNanoError(f"device {config['device']!r}: no NVIDIA GPU is visible here; use --device auto or cpu")
    for tier, where in (("kernels", config), ("e2e", config.get("e2e") or {}), ("eval", config.get("eval") or {})):
        if where.get("output_json"):
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
    others = {t: (c or {}).get("output_json") for t, c in (("kernels", config), ("e2e", (config or {}).get("e2e")),
                                                              ("eval", (config or {}).get("eval"))) if t != tier}
    reserved = {root / f"results/{t}.parquet" for t in ("kernels", "e2e", "eval")} | {root / "results/inputs/llm.yaml"}
    reserved |= {root / o for o in others.values() if o}
    reserved |= {root / f"results/{t}.json" for t in ("kernels", "e2e", "eval") if t != tier}
    owned = ("mlflow", "inputs", "golden", "kernels", "e2e", "eval", "logs", "plots", "mlflow-artifacts", ".locks")
    if (real in {p.resolve() for p in reserved} or any((results / d) == real or (results / d) in real.parents for d in owned)):
        raise KbNanoError(f"--output-json {output_json}: that path belongs to another kb-nano output; pick another")
    if root.resolve() in real.parents and results not in real.parents:
        raise KbNanoError(f"--output-json {output_json}: inside the workflow directory but not under results/; "
                          "it could overwrite a workflow file; pick a path under results/ or outside the workflow")
    if path.is_dir():
        raise KbNanoError(f"--output-json {output_json}: is a directory; give a file path ending in .json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KbNanoError(f"--output-json {output_json}: {path.parent} is not writable ({exc.strerror}); pick another path") from None
    if not os.access(path.parent, os.W_OK):
        raise KbNanoError(f"--output-json {output_json}: {path.parent} is not writable; pick another path")
    if "{" in output_json or "}" in output_json:
        raise KbNanoError(f"--output-json {output_json}: braces are Snakemake wildcards; use a plain path")


def run_snakemake(root: Path, targets: list[str], config: dict, args, passthrough: list[str]) -> int:
    """Run the workflow for ``targets`` with ``config`` overrides; returns Snakemake's
    exit status. Progress ("N of M steps done") streams to the terminal.

    Overrides travel as a temporary YAML config file given after the user's
    ``--configfile`` (Snakemake's ``--config`` does not parse list values).
    """
    import tempfile

    # Targets first: --configfile and --quiet take several values and would swallow them.
    cmd = [sys.executable, "-m", "snakemake", *targets, "--snakefile", str(root / "Snakefile"), "--directory", str(root)]
    cmd += ["--cores", str(args.cores)]
    env = dict(os.environ)
    pool = gpus.pool()
    gpu_pool = getattr(args, "gpu_pool", None)
    if gpu_pool is not None:
        if gpu_pool > len(pool):
            seen = f"only {len(pool)} ({','.join(pool)})" if pool else "none"
            raise KbNanoError(f"--gpu-pool {gpu_pool}: {seen} visible here (CUDA_VISIBLE_DEVICES / "
                              f"{gpus.POOL_ENV} / nvidia-smi); pass at most that many")
        pool = pool[:gpu_pool]
        env[gpus.POOL_ENV] = ",".join(pool)
    if pool and "--resources" not in passthrough:
        # Snakemake only counts GPUs: at most one GPU job per device of the pool at once;
        # each job then leases a concrete device id (kb_nano.gpus).
        cmd += ["--resources", f"gpu={len(pool)}"]
    if args.dry_run:
        cmd += ["--dry-run"]
    elif "results/kernels.parquet" in targets and not {"--profile", "--executor", "-e"} & set(passthrough):
        env["KB_NANO_PRESTART_JUDGE"] = "1"  # local kernel jobs: start the judge while Snakemake parses
    if not args.verbose and "--quiet" not in passthrough:
        cmd += ["--quiet", "rules"]
    # Under the workflow directory, not /tmp: cluster jobs (`-- --profile profiles/slurm`)
    # re-read every --configfile on their node, which shares the workflow directory only.
    (root / ".snakemake").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kb_nano_", dir=root / ".snakemake") as tmp:
        configfiles = [str(Path(args.configfile).resolve())] if args.configfile else []
        if config:
            override = Path(tmp) / "overrides.yaml"
            override.write_text(yaml.safe_dump(config, sort_keys=False))
            configfiles.append(str(override))
        if configfiles:
            cmd += ["--configfile", *configfiles]
        cmd += passthrough
        if args.verbose:
            print("+ " + " ".join(cmd), file=sys.stderr)
        # Snakemake runs in a process group of its own, which gets exactly one SIGINT when
        # this process is interrupted (Ctrl-C, kill -INT or SIGTERM to it alone, SIGHUP)
        # and when it dies (PR_SET_PDEATHSIG), so its jobs stop, finished shards stay and
        # its lock is released however kb_nano was stopped.
        proc = subprocess.Popen(cmd, cwd=root, env=env, process_group=0, preexec_fn=_interrupt_when_parent_dies)
        # SIGINT too: a kb_nano started with `&` from a script inherits SIGINT ignored
        previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return proc.wait()
        except KeyboardInterrupt:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _interrupt_when_parent_dies() -> None:
    """In the Snakemake child, before exec: SIGINT when kb_nano dies, even by SIGKILL; and
    SIGINT's default action back (a background job of a script starts with SIGINT ignored,
    and Python then would not turn it into KeyboardInterrupt)."""
    import ctypes

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG


def cmd_list(args) -> int:
    """``kernels --list [--level N]``: the operator registry."""
    from rich.table import Table

    from kb_nano.table import make_console

    table = Table(title="kb-nano operators" + (f" (level {args.level})" if args.level else ""))
    for col in ("target", "level", "category", "baseline", "used in"):
        table.add_column(col)
    shown = 0
    for name in operators.names():
        op = operators.get(name)
        if args.level and op.level != args.level:
            continue
        table.add_row(name, f"L{op.level}", op.category, f"{op.baseline.__module__}.{op.baseline.__name__}", op.used_in)
        shown += 1
    make_console().print(table)
    if not shown:
        print(f"no operators at level {args.level} yet (levels present: "
              f"{', '.join(sorted({f'L{e.level}' for e in operators.CATALOG.values()}))})")
    return 0


def cmd_map(args, root: Path, base: dict) -> int:
    """``kernels --map``: each model's operators, derived from its config."""
    from rich.table import Table

    from kb_nano.table import make_console
    from kb_nano.manifest import config_fields
    from kb_nano.models import load_config, model_facts, resolve
    from kb_nano.operators.base import NotApplicable

    specs = select_models(args.model, base["models"], root) if args.model else base["models"]
    tps = args.tp or base["tp"]
    console = make_console()
    for spec in specs:
        ref = resolve(spec, root)
        facts = {**model_facts(load_config(ref, root), ref), "hf_config": config_fields(ref, root)}
        table = Table(
            title=f"{ref.key} ({ref.hub_id or ref.config_path}) — {facts['architecture']}: hidden {facts['hidden_size']}, "
            f"heads {facts['num_attention_heads']}/{facts['num_key_value_heads']} kv, head_dim {facts['head_dim']}, "
            f"intermediate {facts['intermediate_size']}, vocab {facts['vocab_size']}, rope {facts['rope']['rope_type']}"
        )
        for col in ("target", "level", "used in", *(f"tp={tp} per-rank inputs" for tp in tps)):
            table.add_column(col, overflow="fold")
        for name in operators.names():
            op = operators.get(name)
            if not op.applies_to(facts):
                continue
            cells = []
            for tp in tps:
                try:
                    init = op.init_args(facts, tp)
                    inputs = op.inputs(init, facts, tp, 1, facts["dtype"])
                    cells.append(", ".join(_shape_text(s) for s in inputs))
                except NotApplicable as exc:
                    cells.append(f"n/a: {exc}")
            table.add_row(name, f"L{op.level}", op.used_in, *cells)
        console.print(table)
    return 0


def _shape_text(spec: dict) -> str:
    dims = ["N" if i == 0 else str(d) for i, d in enumerate(spec["shape"])]
    return f"{spec['name']}[{', '.join(dims)}]"


def _print_mlflow_record(root: Path, marker: str, marker_before: int | None) -> None:
    """Say which MLflow run the tier's log rule recorded (new, existing, or unchanged)."""
    if not (root / marker).is_file():
        return
    rec = json.loads((root / marker).read_text())
    if (root / marker).stat().st_mtime_ns == marker_before:
        how = "nothing changed since run"
    else:
        how = "new run" if rec["created"] else "inputs unchanged, existing run"
    print(f"MLflow: {how} {rec['run_id']} in {rec['experiment']} ({rec['tracking_uri']}); see `kb_nano history`")


def _workflow_failed(root: Path, code: int, tier: str) -> int:
    """Say that Snakemake failed, where the rows already written are kept and, when the
    directory is locked, how to unlock it; returns ``code``."""
    print(f"error: the Snakemake workflow failed (exit {code}); rows already written are kept under "
          f"{root / 'results' / tier}; see the messages above", file=sys.stderr)
    if any((root / ".snakemake/locks").glob("*")):
        command = {"kernels": "kernels", "e2e": "e2e latency", "eval": "eval"}[tier]
        print("hint: the directory is locked; if no other kb_nano/snakemake run is active, "
              f"run `kb_nano {command} -- --unlock`", file=sys.stderr)
    return code


def cmd_kernels(args, passthrough: list[str]) -> int:
    """``kb_nano kernels``: run the Tier-1 DAG and print the merged table."""
    root = find_workflow_root()
    if args.level and not args.list:
        raise KbNanoError("--level only filters --list; to run one level use --target or --category")
    if args.list:
        return cmd_list(args)
    base = _base_config(root, args.configfile)
    config = _overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile or str(DEFAULT_CONFIG))
    ignored = kbw.cpu_ignored(effective)
    if ignored:
        print(f"note: {', '.join(ignored)} change nothing on a CPU run (a CPU has the eager timer only; rows "
              "say speedup_basis=eager)", file=sys.stderr)
    if args.map:
        return cmd_map(args, root, base)
    output_json = effective["output_json"]
    from kb_nano.tracking import marker_path

    marker = marker_path("kernels")
    marker_before = (root / marker).stat().st_mtime_ns if (root / marker).is_file() else None
    code = run_snakemake(root, ["results/kernels.parquet", output_json, marker], config, args, passthrough)
    if code != 0:
        return _workflow_failed(root, code, "kernels")
    if args.dry_run:
        return 0
    from kb_nano.table import print_kernels

    doc = json.loads((root / output_json).read_text())
    print_kernels(doc["rows"], doc["summary"])
    print(f"results: {root / 'results/kernels.parquet'}, {root / output_json}")
    failed = [r for r in doc["rows"] if r["status"] not in ("passed", "skipped")]
    _print_mlflow_record(root, marker, marker_before)
    if args.fail_on_error and failed:
        print(f"error: {len(failed)} row(s) neither passed nor skipped (--fail-on-error)", file=sys.stderr)
        return 1
    return 0


def cmd_generate_inputs(args, passthrough: list[str]) -> int:
    """``kb_nano generate-inputs``: write results/inputs/llm.yaml and summarise it."""
    root = find_workflow_root()
    base = _base_config(root, args.configfile)
    config = _overrides(args, root, base)
    preflight(root, base, config, args.configfile or str(DEFAULT_CONFIG))
    # The Snakefile computes the manifest while parsing (workflow/rules/inputs.smk): a quiet
    # dry run of the kernel sweep parses it and builds nothing.
    args.dry_run, dry_run = True, args.dry_run
    code = run_snakemake(root, ["results/kernels.parquet"], config, args, [*passthrough, "--quiet", "all"])
    args.dry_run = dry_run
    if code != 0 or args.dry_run:
        return code
    from kb_nano.manifest import load

    manifest = load(root / "results/inputs/llm.yaml")
    scenarios = manifest["scenarios"]
    na = [s for s in scenarios if not s["applicable"]]
    print(f"{root / 'results/inputs/llm.yaml'}: {len(scenarios)} scenarios for {', '.join(manifest['models'])}; "
          f"{len(na)} not applicable")
    for s in na:
        print(f"  n/a {s['scenario_id']}: {s['reason']}")
    return 0


def cmd_capture_golden(args, passthrough: list[str]) -> int:
    """``kb_nano capture-golden``: build ``results/golden/{model}`` for each model (the
    ``capture_golden`` rule) and summarise the sidecars."""
    from kb_nano.golden import GOLDEN_DIR
    from kb_nano.models import resolve
    from kb_nano.workflow import golden_settings

    root = find_workflow_root()
    base = _base_config(root, args.configfile)
    models = select_models(args.model, base.get("models") or [], root)
    keys = [resolve(m, root).key for m in models]
    golden = golden_settings(base)
    if args.num_layers is not None:
        if args.num_layers < 0:
            raise KbNanoError("--num-layers: must be >= 0 (0 = all layers of the config)")
        golden["num_layers"] = args.num_layers
    if args.weights:
        if len(keys) != 1:
            raise KbNanoError(f"--weights: give exactly one --model with it (got {', '.join(keys)})")
        weights = Path(args.weights).resolve()
        if not weights.is_dir() or not any(weights.glob("*.safetensors")) and not any(weights.glob("*.bin")):
            raise KbNanoError(f"--weights {args.weights}: not a directory with *.safetensors or *.bin weight files")
        golden["weights"][keys[0]] = str(weights)
    config = {"models": models, "golden": golden}
    preflight(root, base, config, args.configfile or str(DEFAULT_CONFIG))
    passthrough = [*passthrough, "--forcerun", "capture_golden"] if args.force else passthrough
    code = run_snakemake(root, [str(GOLDEN_DIR / k) for k in keys], config, args, passthrough)
    if code != 0:
        for key in keys:
            log = root / f"results/logs/capture_golden/{key}.log"
            if log.is_file():
                for line in log.read_text().splitlines():
                    if line.startswith("error: "):
                        print(line, file=sys.stderr)
        print(f"error: the Snakemake workflow failed (exit {code}); see the messages above", file=sys.stderr)
        return code
    if args.dry_run:
        return 0
    for key in keys:
        for sidecar in sorted((root / GOLDEN_DIR / key).glob("*.json")):
            meta = json.loads(sidecar.read_text())
            layers = meta["num_hidden_layers"]
            shapes = ", ".join(f"{k} {v['shape']}" for k, v in list(meta["tensors"].items())[:3])
            more = len(meta["tensors"]) - 3
            print(f"{sidecar.with_suffix('.safetensors')}: {meta['operator']} of {key} "
                  f"({layers['captured']} of {layers['model']} layers, {meta['weights'].split(':')[0]} weights, "
                  f"{meta['prompts']['count']} prompts x {meta['prompts']['seq_len']} tokens, {meta['dtype']}): "
                  f"{shapes}{f' (+{more} more)' if more > 0 else ''}")
    written = sorted({p.stem for k in keys for p in (root / GOLDEN_DIR / k).glob("*.json")})
    print(f"{', '.join(written)} scenarios of {', '.join(keys)} now use them (input_source = golden)")
    return 0


def _e2e_overrides(args, root: Path, base: dict) -> dict:
    """The ``e2e`` config section of one ``kb_nano e2e {kind}`` invocation: the configured
    section with the flags applied and one workload built from the flags (defaults: the
    first configured workload of that kind). Raises ``KbNanoError`` (one line)."""
    from kb_nano import e2e_plan, workloads

    e2e = dict(base.get("e2e") or {})
    if args.model:
        e2e["models"] = [str(Path(m).resolve()) if Path(m).exists() and not (root / m).exists() else m
                         for m in args.model]
    if args.tp:
        e2e["tp"] = args.tp
    for flag in ("seed", "dtype", "max_model_len", "enforce_eager", "load_format", "timeout_s", "device",
                 "output_json"):
        value = getattr(args, flag, None)
        if value is not None:
            e2e[flag] = value
    if args.candidates:
        e2e["candidates"] = args.candidates
    e2e["baseline_only"] = bool(args.baseline)
    configured = [workloads.from_dict(w, where="e2e.workloads") for w in e2e.get("workloads") or []]
    default = next((w for w in configured if w.kind == args.kind), None)
    flags = {k: getattr(args, k, None) for k in workloads.FIELDS if k not in ("name", "kind")}
    if args.kind in ("throughput", "serve"):
        flags["input_len"], flags["output_len"] = args.input_len, args.output_len
    e2e["workloads"] = [workloads.Workload.params(workloads.from_flags(args.kind, default, **flags))]
    config = {**base, "e2e": e2e}
    device = e2e_plan.e2e_device(config)
    for spec in e2e["models"]:
        e2e_plan.model(spec, root, e2e.get("load_format", "auto"))
    e2e_plan.variants(root, config, device)
    return e2e


def cmd_e2e(args, passthrough: list[str]) -> int:
    """``kb_nano e2e throughput|latency|serve``: vLLM's own benchmark for the baseline and the
    candidate variant (separate jobs), merged, logged to MLflow, printed with the ratio."""
    from kb_nano.tracking import marker_path
    from kb_nano.vllm_cli import vllm_version

    if vllm_version() is None:
        raise KbNanoError("vLLM is not installed; on a CPU: pip install -e '.[e2e]' and then "
                          "pip uninstall -y torchvision torchaudio torchcodec (see README, Tier 2)")
    root = find_workflow_root()
    base = _base_config(root, args.configfile)
    e2e = _e2e_overrides(args, root, base)
    preflight(root, base, {"e2e": e2e}, args.configfile or str(DEFAULT_CONFIG), dry_run=args.dry_run)
    output_json = e2e["output_json"]
    marker = marker_path("e2e")
    marker_before = (root / marker).stat().st_mtime_ns if (root / marker).is_file() else None
    code = run_snakemake(root, ["results/e2e.parquet", output_json, marker], {"e2e": e2e}, args, passthrough)
    if code != 0:
        return _workflow_failed(root, code, "e2e")
    if args.dry_run:
        return 0
    from kb_nano.table import print_e2e

    doc = json.loads((root / output_json).read_text())
    print_e2e(doc["rows"])
    print(f"results: {root / 'results/e2e.parquet'}, {root / output_json}; vLLM's JSON per job under "
          f"{root / 'results/e2e'}")
    _print_mlflow_record(root, marker, marker_before)
    return 0


def cmd_eval(args, passthrough: list[str]) -> int:
    """``kb_nano eval``: the standardized Tier-3 sweep (fixed workloads x model x TP x
    {baseline, candidates}, kb_nano.eval_plan) through Snakemake; prints the per-workload
    candidate/baseline ratios with their spread."""
    from kb_nano import eval_plan
    from kb_nano.tracking import marker_path
    from kb_nano.vllm_cli import vllm_version

    root = find_workflow_root()
    base = _base_config(root, args.configfile)
    ev = dict(base.get("eval") or {})
    if args.model:
        ev["models"] = [str(Path(m).resolve()) if Path(m).exists() and not (root / m).exists() else m for m in args.model]
    for flag, key in (("tp", "tp"), ("category", "categories"), ("candidate", "candidates")):
        if getattr(args, flag):
            ev[key] = getattr(args, flag)
    for flag in ("num_prompts", "gpu_pool", "seed", "output_json", "device", "timeout_s"):
        if getattr(args, flag) is not None:
            ev[flag] = getattr(args, flag)
    if args.smoke:
        ev["smoke"] = True
    if args.gpu_pool is None and not args.dry_run and (ev.get("device") or "auto") != "cpu":
        visible = len(gpus.pool())
        if visible:  # the configured pool (default 8), capped by the GPUs this host has
            ev["gpu_pool"] = min(int(ev["gpu_pool"]), visible)
    # one-line errors before Snakemake starts: the schema first (tp >= 1, ...), then the plan
    preflight(root, base, {"eval": ev}, args.configfile or str(DEFAULT_CONFIG), dry_run=args.dry_run)
    plan = eval_plan.plan(root, {**base, "eval": ev})
    if not args.dry_run and vllm_version() is None:
        raise KbNanoError("vLLM is not installed; on a CPU: pip install -e '.[e2e]' and then "
                          "pip uninstall -y torchvision torchaudio torchcodec (see README, Tier 2)")
    for key, tp, why in plan["skipped"]:
        print(f"skip {key} tp={tp}: {why}", file=sys.stderr)
    # On GPUs the pool bounds concurrency (--resources gpu=N) and the ids jobs lease
    # (run_snakemake); a dry run only plans, so it needs no GPU of that count here.
    args.gpu_pool = int(ev["gpu_pool"]) if plan["device"] == "cuda" and not args.dry_run else None
    if plan["device"] == "cuda" and args.dry_run and "--resources" not in passthrough:
        passthrough = [*passthrough, "--resources", f"gpu={ev['gpu_pool']}"]
    marker = marker_path("eval")
    marker_before = (root / marker).stat().st_mtime_ns if (root / marker).is_file() else None
    code = run_snakemake(root, ["results/eval.parquet", ev["output_json"], marker], {"eval": ev}, args, passthrough)
    if code != 0:
        return _workflow_failed(root, code, "eval")
    if args.dry_run:
        return 0
    from kb_nano.table import print_eval

    doc = json.loads((root / ev["output_json"]).read_text())
    print_eval(doc)
    print(f"results: {root / 'results/eval.parquet'}, {root / ev['output_json']}")
    _print_mlflow_record(root, marker, marker_before)
    return 0


def _tracking_uri(args) -> tuple[Path, str]:
    """Workflow root and tracking URI: ``--tracking-uri`` > $MLFLOW_TRACKING_URI > config
    ``mlflow_tracking_uri`` > ``results/mlflow.db``."""
    from kb_nano.tracking import resolve_tracking_uri

    root = find_workflow_root()
    return root, resolve_tracking_uri(root, _base_config(root, args.configfile), explicit=args.tracking_uri)


def cmd_history(args, passthrough: list[str]) -> int:
    """``kb_nano history``: recorded runs as a table, or ``--compare RUN_A RUN_B``
    per-scenario speedup changes; read through the MLflow client. A store MLflow cannot
    read (e.g. a corrupt SQLite file) is a one-line error."""
    try:
        return _history(args, passthrough)
    except KbNanoError:
        raise
    except Exception as exc:
        if not type(exc).__module__.startswith(("sqlalchemy", "mlflow", "sqlite3", "alembic")):
            raise
        _, uri = _tracking_uri(args)
        raise KbNanoError(f"the MLflow store {uri} cannot be read ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:160]}); move it away or point --tracking-uri elsewhere") from None


def _history(args, passthrough: list[str]) -> int:
    from kb_nano import history
    from kb_nano.table import make_console

    if passthrough:
        raise KbNanoError(f"history takes no arguments after -- (got {' '.join(passthrough)})")
    if args.target:
        operators.check_target(args.target, where="--target")
    _, uri = _tracking_uri(args)
    console = make_console()
    if args.compare:
        result = history.compare_runs(uri, *args.compare)
        console.print(history.compare_table(result))
        a, b = result["a"], result["b"]
        both = [r for r in result["rows"] if r["status_a"] and r["status_b"]]
        changed = sum(r["status_a"] != r["status_b"] for r in both)
        only = {k: sum(r[f"status_{k}"] is None for r in result["rows"]) for k in ("a", "b")}
        gm = {k: f"{s['geomean_speedup']:.3f}x" if s["geomean_speedup"] is not None else "-" for k, s in (("a", a), ("b", b))}
        console.print(f"geomean speedup A {gm['a']} -> B {gm['b']}; {len(both)} rows in both runs, {changed} changed "
                      f"status; {only['b']} only in A, {only['a']} only in B")
        return 0
    runs = history.list_runs(uri, tier=args.tier, target=args.target, candidate=args.candidate, model=args.model,
                             limit=args.limit)
    filters = ", ".join(f"{k} {v}" for k, v in (("tier", args.tier), ("target", args.target),
                                                 ("candidate", args.candidate), ("model", args.model)) if v)
    if not runs:
        print(f"no kb-nano runs{' matching ' + filters if filters else ''} in {uri}")
        return 0
    console.print(history.history_table(runs, title="kb-nano history" + (f" ({filters})" if filters else "")))
    print(f"store: {uri}")
    return 0


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _print_experiment_urls(url: str) -> None:
    """Print the runs page of each kb-nano experiment (MLflow 3 opens on its GenAI view)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}api/2.0/mlflow/experiments/search?max_results=100", timeout=10) as resp:
            experiments = json.load(resp).get("experiments", [])
    except (OSError, ValueError):
        return
    for exp in experiments:
        if exp["name"].startswith("kb_nano/"):
            print(f"  {exp['name']} runs: {url}#/experiments/{exp['experiment_id']}/runs", flush=True)


def cmd_mlflow_ui(args, passthrough: list[str]) -> int:
    """``kb_nano mlflow-ui``: run ``mlflow ui`` on the kb-nano store (loopback by default),
    print its URL once it answers, and serve until Ctrl-C. Arguments after ``--`` go to
    ``mlflow ui`` (e.g. ``--allowed-hosts``). Raises ``KbNanoError`` if the port is taken
    or the server does not come up within ``--start-timeout`` seconds."""
    import signal
    import socket
    import urllib.request

    from kb_nano.tracking import artifact_root, check_reachable, is_server, sqlite_path

    _, uri = _tracking_uri(args)
    if is_server(uri):
        check_reachable(uri)
        print(f"MLflow UI: {uri.rstrip('/')}/ (served by the tracking server itself; nothing to start)")
        return 0
    url = f"http://{_url_host(args.host)}:{args.port}/"
    with contextlib.suppress(OSError), socket.create_connection((_url_host(args.host).strip("[]"), args.port), timeout=1):
        raise KbNanoError(f"port {args.port} on {args.host} is already in use; pick another with --port")
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", args.host,
           "--port", str(args.port), "--workers", str(args.workers)]
    art = artifact_root(uri)
    if art is not None:
        cmd += ["--artifacts-destination", str(art)]
    cmd += passthrough
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: the MLflow UI has no authentication; anyone who can reach {args.host}:{args.port} "
              f"can read and delete runs", file=sys.stderr)
    proc = subprocess.Popen(cmd)
    def stop(signum, frame):
        raise KeyboardInterrupt  # SIGTERM: stop the server too (see finally)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise KbNanoError(f"mlflow ui exited with status {proc.returncode} before serving; see its messages above")
            try:
                with urllib.request.urlopen(url + "health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise KbNanoError(f"mlflow ui did not answer on {url} within {args.start_timeout:.0f} s")
            time.sleep(0.5)
        print(f"MLflow UI: {url}  (store: {uri}; Ctrl-C stops it)", flush=True)
        _print_experiment_urls(url)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tracking_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, config mlflow_tracking_uri, "
                                          "else sqlite results/mlflow.db)")
    p.add_argument("--configfile", help="config file layered over config/config.yaml (for mlflow_tracking_uri)")


def _cores(value: str) -> str:
    if value == "all" or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError("must be a positive number or 'all'")


def _positive_int(value: str) -> int:
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise argparse.ArgumentTypeError("must be a positive integer")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", action="extend", help="model key prefix (llama31), vendored Hub id, or config.json path")
    p.add_argument("--tp", nargs="+", action="extend", type=int, help="tensor-parallel degree(s)")
    p.add_argument("--num-tokens", nargs="+", action="extend", type=int, help="token count(s) per scenario")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    _snakemake_flags(p)


def _snakemake_flags(p: argparse.ArgumentParser) -> None:
    """The flags every command that runs the workflow shares."""
    p.add_argument("--configfile", help="config file whose keys override config/config.yaml")
    p.add_argument("--cores", default="all", type=_cores, help="Snakemake --cores: a positive number or 'all' (default)")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the jobs without running them")
    p.add_argument("-v", "--verbose", action="store_true", help="print the Snakemake command and rule details")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``kb_nano kernels: error: ...`` and how to get help),
    not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kb_nano``."""
    parser = _Parser(prog="kb_nano", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="Tier 1: candidates vs baselines on real model shapes")
    _common(k)
    k.add_argument("--target", nargs="+", action="extend", help="operator name(s), e.g. rms_norm")
    k.add_argument("--category", nargs="+", action="extend", help="operator category(ies), e.g. norm")
    k.add_argument("--candidate", nargs="+", action="extend", help="candidate id(s) or prefixes, e.g. rms_norm/torch_fused")
    k.add_argument("--num-warmup", type=int, help="untimed calls per side (default 10)")
    k.add_argument("--num-runs", type=int, help="timed eager calls per side, at least (default 100; CPU: small calls "
                   "get more, at least 10 batches of about 5 ms; CUDA: blocks run until the interval is within "
                   "ci_target or max_timing_s; the row's num_runs says how many ran)")
    k.add_argument("--atol", type=float, help="absolute tolerance for every operator (default: each operator's own, "
                   "e.g. 0.01 for bf16 pointwise ops; README: Operators)")
    k.add_argument("--rtol", type=float, help="relative tolerance for every operator (default: each operator's own; "
                   "0 = max-abs-error only)")
    k.add_argument("--device", help="auto | cpu | cuda[:i] (default auto)")
    k.add_argument("--timeout-s", type=float, help="seconds per kernel job, i.e. per scenario (default 600)")
    k.add_argument("--num-trials", type=int, help="correctness trials on fresh inputs before timing (default 3, at least 2)")
    k.add_argument("--seed", type=int, help="replay: use this measurement seed (a row's `seed`) instead of a fresh one "
                   "from the OS; the same seed gives the same trial inputs and parameters")
    k.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: also time K calls per CUDA-graph replay (columns *_graph_ms; default on)")
    k.add_argument("--speedup-basis", choices=["auto", "kernel", "graph", "eager"],
                   help="the timer `speedup` comes from (default auto: kernel on CUDA, eager on a CPU, where it is "
                        "the only one); recorded per row as speedup_basis")
    k.add_argument("--float32-matmul-precision", choices=["highest", "high", "medium"],
                   help="torch.set_float32_matmul_precision for both sides (default highest: no TF32)")
    k.add_argument("--memory-limit-gb", type=float,
                   help="address-space cap of a CPU worker in GiB, at least 2 (the worker maps ~1 GiB before the "
                        "candidate runs); a candidate past it gets runtime_error (default none)")
    k.add_argument("--output-json", help="merged JSON path (default results/kernels.json)")
    k.add_argument("--list", action="store_true", help="list the operators (targets) and exit")
    k.add_argument("--level", type=int, choices=[1, 2, 3, 4], help="with --list: only this level")
    k.add_argument("--map", action="store_true", help="show each model's operators and per-rank shapes and exit")
    k.add_argument("--gpu-pool", type=_positive_int, metavar="N",
                   help="use the first N GPUs of the pool (CUDA_VISIBLE_DEVICES, else all visible): "
                        "--resources gpu=N and each job leases one of those N devices")
    k.add_argument("--fail-on-error", action="store_true",
                   help="exit 1 when any row is neither passed nor skipped (for CI gates)")
    k.set_defaults(func=cmd_kernels)

    g = sub.add_parser("generate-inputs", help="write the scenario manifest results/inputs/llm.yaml")
    _common(g)
    g.set_defaults(func=cmd_generate_inputs)

    c = sub.add_parser("capture-golden", help="capture real inputs of attention / fused_moe / sampler from a model run")
    c.add_argument("--model", nargs="+", action="extend", required=True,
                   help="model key prefix (qwen3-8b), vendored Hub id (Qwen/Qwen3-8B), or config.json path")
    c.add_argument("--weights", help="directory of local weights (default: random weights from the config)")
    c.add_argument("--num-layers", type=int, help="decoder layers to keep (default 2; 0 = all)")
    c.add_argument("--force", action="store_true", help="capture again even if the files are up to date")
    _snakemake_flags(c)
    c.set_defaults(func=cmd_capture_golden)

    e = sub.add_parser("e2e", help="Tier 2: vLLM's own benchmarks with candidates swapped into the engine")
    esub = e.add_subparsers(dest="kind", required=True)
    for kind, text in (("throughput", "offline throughput (vllm bench throughput): requests/s, tokens/s"),
                       ("latency", "one batch end to end (vllm bench latency): average and percentiles"),
                       ("serve", "vllm serve on loopback driven by vllm bench serve: TTFT, TPOT, ITL, E2EL")):
        p = esub.add_parser(kind, help=text)
        p.add_argument("--model", nargs="+", action="extend",
                       help="model directory (config.json [+ weights + tokenizer]), key or vendored Hub id "
                            "(default: the embedded tiny Llama)")
        p.add_argument("--tp", "--tensor-parallel-size", dest="tp", nargs="+", action="extend", type=int,
                       help="tensor-parallel degree(s)")
        p.add_argument("--seed", type=int)
        p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
        p.add_argument("--max-model-len", type=int)
        p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help="vLLM --enforce-eager (default on in config/config.yaml)")
        p.add_argument("--load-format", choices=["auto", "dummy"],
                       help="dummy = random weights; auto = the model directory's weights if any, else dummy")
        p.add_argument("--output-json", help="merged JSON (default results/e2e.json)")
        p.add_argument("--input-len", type=int)
        p.add_argument("--output-len", type=int)
        if kind in ("throughput", "serve"):
            p.add_argument("--dataset-name", choices=["random"])
            p.add_argument("--random-input-len", type=int)
            p.add_argument("--random-output-len", type=int)
            p.add_argument("--random-range-ratio", type=float)
            p.add_argument("--num-prompts", type=int)
        if kind == "serve":
            p.add_argument("--request-rate", type=float, help="requests/s (default: all at once, vLLM's inf)")
            p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
        else:
            p.add_argument("--batch-size", type=int)
            p.add_argument("--num-iters-warmup", type=int)
            p.add_argument("--num-iters", type=int)
        p.add_argument("--candidates", nargs="+", action="extend",
                       help="candidate ids or prefixes of the candidate variant (default: all that run inside vLLM)")
        p.add_argument("--baseline", action="store_true", help="run only the baseline variant")
        p.add_argument("--timeout-s", type=float, help="seconds per job (default 900)")
        p.add_argument("--device", choices=["auto", "cpu", "cuda"])
        _snakemake_flags(p)
        p.set_defaults(func=cmd_e2e)

    v = sub.add_parser("eval", help="Tier 3: standardized workloads x model x TP, baseline vs candidates (vLLM)")
    v.add_argument("--model", nargs="+", action="extend",
                   help="models (default: the configured models the candidates apply to; --smoke: the tiny Llama)")
    v.add_argument("--tp", "--tensor-parallel-size", dest="tp", nargs="+", action="extend", type=int,
                   help="tensor-parallel degrees (default 1 4)")
    v.add_argument("--category", nargs="+", action="extend", help="operator categories of the candidates (default all)")
    v.add_argument("--candidate", "--candidates", dest="candidate", nargs="+", action="extend",
                   help="candidate ids (default: every candidate vLLM can run, one per target)")
    v.add_argument("--num-prompts", type=int, help="prompts per throughput workload (default 1000)")
    v.add_argument("--gpu-pool", type=int, help="GPUs the sweep may use at once (default 8)")
    v.add_argument("--seed", type=int, help="vLLM --seed (default 42)")
    v.add_argument("--output-json", help="merged JSON (default results/eval.json)")
    v.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: lengths / 16, 16 prompts, 1+3 latency iterations (recorded in every row)")
    v.add_argument("--device", choices=["auto", "cpu", "cuda"], help="auto (default) | cpu | cuda")
    v.add_argument("--timeout-s", type=float, help="seconds per job (default 3600)")
    _snakemake_flags(v)
    v.set_defaults(func=cmd_eval)

    h = sub.add_parser("history", help="past runs recorded in MLflow; --compare two of them")
    h.add_argument("--tier", choices=["kernels", "e2e", "eval"], help="only this tier (default: all)")
    h.add_argument("--target", help="only runs that include this operator, e.g. rms_norm")
    h.add_argument("--candidate", help="only runs that include this candidate id (or id prefix)")
    h.add_argument("--model", help="only runs that include this model key (or key prefix, e.g. llama31)")
    h.add_argument("--limit", type=int, default=20, help="at most this many runs, newest first (default 20)")
    h.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"),
                   help="per-scenario speedup changes from run A to run B (ids or unique prefixes)")
    _tracking_flags(h)
    h.set_defaults(func=cmd_history)

    u = sub.add_parser("mlflow-ui", help="serve the MLflow UI on the kb-nano store and print its URL")
    u.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, loopback only)")
    u.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    u.add_argument("--workers", type=int, default=1, help="server worker processes (default 1)")
    u.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the server (default 120)")
    _tracking_flags(u)
    u.set_defaults(func=cmd_mlflow_ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kb_nano`` console script. Returns the exit status; user
    errors print ``error: <one line>`` and return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = _split_passthrough(argv)
    args = build_parser().parse_args(own)
    try:
        return args.func(args, passthrough)
    except KbNanoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished shards are kept under results/kernels/", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
