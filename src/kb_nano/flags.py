"""The ``kb_nano`` flags that set config keys: one table of (flag, config key) per command,
from which the argparse options (type, choices, nargs, help = the key's schema description
and default), the config override of an invocation (:mod:`kb_nano.overrides`) and the flag
named in an error about a key all come. The schema (``workflow/schemas/config.schema.yaml``)
is the one place of each key's default and meaning. Also the flags that go to Snakemake
(:func:`add_snakemake_flags`) or name the MLflow store (:func:`add_tracking_flags`); the
commands' other flags are in the CLI's parser (:mod:`kb_nano.cli.parser`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kb_nano.config import DEFAULT_CONFIG


@dataclass(frozen=True)
class Flag:
    """``flag`` (with ``aliases``) sets config key ``key``: dotted for a section's key
    (``e2e.pairs``) and for a field of a workload (``e2e.workloads.input_len``). ``type``
    replaces the schema's (e.g. a positive-integer check argparse reports); ``store_true``
    makes a boolean a plain switch (given = true, absent = the config's value)."""

    flag: str
    key: str
    aliases: tuple[str, ...] = ()
    type: Callable | None = None
    store_true: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def positive_int(value: str) -> int:
    """argparse type: a positive integer (``argparse.ArgumentTypeError`` otherwise)."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise argparse.ArgumentTypeError("must be a positive integer")


def cores(value: str) -> str:
    """argparse type of ``--cores``: a positive integer or ``all``."""
    if value == "all" or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError("must be a positive number or 'all'")


def add_snakemake_flags(p: argparse.ArgumentParser) -> None:
    """The flags every command that runs the workflow shares: its config file and
    Snakemake's ``--cores``, dry run and verbosity."""
    p.add_argument("--configfile", help="config file whose keys override config/config.yaml")
    p.add_argument("--cores", default="all", type=cores, help="Snakemake --cores: a positive number or 'all' (default)")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the jobs without running them")
    p.add_argument("-v", "--verbose", action="store_true", help="print the Snakemake command and rule details")


def add_tracking_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that read the MLflow store: the store and the config file
    that may name it."""
    p.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, config mlflow_tracking_uri, else sqlite results/mlflow.db)",
    )
    p.add_argument("--configfile", help="config file layered over config/config.yaml (for mlflow_tracking_uri)")


def same(keys: str, section: str = "") -> tuple[Flag, ...]:
    """Flags named as their keys (``num_warmup`` -> ``--num-warmup``), of ``section`` if given."""
    return tuple(Flag("--" + k.replace("_", "-"), f"{section}.{k}" if section else k) for k in keys.split())


SELECTION = (Flag("--model", "models"), *same("tp num_tokens dtype"))
FILTERS = (Flag("--target", "targets"), Flag("--category", "categories"))
KERNELS = (
    *SELECTION,
    *FILTERS,
    Flag("--candidate", "candidates"),
    *same("num_warmup num_runs atol rtol device timeout_s num_trials seed cuda_graph speedup_basis"),
    *same("float32_matmul_precision memory_limit_gb output_json"),
)
GENERATE_INPUTS = (*SELECTION, *FILTERS)
CAPTURE_GOLDEN = same("num_layers", "golden")
TP = ("--tensor-parallel-size",)
E2E = (
    Flag("--model", "e2e.models"),
    Flag("--tp", "e2e.tp", TP),
    *same("seed dtype max_model_len enforce_eager load_format output_json candidates", "e2e"),
    Flag("--pairs", "e2e.pairs", type=positive_int),
    *same("timeout_s device", "e2e"),
)
E2E_KINDS = {  # what each `kb_nano e2e` kind runs (its help)
    "throughput": "offline throughput (vllm bench throughput): requests/s, tokens/s",
    "latency": "one batch end to end (vllm bench latency): average and percentiles",
    "serve": "vllm serve on loopback driven by vllm bench serve: TTFT, TPOT, ITL, E2EL",
}
RANDOM = "dataset_name random_input_len random_output_len random_range_ratio num_prompts"
WORKLOAD_FIELDS = {  # the workload flags of each `kb_nano e2e` kind (fields of an e2e.workloads entry)
    "throughput": f"input_len output_len {RANDOM}",
    "latency": "input_len output_len batch_size num_iters_warmup num_iters",
    "serve": f"input_len output_len {RANDOM} request_rate max_concurrency",
}
EVAL = (
    Flag("--model", "eval.models"),
    Flag("--tp", "eval.tp", TP),
    Flag("--category", "eval.categories"),
    Flag("--candidate", "eval.candidates", ("--candidates",)),
    Flag("--workload", "eval.workloads"),
    *same("num_prompts gpu_pool seed output_json", "eval"),
    Flag("--smoke", "eval.smoke", store_true=True),
    Flag("--device", "eval.device"),
    Flag("--pairs", "eval.pairs", type=positive_int),
    Flag("--timeout-s", "eval.timeout_s"),
)

# config key -> the flag that sets it, for errors about a key an override set (top-level,
# or dotted for a key of a section: e2e.output_json -> --output-json of `kb_nano e2e`)
FLAG_FOR_KEY = {f.key: f.flag for f in (*KERNELS, *CAPTURE_GOLDEN, *E2E, *EVAL)}


def workload_flags(kind: str) -> tuple[Flag, ...]:
    """The workload flags of ``kb_nano e2e {kind}`` (``--input-len``, ...)."""
    return same(WORKLOAD_FIELDS[kind], "e2e.workloads")


def entry(schema: dict, key: str) -> dict:
    """The schema entry of dotted ``key`` (through an array's ``items`` for workload fields)."""
    node = schema
    for part in key.split("."):
        if node.get("type") == "array":
            node = node["items"]
        node = node["properties"][part]
    return node


def _scalar(node: dict) -> dict:
    """argparse ``type`` and ``choices`` of a scalar schema entry."""
    types = node.get("type", [])
    types = [types] if isinstance(types, str) else types
    out: dict = {}
    if "integer" in types:
        out["type"] = int
    elif "number" in types:
        out["type"] = float
    if "enum" in node:
        out["choices"] = [v for v in node["enum"] if v is not None]
    return out


def _shown(value) -> str:
    """A default as the help shows it: lists as typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ([], "", {}):
        return "empty"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _default(node: dict, key: str, embedded: dict) -> str:
    if "default" in node:
        return f"default {_shown(node['default'])}"
    value = embedded
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return ""
        value = value[part]
    return f"default {_shown(value)}, in {DEFAULT_CONFIG}"


def add_flags(parser: argparse.ArgumentParser, flags, schema: dict, embedded: dict) -> None:
    """Add ``flags`` to ``parser``: type, choices and nargs from each key's schema entry
    (arrays take one or more values, booleans ``--x/--no-x``), help = its description and
    default (the schema's, else the embedded ``config/config.yaml``'s). Every option
    defaults to None: an absent flag leaves the config as it is."""
    for f in flags:
        node = entry(schema, f.key)
        types = node.get("type", [])
        kwargs: dict = {"default": None}
        if types == "array":
            kwargs.update(nargs="+", action="extend", **_scalar(node["items"]))
        elif types == "boolean":
            kwargs["action"] = "store_true" if f.store_true else argparse.BooleanOptionalAction
        else:
            kwargs.update(_scalar(node))
        if f.type is not None:
            kwargs["type"] = f.type
        default = _default(node, f.key, embedded)
        text = node.get("description", "") + (f" ({default})" if default else "")
        parser.add_argument(f.flag, *f.aliases, help=text.replace("%", "%%"), **kwargs)


def given(args: argparse.Namespace, flags) -> dict:
    """Config key (the part after the section: ``pairs`` of ``e2e.pairs``) -> value of
    each of ``flags`` given on the command line."""
    out = {}
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is not None:
            out[f.key.rsplit(".", 1)[-1]] = value
    return out


def option_adder(root: Path) -> Callable[[argparse.ArgumentParser, tuple[Flag, ...]], None]:
    """``add(parser, table)``: :func:`add_flags` with the help sources of the workflow at
    ``root``, its schema and its embedded config (``config/config.yaml`` as written, no
    defaults filled), read once with PyYAML alone, so building the parser stays cheap.
    Raises ``KbNanoError`` when the schema is missing."""
    from kb_nano.config import schema

    path = root / DEFAULT_CONFIG
    embedded = (yaml.safe_load(path.read_text()) if path.is_file() else None) or {}
    sources = schema(root), embedded
    return lambda parser, table: add_flags(parser, table, *sources)


def unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit through the chosen (sub)command's parser with one line naming each argument
    of ``unknown`` that it does not know, with the closest of its options where one is
    close (``--targt`` -> ``--target``, :func:`kb_nano.errors.did_you_mean`), and, for a
    command that runs Snakemake, where Snakemake's own options go (after ``--``)."""
    from kb_nano.errors import did_you_mean

    sub = parser
    for name in (getattr(args, "command", None), getattr(args, "kind", None)):
        chosen = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        if not chosen or name is None:
            break
        sub = chosen[0].choices[name]
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for flag in (u.split("=")[0] for u in unknown if u.startswith("-")):
        hint = did_you_mean(flag, options).strip()  # "(did you mean '--target'?)" or ""
        if hint:
            hints.append(f"{flag}: {hint[1:-1]}")
    named = " ".join(unknown) + (f" ({'; '.join(hints)})" if hints else "")
    after = "; Snakemake's own options go after --" if "--cores" in options else ""  # a command that runs it
    sub.error(f"unrecognized arguments: {named}{after}")
