"""The operator contract: baseline module, constructor-argument rule, input rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
            model (``facts`` from :func:`kb_nano.models.configs.model_facts`); raises ``NotApplicable``.
        inputs: ``(init_args, facts, tp, num_tokens, dtype) -> list[dict]`` per-rank input
            tensor specs, each ``{name, shape, dtype, init}`` (see :func:`make_tensor`).
        traffic: ``(init_args, inputs, dtype) -> (bytes, flops)`` minimum DRAM bytes moved
            and floating-point operations of one call, for bandwidth/FLOP-rate plots.
        used_in: where the op sits in a decoder model (shown by ``kb_nano kernels --map``).
        applies_to: ``facts -> bool``; False when the architecture does not use the op.
        variants: ``(facts, options) -> [(suffix, extra), ...]``: extra scenario axes beyond
            model × TP × num_tokens (``options`` are the manifest options, e.g.
            ``context_lens``). Each variant becomes one scenario whose id ends in
            ``__{suffix}`` (no suffix for ``""``); ``extra`` is recorded in the scenario and
            passed to ``inputs`` as keyword arguments. Default: one plain variant.
        tolerance: ``dtype name -> (atol, rtol)`` of the correctness check for this
            operator class (see :data:`TOLERANCES`); used unless the config sets a global
            ``atol``/``rtol``. Integer outputs are always compared exactly.
        mutable_inputs: names of the inputs the operator's contract lets a call write (and
            return views of), as vLLM's in-place kernels do (``fused_add_rms_norm``:
            ``x``/``residual``; ``rotary_embedding``: ``query``/``key``). Any other input
            must hold the same bytes after the call (``input_mutated``) and share no
            memory with an output (``output_aliased``); see :mod:`kb_nano.kernels.checks`.
        edge_cases: extra correctness trials on inputs that reach the operator's numerical
            corners (names of :data:`kb_nano.kernels.inputs.EDGE_CASES`): ``zero_row`` (an
            all-zero token row: a norm without ``eps`` divides 0 by 0), ``tiny`` (values
            x 1e-3: variance near ``eps``, so a wrong or missing ``eps`` shows), ``large``
            (values x 100). Applied to the inputs drawn from N(0, std^2).
        semantics: ``facts -> str``: the model's form of the operator when it is not the
            standard (vLLM default) one, e.g. ``gemma`` for norms scaling by ``1 + weight``
            (:data:`SEMANTICS`); several joined by ``+`` (``sliding_window+sinks``), each of
            which a candidate must declare; ``""`` otherwise. A scenario with semantics records them,
            its id ends in ``__<semantics>``, and only candidates that list them in their
            ``supported_semantics`` run it (others are ``skipped`` with the reason).
        reads_module_tree: the rules above read what the model's own modules compute
            (``facts['hidden_norm']``, ``facts['attention_layers']``:
            :func:`kb_nano.models.module_tree.read`), which the manifest then builds the
            model on the meta device for.
        layer_kinds: ``facts -> [(kind, overrides), ...]``: the kinds of layer the
            operator differs between in the model (``attention``: sliding-window and global
            layers). Each kind gives its own scenarios, whose id ends in ``__<kind>`` (no
            suffix for ``""``) and whose rules see ``{**facts, **overrides}``. Default: one.
        map_variants: ``facts -> [(label, extra), ...]``: the variants whose per-rank inputs
            ``kernels --map`` shows for a layer kind (``extra`` passed to ``inputs``),
            labelled when more than one (``attention`` with MLA: prefill and decode, whose
            inputs differ). Default: the plain variant alone.
        contract_note: text ``kernels --list`` shows under the forward signature: inputs a
            form of the operator takes that the signature does not tell (``attention``: MLA).
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
    variants: Callable[[dict, dict], list[tuple[str, dict]]] = field(default=lambda facts, options: [("", {})])
    tolerance: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(TOLERANCES["pointwise"]))
    mutable_inputs: tuple[str, ...] = ()
    edge_cases: tuple[str, ...] = ()
    semantics: Callable[[dict], str] = field(default=lambda facts: "")
    reads_module_tree: bool = False
    layer_kinds: Callable[[dict], list[tuple[str, dict]]] = field(default=lambda facts: [("", {})])
    map_variants: Callable[[dict], list[tuple[str, dict]]] = field(default=lambda facts: [("", {})])
    contract_note: str = ""


# What each non-standard semantics of an operator computes (the skip reason of a candidate
# that does not declare it)
SEMANTICS = {
    "gemma": "norms compute x / rms(x) * (1 + weight), cast after the multiply (vLLM GemmaRMSNorm)",
    "sliding_window": "attention layer sees only the last per_layer_sliding_window keys (vLLM Attention)",
    "chunked_attention": "attention query sees only the earlier keys of its own chunk of attention_chunk_size "
    "tokens (Llama-4; vLLM ChunkedLocalAttention)",
    "no_weight": "q/k norm has no weight: x / rms(x), cast back (Llama-4; vLLM RMSNorm has_weight=False)",
    "sinks": "attention softmax has a per-head sink logit as an extra key, dropped after it (gpt-oss; vLLM sinks)",
    "deepseek_v3": "MoE routes by sigmoid scores over expert groups, picks on scores + e_score_correction_bias, "
    "scales the routed output by routed_scaling_factor and adds shared experts (vLLM grouped_topk, DeepseekV2MoE)",
    "gpt_oss": "MoE experts have biases and gpt-oss's clamped SwiGLU on interleaved gate/up columns (alpha 1.702, "
    "limit 7; vLLM swigluoai), routed by a softmax over the top-k logits (gpt-oss MLPBlock)",
    "llama4": "MoE routes each token to its top-1 expert, whose input (not output) is scaled by the sigmoid of "
    "that logit, and adds a shared expert (vLLM Llama4MoE)",
    "phimoe": "MoE routes each token to 2 experts by sparsemixer in eval mode (each weight a softmax over the "
    "logits within 2 * jitter_eps relative of that pick; not renormalised; vLLM phimoe_routing_function)",
    "interleaved": "rotary_embedding rotates interleaved pairs (x[2i], x[2i+1]) of each head, not its halves "
    "(vLLM is_neox_style=False; Llama-4)",
    "bias": "linear layers add biases (Phi-3.5-MoE's lm_head_bias: vLLM ParallelLMHead bias=True; Llama's mlp_bias)",
    "mla": "attention is multi-head latent attention: prefill on decompressed q/k/v, decode absorbed over the "
    "576-wide latent cache (DeepSeek-V3; vLLM MLA)",
}


# Correctness tolerances (atol, rtol) per operator numerics class and dtype; a candidate
# passes when every element has |cand - ref| <= atol * min(1, rms(ref)) + rtol * |ref|
# (torch.allclose, the absolute part in units of the output's scale: outputs of rms below 1
# get a proportionally smaller atol, kb_nano.kernels.compare). The atol values are for an
# output of rms 1, the scale of a model's activations (vLLM's tests draw N(0, 1) inputs).
# - pointwise: elementwise ops and one-row reductions (norms, activations, rotary,
#   embedding): at most a few roundings of the output. bf16 atol 1e-2 (vLLM's kernel tests)
#   and rtol 1.6e-2, fp16 1e-3 / 2e-3, fp32 1e-5. rtol is two units in the last place at
#   the bottom of a binade (2 * eps: 2^-6 for bf16, 2^-9 for fp16; torch.testing's
#   default rtol for bf16 is the same 1.6e-2): two correct kernels whose fp32 reductions
#   add in different orders round a value to neighbouring numbers, and the next rounding
#   (the weight multiply of a norm) can widen that to two ulps. vLLM's tests compare one
#   call with rtol 1e-2; kb-nano compares every element of every timed call (millions),
#   where the two-ulp case does come up (an honest numba rms_norm: 1 of 3,276,800
#   elements at 1.6 % relative, `tests/kernels/test_adversarial.py`).
# - gemm: one long fp32-accumulated dot product rounded once (lm_head): the same bf16/fp16
#   bounds, fp32 1e-4 because the reduction order over K = hidden_size terms is free.
# - fused: blocks that round intermediates to the model dtype and then reduce over them
#   again (mlp / fused_moe: activation rounded before the down projection over
#   intermediate_size terms, expert outputs summed in the model dtype): bf16 atol 6e-2 (of
#   the output's rms) / rtol 1.6e-2 (two ulps, above), fp16 8e-3 (3 more mantissa bits) /
#   2e-3, fp32 1e-4 / 1e-4. Calibrated against the reference itself: the bf16 baseline
#   computed in float64 with the same weights needs atol 0.023 x rms (fused_moe,
#   Qwen3-30B-A3B, tp 1, 64 tokens, 4 draws; mlp: 0.015), and a candidate as accurate as the
#   reference differs from the baseline by up to the sum of two such errors. Those outputs'
#   rms is 0.04-0.15, where the unscaled 2e-2 of vLLM's tests was 15-50 % of it: fused_moe
#   with int8 per-tensor weights passed. Now it needs 0.14 x rms and is incorrect
#   (tests/kernels/test_hostile_outputs.py).
# - attention: probabilities rounded to the model dtype before P @ V and summed over the
#   context. A float64 (flash-like) computation differs from the bf16 baseline by up to
#   0.096 x rms (Qwen3-8B decode over 256 keys, 64 tokens, rms 0.10), so bf16 atol 0.12;
#   the outputs' rms is 0.1 (long contexts) to 0.5 (prefill), so the scaled atol stays
#   within 0.5-3x the unscaled 2e-2 of vLLM's flash-attention tests. fp16 / 8, fp32 1e-4.
# - rotary: x1*cos - x2*sin rounds each product to the model dtype in the baseline
#   (vLLM's forward_native) before the difference; where the products cancel, the
#   baseline's own error is one ulp of the products, not of the output: for N(0, 1)
#   inputs (|x| < 8) 2^-5 = 0.031 in bf16. Measured: `python bench/rotary_bf16_error.py`
#   (Llama-3.1-8B, 1024 tokens, 5 seeds) gives baseline vs fp64 0.0306, an fp32-computing
#   candidate vs fp64 0.0156, so atol 0.04 (bf16), 0.005 (fp16: 2^-8 with margin).
# - exact: integer outputs (sampled token ids) must be equal.
TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    "pointwise": {"bfloat16": (1e-2, 1.6e-2), "float16": (1e-3, 2e-3), "float32": (1e-5, 1e-5)},
    "gemm": {"bfloat16": (1e-2, 1.6e-2), "float16": (1e-3, 2e-3), "float32": (1e-4, 1e-4)},
    "fused": {"bfloat16": (6e-2, 1.6e-2), "float16": (8e-3, 2e-3), "float32": (1e-4, 1e-4)},
    "attention": {"bfloat16": (1.2e-1, 1.6e-2), "float16": (1.5e-2, 2e-3), "float32": (1e-4, 1e-4)},
    "rotary": {"bfloat16": (4e-2, 1.6e-2), "float16": (5e-3, 2e-3), "float32": (1e-5, 1e-5)},
    "exact": {"bfloat16": (0.0, 0.0), "float16": (0.0, 0.0), "float32": (0.0, 0.0)},
}


class _Annotation(str):
    """An annotation kept as source text (``from __future__ import annotations``),
    shown unquoted by ``inspect``."""

    def __repr__(self) -> str:
        return str(self)


def _signature(func, name: str, returns: bool) -> str:
    import inspect

    sig = inspect.signature(func)
    params = [
        p.replace(annotation=_Annotation(p.annotation)) if isinstance(p.annotation, str) else p
        for p in list(sig.parameters.values())[1:]  # without self
    ]
    ret = sig.return_annotation if returns else inspect.Signature.empty
    if isinstance(ret, str):
        ret = _Annotation(ret)
    return name + str(sig.replace(parameters=params, return_annotation=ret))


def contract(baseline: type[torch.nn.Module]) -> tuple[str, str]:
    """The candidate contract of an operator: its baseline's constructor and forward
    signatures as text, without ``self``, e.g. ``("RMSNorm(hidden_size: int, eps: float =
    1e-06)", "forward(x: torch.Tensor, residual: torch.Tensor | None = None)")``. A
    baseline without its own ``__init__`` (nn.Module's) shows ``Name()``."""
    if baseline.__init__ is torch.nn.Module.__init__:
        init = f"{baseline.__name__}()"
    else:
        init = _signature(baseline.__init__, baseline.__name__, returns=False)
    return init, _signature(baseline.forward, "forward", returns=True)


def tolerance_for(op: Operator, dtype: str) -> tuple[float, float]:
    """``(atol, rtol)`` of ``op`` for scenario dtype ``dtype`` (the bf16 entry when the
    table has no row for it)."""
    table = op.tolerance
    atol, rtol = table.get(dtype, table.get("bfloat16", (1e-2, 1e-2)))
    return float(atol), float(rtol)


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


def normal(name: str, shape: list[int], dtype: str, std: float = 1.0, row_mean_std: float = 0.0) -> dict:
    """Spec of a tensor drawn from N(0, std^2); with ``row_mean_std`` > 0 each row (all but
    the last dimension) is shifted by its own offset drawn from N(0, row_mean_std^2), so rows
    have the non-zero means a LayerNorm removes (recorded only when set)."""
    init = {"dist": "normal", "std": std, **({"row_mean_std": float(row_mean_std)} if row_mean_std else {})}
    return {"name": name, "shape": [int(s) for s in shape], "dtype": dtype, "init": init}


def randint(name: str, shape: list[int], low: int, high: int, dtype: str = "int64") -> dict:
    """Spec of an integer tensor drawn uniformly from [low, high)."""
    return {
        "name": name,
        "shape": [int(s) for s in shape],
        "dtype": dtype,
        "init": {"dist": "randint", "low": int(low), "high": int(high)},
    }


def uniform(name: str, shape: list[int], low: float, high: float, dtype: str = "float32") -> dict:
    """Spec of a tensor drawn uniformly from [low, high)."""
    return {
        "name": name,
        "shape": [int(s) for s in shape],
        "dtype": dtype,
        "init": {"dist": "uniform", "low": float(low), "high": float(high)},
    }


def exponential(name: str, shape: list[int], dtype: str = "float32") -> dict:
    """Spec of a tensor drawn from Exp(1) (the noise of exponential-race sampling)."""
    return {"name": name, "shape": [int(s) for s in shape], "dtype": dtype, "init": {"dist": "exponential"}}


def make_tensor(spec: dict, generator: torch.Generator, device: str) -> torch.Tensor:
    """Materialise an input spec on ``device`` using ``generator`` (CPU, seeded).

    Values are drawn on the CPU so the same seed gives the same tensor on every device.
    Raises ``ValueError`` for an unknown ``init.dist``.
    """
    init = spec["init"]
    shape = tuple(spec["shape"])
    if init["dist"] == "normal":
        t = torch.randn(shape, generator=generator, dtype=torch.float32) * init["std"]
        if init.get("row_mean_std"):
            t += torch.randn((*shape[:-1], 1), generator=generator, dtype=torch.float32) * init["row_mean_std"]
    elif init["dist"] == "randint":
        t = torch.randint(init["low"], init["high"], shape, generator=generator)
    elif init["dist"] == "uniform":
        t = torch.rand(shape, generator=generator, dtype=torch.float32) * (init["high"] - init["low"]) + init["low"]
    elif init["dist"] == "exponential":
        # Exp(1) by inversion, so it comes from the same seeded generator on every device.
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        t = (-torch.log1p(-u)).clamp_(min=torch.finfo(torch.float32).tiny)
    else:
        raise ValueError(f"unknown input distribution {init['dist']!r} for {spec['name']}")
    return t.to(device=device, dtype=DTYPES[spec["dtype"]])


def refill_(tensor: torch.Tensor, spec: dict, generator: torch.Generator) -> torch.Tensor:
    """Overwrite ``tensor`` in place with fresh values of ``spec``'s distribution, drawn on
    the tensor's device with ``generator`` (a generator on that device). Used between
    timed calls, where values must be new but need not match across devices.
    Raises ``ValueError`` for an unknown ``init.dist``."""
    init = spec["init"]
    if init["dist"] == "normal":
        tensor.normal_(0.0, float(init["std"]), generator=generator)
        if init.get("row_mean_std"):
            offsets = torch.empty((*tensor.shape[:-1], 1), dtype=tensor.dtype, device=tensor.device)
            tensor.add_(offsets.normal_(0.0, float(init["row_mean_std"]), generator=generator))
    elif init["dist"] == "randint":
        tensor.random_(int(init["low"]), int(init["high"]), generator=generator)
    elif init["dist"] == "uniform":
        tensor.uniform_(float(init["low"]), float(init["high"]), generator=generator)
    elif init["dist"] == "exponential":
        tensor.exponential_(1.0, generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
    else:
        raise ValueError(f"unknown input distribution {init['dist']!r} for {spec['name']}")
    return tensor


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


def intermediate_size(facts: dict) -> int:
    """The config's ``intermediate_size``; raises ``NotApplicable`` (``not covered``)
    where it has none (GPT-NeoX, Falcon name the MLP width otherwise)."""
    if facts.get("intermediate_size") is None:
        raise NotApplicable("not covered: the config has no intermediate_size (and the module tree gave no width)")
    return int(facts["intermediate_size"])


def config_field(facts: dict, *names: str, default=None):
    """The first of ``names`` present (and not null) in ``facts`` or in the model's raw
    config.json fields ``facts['hf_config']`` (which the manifest passes; ``kernels --map``
    may not); ``default`` otherwise. Fields kb-nano facts do not track (expert counts,
    attention soft-capping) are read this way; a name the config class maps to another in
    its ``attribute_map`` (:func:`kb_nano.models.configs.field_aliases`) is read under that
    name too, as the config object reads it."""
    raw = facts.get("hf_config") or {}
    for name in names:
        for source in (facts, raw):
            if source.get(name) is not None:
                return source[name]
        if raw.get("model_type") is not None:
            from kb_nano.models.configs import field_aliases

            alias = field_aliases(raw["model_type"]).get(name)
            if alias is not None and raw.get(alias) is not None:
                return raw[alias]
    return default


def dense_mlp(facts: dict) -> dict | None:
    """A decoder layer's own dense MLP from the module tree (the first ``where == "mlp"``
    entry of ``facts['mlp_blocks']['dense']``: width, activation), or None: a model without
    one (MoE in every layer), or facts without the tree."""
    blocks = facts.get("mlp_blocks") or {}
    return next((d for d in blocks.get("dense", []) if d["where"] == "mlp"), None)


def moe_not_covered(facts: dict) -> str | None:
    """The ``not covered: ...`` reason of the model's MoE block from the module tree (its
    class is not one the baseline computes), or None."""
    return (((facts.get("mlp_blocks") or {}).get("moe")) or {}).get("reason")
