"""The operator contract: baseline module, constructor-argument rule, input rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


class NotApplicable(Exception):
    """Raised by an init-args rule when an operator does not apply to a model × TP
    (e.g. TP does not divide the heads); the message is the recorded reason."""


@dataclass(frozen=True)
class Operator:
    """One benchmarked operator ("target").

    Attributes:
        name: vLLM op name (``rms_norm``).
        level: 1 single operator, 2 fused block, 3 decoder layer, 4 whole model.
        category: ``norm``, ``activation``, ``positional``, ``embedding``, ...
        baseline: plain-PyTorch ``nn.Module`` with vLLM's constructor and forward signature.
        init_args: ``(facts, tp) -> dict`` constructor kwargs of the per-rank module for a
            model (``facts`` from :func:`kb_nano.models.model_facts`); raises ``NotApplicable``.
        inputs: ``(init_args, facts, tp, num_tokens, dtype) -> list[dict]`` per-rank input
            tensor specs, each ``{name, shape, dtype, init}`` (see :func:`make_tensor`).
        traffic: ``(init_args, inputs, dtype) -> (bytes, flops)`` minimum DRAM bytes moved
            and floating-point operations of one call, for bandwidth/FLOP-rate plots.
        used_in: where the op sits in a decoder model (shown by ``kb_nano kernels --map``).
        applies_to: ``facts -> bool``; False when the architecture does not use the op.
    """

    name: str
    level: int
    category: str
    baseline: type[torch.nn.Module]
    init_args: Callable[[dict, int], dict]
    inputs: Callable[[dict, dict, int, int, str], list[dict]]
    traffic: Callable[[dict, list[dict], str], tuple[int, int]]
    used_in: str
    applies_to: Callable[[dict], bool] = field(default=lambda facts: True)


DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,
}


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype name (``bfloat16`` -> 2)."""
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def numel(spec: dict) -> int:
    """Number of elements of an input spec."""
    n = 1
    for d in spec["shape"]:
        n *= int(d)
    return n


def spec_bytes(spec: dict) -> int:
    """Bytes of one tensor described by an input spec."""
    return numel(spec) * element_size(spec["dtype"])


def normal(name: str, shape: list[int], dtype: str, std: float = 1.0) -> dict:
    """Spec of a tensor drawn from N(0, std^2)."""
    return {"name": name, "shape": [int(s) for s in shape], "dtype": dtype, "init": {"dist": "normal", "std": std}}


def randint(name: str, shape: list[int], low: int, high: int, dtype: str = "int64") -> dict:
    """Spec of an integer tensor drawn uniformly from [low, high)."""
    return {
        "name": name,
        "shape": [int(s) for s in shape],
        "dtype": dtype,
        "init": {"dist": "randint", "low": int(low), "high": int(high)},
    }


def make_tensor(spec: dict, generator: torch.Generator, device: str) -> torch.Tensor:
    """Materialise an input spec on ``device`` using ``generator`` (CPU, seeded).

    Values are drawn on the CPU so the same seed gives the same tensor on every device.
    Raises ``ValueError`` for an unknown ``init.dist``.
    """
    init = spec["init"]
    shape = tuple(spec["shape"])
    if init["dist"] == "normal":
        t = torch.randn(shape, generator=generator, dtype=torch.float32) * init["std"]
    elif init["dist"] == "randint":
        t = torch.randint(init["low"], init["high"], shape, generator=generator)
    else:
        raise ValueError(f"unknown input distribution {init['dist']!r} for {spec['name']}")
    return t.to(device=device, dtype=DTYPES[spec["dtype"]])


def shard(value: int, tp: int, what: str) -> int:
    """``value / tp`` for a TP-sharded dimension; raises ``NotApplicable`` if tp does not divide."""
    if value % tp:
        raise NotApplicable(f"tp={tp} does not divide {what}={value}")
    return value // tp


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads on one rank as vLLM shards them: divided when tp <= kv heads, otherwise
    replicated (one head per rank) when tp is a multiple of kv heads
    (vLLM ``QKVParallelLinear``). Raises ``NotApplicable`` otherwise."""
    if tp <= num_kv_heads:
        return shard(num_kv_heads, tp, "num_key_value_heads")
    if tp % num_kv_heads:
        raise NotApplicable(f"tp={tp} is not a multiple of num_key_value_heads={num_kv_heads}")
    return 1
