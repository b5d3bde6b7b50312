"""Tier-2/3 workloads as data: what one end-to-end benchmark job asks vLLM to do.

A workload is a named set of vLLM benchmark settings of one kind:

- ``throughput``: ``vllm bench throughput`` (offline, ``--dataset-name random``):
  ``num_prompts`` requests of ``random_input_len`` prompt tokens and ``random_output_len``
  generated tokens (``random_range_ratio`` spreads both); reports requests/s and tokens/s.
- ``latency``: ``vllm bench latency``: one batch of ``batch_size`` prompts of ``input_len``
  tokens generating ``output_len`` tokens, ``num_iters_warmup`` + ``num_iters`` times;
  reports the average and the 10/25/50/75/90/99th percentiles (seconds).
- ``serve``: ``vllm serve`` on loopback driven by ``vllm bench serve`` (random dataset as
  for throughput; ``request_rate`` requests/s, None = all at once as vLLM's ``inf``;
  ``max_concurrency`` None = unlimited); reports TTFT, TPOT, ITL and end-to-end latency
  (ms) and request/token throughput.

Names match vLLM's flags one to one (``input_len`` = ``--input-len``), so
:func:`bench_args` is a plain translation. Workloads live in the config (``e2e.workloads``)
or are built from CLI flags (:func:`from_flags`); Tier 3 can define fixed ones the same
way. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields

from kb_nano.errors import KbNanoError

KINDS = ("throughput", "latency", "serve")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Workload:
    """One end-to-end workload (see the module docstring). Lengths are tokens."""

    name: str
    kind: str
    # latency
    input_len: int = 32
    output_len: int = 16
    batch_size: int = 4
    num_iters_warmup: int = 1
    num_iters: int = 3
    # throughput
    dataset_name: str = "random"
    random_input_len: int = 32
    random_output_len: int = 16
    random_range_ratio: float = 0.0
    num_prompts: int = 16
    # serve
    request_rate: float | None = None
    max_concurrency: int | None = None

    def params(self) -> dict:
        """The fields that matter for ``kind`` (the rest are ignored by vLLM's benchmark)."""
        keep = KIND_FIELDS[self.kind]
        return {k: v for k, v in asdict(self).items() if k in ("name", "kind", *keep)}


LATENCY_FIELDS = ("input_len", "output_len", "batch_size", "num_iters_warmup", "num_iters")
THROUGHPUT_FIELDS = ("dataset_name", "random_input_len", "random_output_len", "random_range_ratio", "num_prompts")
SERVE_FIELDS = (*THROUGHPUT_FIELDS, "request_rate", "max_concurrency")
KIND_FIELDS = {"latency": LATENCY_FIELDS, "throughput": THROUGHPUT_FIELDS, "serve": SERVE_FIELDS}
FIELDS = {f.name for f in fields(Workload)}


def from_dict(data: dict, where: str = "e2e.workloads") -> Workload:
    """Build a workload from a config mapping; raises ``KbNanoError`` (one line naming
    ``where``) for an unknown kind or field, a bad name, or a non-positive length."""
    if not isinstance(data, dict):
        raise KbNanoError(f"{where}: each workload must be a mapping with name and kind")
    unknown = set(data) - FIELDS
    if unknown:
        raise KbNanoError(f"{where}: unknown workload field(s) {sorted(unknown)}; known: {sorted(FIELDS)}")
    name, kind = data.get("name"), data.get("kind")
    if kind not in KINDS:
        raise KbNanoError(f"{where}: workload {name!r}: kind must be one of {', '.join(KINDS)} (got {kind!r})")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise KbNanoError(f"{where}: workload name {name!r} must be letters, digits, '.', '_' or '-'")
    w = Workload(**data)
    for key in (
        "input_len",
        "output_len",
        "batch_size",
        "num_iters",
        "random_input_len",
        "random_output_len",
        "num_prompts",
    ):
        if not isinstance(getattr(w, key), int) or getattr(w, key) < 1:
            raise KbNanoError(f"{where}: workload {name!r}: {key} must be a positive integer")
    if not 0 <= float(w.random_range_ratio) < 1:
        raise KbNanoError(f"{where}: workload {name!r}: random_range_ratio must be in [0, 1)")
    if w.request_rate is not None and not (isinstance(w.request_rate, (int, float)) and w.request_rate > 0):
        raise KbNanoError(f"{where}: workload {name!r}: request_rate must be a positive number (or null = inf)")
    if w.max_concurrency is not None and not (isinstance(w.max_concurrency, int) and w.max_concurrency > 0):
        raise KbNanoError(f"{where}: workload {name!r}: max_concurrency must be a positive integer (or null)")
    if w.dataset_name != "random":
        raise KbNanoError(f"{where}: workload {name!r}: only dataset_name 'random' is supported (offline)")
    return w


def auto_name(w: Workload) -> str:
    """A name that spells the settings, so two different flag sets never share shards:
    ``latency_in32_out16_bs4_warm1_it3`` / ``throughput_random_in32_out16_n16_r0.0``."""
    if w.kind == "latency":
        return f"latency_in{w.input_len}_out{w.output_len}_bs{w.batch_size}_warm{w.num_iters_warmup}_it{w.num_iters}"
    if w.kind == "serve":
        rate = "inf" if w.request_rate is None else f"{float(w.request_rate)}"
        conc = "" if w.max_concurrency is None else f"_c{w.max_concurrency}"
        return (
            f"serve_{w.dataset_name}_in{w.random_input_len}_out{w.random_output_len}_n{w.num_prompts}"
            f"_r{float(w.random_range_ratio)}_rate{rate}{conc}"
        )
    return (
        f"throughput_{w.dataset_name}_in{w.random_input_len}_out{w.random_output_len}_n{w.num_prompts}"
        f"_r{float(w.random_range_ratio)}"
    )


def from_flags(kind: str, base: Workload | None, **flags) -> Workload:
    """A workload of ``kind`` from CLI flags (None = keep ``base``'s value, else the
    dataclass default). For throughput and serve, ``--input-len``/``--output-len`` set the random
    lengths as in ``vllm bench throughput``. Named by :func:`auto_name`."""
    values = {k: v for k, v in asdict(base).items()} if base is not None else {}
    values.update({"kind": kind, "name": "pending"})
    if kind in ("throughput", "serve"):
        for plain, rnd in (("input_len", "random_input_len"), ("output_len", "random_output_len")):
            if flags.get(plain) is not None and flags.get(rnd) is None:
                flags[rnd] = flags[plain]
            flags.pop(plain, None)
    values.update({k: v for k, v in flags.items() if v is not None and k in FIELDS})
    w = from_dict(values, where="command line")
    return from_dict({**asdict(w), "name": auto_name(w)}, where="command line")


def bench_args(w: Workload) -> list[str]:
    """The ``vllm bench {kind}`` flags of the workload (without engine flags); unset
    serve options are left to vLLM's defaults (``--request-rate inf``, no concurrency cap)."""
    out = []
    for key in KIND_FIELDS[w.kind]:
        if getattr(w, key) is not None:
            out += [f"--{key.replace('_', '-')}", str(getattr(w, key))]
    return out
