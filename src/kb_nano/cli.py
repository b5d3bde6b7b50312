"""The ``kb_nano`` command line: a front for the Snakemake workflow.

Each command turns its flags into Snakemake targets and ``--config`` overrides and runs
the same DAG as ``snakemake --cores all`` (never a second code path), then prints the
merged results. Arguments after ``--`` go to Snakemake unchanged
(``kb_nano kernels -- --profile profiles/slurm``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.paths import find_workflow_root

DEFAULT_CONFIG = Path("config/config.yaml")


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _base_config(root: Path, configfile: str | None) -> dict:
    path = Path(configfile) if configfile else root / DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise KbNanoError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise KbNanoError(f"{path}: not valid YAML ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(data, dict):
        raise KbNanoError(f"{path}: must be a YAML mapping of config keys (see config/config.yaml)")
    return data


def select_models(requested: list[str], configured: list[str], root: Path) -> list[str]:
    """Model specs for a run: each requested value keeps the configured models whose key
    starts with it (``llama31`` -> ``llama31-8b``); a value matching none is resolved on
    its own (key, vendored Hub id or path). Raises ``KbNanoError`` for an unknown model."""
    from kb_nano.models import resolve

    keys = {spec: resolve(spec, root).key for spec in configured}
    chosen: list[str] = []
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
    for flag in ("num_warmup", "num_runs", "atol", "rtol", "device", "output_json", "timeout_s", "dtype"):
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
    if args.dry_run:
        cmd += ["--dry-run"]
    if not args.verbose:
        cmd += ["--quiet", "rules"]
    with tempfile.TemporaryDirectory(prefix="kb_nano_") as tmp:
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
        return subprocess.call(cmd, cwd=root)


def cmd_list(args) -> int:
    """``kernels --list [--level N]``: the operator registry."""
    from rich.console import Console
    from rich.table import Table

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
    Console().print(table)
    if not shown:
        print(f"no operators at level {args.level} yet (levels present: "
              f"{', '.join(sorted({f'L{e.level}' for e in operators.CATALOG.values()}))})")
    return 0


def cmd_map(args, root: Path, base: dict) -> int:
    """``kernels --map``: each model's operators, derived from its config."""
    from rich.console import Console
    from rich.table import Table

    from kb_nano.models import load_config, model_facts, resolve
    from kb_nano.operators.base import NotApplicable

    specs = select_models(args.model, base["models"], root) if args.model else base["models"]
    tps = args.tp or base["tp"]
    console = Console()
    for spec in specs:
        ref = resolve(spec, root)
        facts = model_facts(load_config(ref, root), ref)
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


def cmd_kernels(args, passthrough: list[str]) -> int:
    """``kb_nano kernels``: run the Tier-1 DAG and print the merged table."""
    root = find_workflow_root()
    if args.list:
        return cmd_list(args)
    base = _base_config(root, args.configfile)
    if args.map:
        return cmd_map(args, root, base)
    config = _overrides(args, root, base)
    output_json = config.get("output_json", base.get("output_json", "results/kernels.json"))
    code = run_snakemake(root, ["results/kernels.parquet", output_json], config, args, passthrough)
    if code != 0:
        print(f"error: the Snakemake workflow failed (exit {code}); rows already written are kept under "
              f"{root / 'results/kernels'}; see the messages above", file=sys.stderr)
        return code
    if args.dry_run:
        return 0
    from kb_nano.table import print_kernels

    doc = json.loads((root / output_json).read_text())
    print_kernels(doc["rows"], doc["summary"])
    print(f"results: {root / 'results/kernels.parquet'}, {root / output_json}")
    return 0


def cmd_generate_inputs(args, passthrough: list[str]) -> int:
    """``kb_nano generate-inputs``: write results/inputs/llm.yaml and summarise it."""
    root = find_workflow_root()
    base = _base_config(root, args.configfile)
    config = _overrides(args, root, base)
    code = run_snakemake(root, ["results/inputs/llm.yaml"], config, args, passthrough)
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", action="extend", help="model key prefix (llama31), vendored Hub id, or config.json path")
    p.add_argument("--tp", nargs="+", action="extend", type=int, help="tensor-parallel degree(s)")
    p.add_argument("--num-tokens", nargs="+", action="extend", type=int, help="token count(s) per scenario")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--configfile", help="config file replacing config/config.yaml")
    p.add_argument("--cores", default="all", help="Snakemake --cores (default: all)")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the jobs without running them")
    p.add_argument("-v", "--verbose", action="store_true", help="print the Snakemake command and rule details")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kb_nano``."""
    parser = argparse.ArgumentParser(prog="kb_nano", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="Tier 1: candidates vs baselines on real model shapes")
    _common(k)
    k.add_argument("--target", nargs="+", action="extend", help="operator name(s), e.g. rms_norm")
    k.add_argument("--category", nargs="+", action="extend", help="operator category(ies), e.g. norm")
    k.add_argument("--candidate", nargs="+", action="extend", help="candidate id(s) or prefixes, e.g. rms_norm/torch_fused")
    k.add_argument("--num-warmup", type=int, help="untimed calls per side (default 10)")
    k.add_argument("--num-runs", type=int, help="timed calls per side (default 100)")
    k.add_argument("--atol", type=float, help="absolute tolerance (default 0.01)")
    k.add_argument("--rtol", type=float, help="relative tolerance (default 0.01; 0 = max-abs-error only)")
    k.add_argument("--device", help="auto | cpu | cuda[:i] (default auto)")
    k.add_argument("--timeout-s", type=float, help="seconds per kernel job (default 600)")
    k.add_argument("--output-json", help="merged JSON path (default results/kernels.json)")
    k.add_argument("--list", action="store_true", help="list the operators (targets) and exit")
    k.add_argument("--level", type=int, choices=[1, 2, 3, 4], help="with --list: only this level")
    k.add_argument("--map", action="store_true", help="show each model's operators and per-rank shapes and exit")
    k.set_defaults(func=cmd_kernels)

    g = sub.add_parser("generate-inputs", help="write the scenario manifest results/inputs/llm.yaml")
    _common(g)
    g.set_defaults(func=cmd_generate_inputs)
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
