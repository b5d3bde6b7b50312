"""What a model's own transformers modules compute, read from its module tree.

The model is built from its config.json fields on the meta device (no weights, no memory:
:func:`kb_nano.operators.hf_modules.hf_config` and the causal-LM class transformers maps
the config to), its modules are walked, and each module class an operator measures is
probed on a few random rows on the CPU: the operator then measures the semantics of that
class, not a formula assumed from the config's keys.

Today this covers the hidden-size RMSNorm (``rms_norm``, ``fused_add_rms_norm``): Llama's
``x / rms(x) * w`` or Gemma's ``x / rms(x) * (1 + w)`` (transformers
``GemmaRMSNorm``/``Gemma2RMSNorm``/``Gemma3RMSNorm``; vLLM ``GemmaRMSNorm``), whatever
the class is called; and the self-attention layers (``attention``): each layer's softmax
scale, sliding window and logit soft-cap, so layers that differ (Gemma's sliding and
global layers) are measured as separate kinds. A module that computes something else
is ``not covered``; attention sinks (gpt-oss) are probed and become part of the kind, and
DeepSeek-V3's multi-head latent attention is a kind with its dimensions.
Per-head q/k norms (``qk_norm``: Qwen3, Gemma-3; Llama-4's weightless one) are read the
same way as the hidden-size norm; each layer's feed-forward block gives the dense MLPs (width,
activation) and the MoE block, covered only for the classes the ``fused_moe`` baseline is
tested equal to (:mod:`kb_nano.models.ffn_tree`). The attention's rotation of q and k
(``rotary_embedding``) is probed on its modeling file's ``apply_rotary_pos_emb`` (and
``apply_rotary_emb``): by halves or by interleaved pairs (both measured) or some other way.
"""

from __future__ import annotations

import copy
import inspect

import torch

from kb_nano.models.attention_tree import attention_layers, attention_modules, kv_heads
from kb_nano.models.ffn_tree import mlp_blocks
from kb_nano.models.norm_tree import hidden_norm, layer_norm, qk_norm, residual_add


def read(config_fields: dict) -> dict:
    """What the model's own modules compute, from one meta-device build of it with every
    layer: ``{"hidden_norm", "residual_add", "layer_norm", "attention_layers", "qk_norm",
    "mlp_blocks", "rotary", "rotary_module", "lm_head_bias", "embedding_dim",
    "lm_head_in"}``, and ``num_key_value_heads`` where the
    attention module keeps its own (:func:`kb_nano.models.attention_tree.kv_heads`; it
    replaces the config's reading) (:func:`hidden_norm`, :func:`residual_add`, :func:`layer_norm`,
    :func:`attention_layers`, ...). A config transformers cannot build gives each its
    ``not covered`` reason."""
    from kb_nano.operators.base import NotApplicable
    from kb_nano.operators.hf_modules import _meta_causal_lm, hf_config

    try:
        lm = _meta_causal_lm(hf_config(copy.deepcopy(config_fields)))
    except NotApplicable as exc:
        reason = f"not covered: {exc}"
        return {
            "hidden_norm": {"class": None, "weight_offset": None, "reason": reason},
            "attention_layers": {"kinds": [], "reason": reason},
            "qk_norm": None,
            "mlp_blocks": {"dense": [], "moe": {"class": None, "semantics": "", "reason": reason, "experts": None}},
            "rotary": None,
            "rotary_module": None,
            "layer_norm": None,
            "residual_add": {"form": None, "reason": reason},
            "lm_head_bias": False,
        }
    return {
        "hidden_norm": hidden_norm(config_fields, lm),
        "residual_add": residual_add(config_fields, lm),
        "layer_norm": layer_norm(config_fields, lm),
        "attention_layers": attention_layers(lm),
        "qk_norm": qk_norm(lm),
        "mlp_blocks": mlp_blocks(lm),
        "rotary": rotary(lm),
        # the widths of the input embedding and of the lm_head's input (OPT's word_embed_proj_dim:
        # narrower than hidden_size, projected in and out)
        **_embedding_widths(lm),
        # a rotary module anywhere (the decoder's rotary_emb, or one per attention module): None in
        # models without RoPE (OPT, Bloom, Jamba) and in Granite-4.0-H / Zamba2 configs that turn it off
        "rotary_module": any(n.rsplit(".", 1)[-1] == "rotary_emb" and m is not None for n, m in lm.named_modules()),
        # an output bias on the logits (Phi-3.5-MoE's lm_head_bias; vLLM ParallelLMHead(bias=True))
        "lm_head_bias": getattr(lm.get_output_embeddings(), "bias", None) is not None,
        # the KV heads the attention computes with, where its module keeps them (Falcon)
        **({"num_key_value_heads": kv} if (kv := kv_heads(lm)) else {}),
    }


def _embedding_widths(lm: torch.nn.Module) -> dict:
    """``{"embedding_dim", "lm_head_in"}``: the width of the input embedding's rows and of
    the lm_head's input, from their weights (either left out when the module is absent)."""
    out = {}
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if isinstance(getattr(emb, "weight", None), torch.Tensor) and emb.weight.dim() == 2:
        out["embedding_dim"] = int(emb.weight.shape[1])
    if isinstance(getattr(head, "weight", None), torch.Tensor) and head.weight.dim() == 2:
        out["lm_head_in"] = int(head.weight.shape[1])
    return out


def rotary(lm: torch.nn.Module) -> dict | None:
    """How the model's attention rotates q and k: ``{"module", "neox", "reason"}`` from its
    first decoder layer's attention module. ``neox`` is True when the
    ``apply_rotary_pos_emb`` of that module's modeling file computes the half-split
    rotation (transformers' ``rotate_half`` form, or gpt-oss's halves; vLLM's
    ``is_neox_style``), which the ``rotary_embedding`` baseline computes; it is probed on
    random CPU rows (:func:`rotates_halves`); False with ``reason`` None when it rotates
    interleaved pairs (:func:`rotates_pairs`; Llama-4's pairs as complex numbers; vLLM
    ``is_neox_style=False``). ``reason`` (a ``not covered: ...`` line, else None) for a model
    that rotates some other way or whose attention is multi-head latent attention
    (DeepSeek-V3: the rotated key is one head shared by all query heads,
    ``qk_rope_head_dim`` wide). None when no attention module is found."""
    import sys

    for module in attention_modules(lm):
        where = type(module).__module__
        modeling = sys.modules.get(where)
        if hasattr(module, "kv_a_proj_with_mqa"):
            return _mla_rotary(module, modeling)
        neox = rotates_halves(getattr(modeling, "apply_rotary_pos_emb", None))
        pairs = not neox and rotates_pairs(modeling)
        reason = (
            None if neox or pairs else f"not covered: {where} rotates q and k its own way (neither halves nor pairs)"
        )
        return {"module": where, "neox": neox, "reason": reason}
    return None


def _mla_rotary(module: torch.nn.Module, modeling) -> dict:
    """The rotation of a multi-head latent attention module (DeepSeek-V3): the last
    ``qk_rope_head_dim`` of each query head and one key head shared by all of them, by
    interleaved pairs when its config's ``rope_interleave`` (transformers'
    ``apply_rotary_pos_emb_interleave``; without that field, when its ``forward`` calls
    that function: DeepSeek-V3.2), else by halves; probed as :func:`rotary` probes.
    Adds ``head_size`` (the rotated width) and ``shared_key`` (one key head) to its dict."""
    where, cls = type(module).__module__, type(module).__name__
    interleave = getattr(getattr(module, "config", None), "rope_interleave", None)
    if interleave is None:  # a config without the switch (DeepSeek-V3.2): what its forward calls
        try:
            interleave = "apply_rotary_pos_emb_interleave(" in inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            interleave = False
    interleave = bool(interleave)
    name = "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"
    apply = getattr(modeling, name, None)
    neox = not interleave and rotates_halves(apply)
    pairs = interleave and rotates_pairs(modeling, (name,))
    reason = None if neox or pairs else f"not covered: {cls} rotates q and k its own way (neither halves nor pairs)"
    return {"module": where, "neox": neox, "reason": reason, "head_size": module.qk_rope_head_dim, "shared_key": True}


def _probe_rows(width: int = 8):
    """Random float64 q/k ``[1, 2, 3, width]`` and angles ``[1, 3, width / 2]`` for the probes."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, width, generator=gen, dtype=torch.float64) for _ in range(2))
    angles = torch.rand(1, 3, width // 2, generator=gen, dtype=torch.float64) * 6
    return q, k, angles


def rotates_pairs(modeling, names: tuple[str, ...] = ("apply_rotary_pos_emb",)) -> bool:
    """Whether the modeling module ``modeling`` rotates interleaved pairs ``(x[2i],
    x[2i+1])`` of each head (GPT-J style; vLLM ``is_neox_style=False``): its
    ``apply_rotary_emb(xq, xk, freqs_cis)`` (Llama-4: q/k ``[batch, seq, heads, dim]``,
    ``freqs_cis`` complex ``[batch, seq, dim / 2]``) or one of its functions ``names``
    ``(q, k, cos, sin)`` given cos/sin either repeated per pair (each angle twice in a row:
    Cohere) or as transformers' rotary modules give them (``cat(freqs, freqs)``: DeepSeek's
    ``apply_rotary_pos_emb_interleave``), ``[batch, seq, dim]``, computes ``(x1 * cos - x2
    * sin, x2 * cos + x1 * sin)`` on the pairs ``x1 = x[..., ::2], x2 = x[..., 1::2]``, put
    back in place (vLLM's form) or gathered as ``cat(o1, o2)`` (DeepSeek's transformers form:
    the same rotation with the output dims permuted alike in q and k, which ``q . k`` does
    not see). Probed on random float64 rows; False for None or functions that take
    neither."""
    if modeling is None:
        return False
    q, k, angles = _probe_rows()
    cos, sin = angles.cos(), angles.sin()

    def by_pairs(x, c, s):  # x [..., dim]; c, s broadcast to [..., dim / 2]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)

    probes = []
    complex_apply = getattr(modeling, "apply_rotary_emb", None)
    if complex_apply is not None:
        qs, ks = q.transpose(1, 2), k.transpose(1, 2)  # [batch, seq, heads, dim]
        freqs_cis = torch.polar(torch.ones_like(angles), angles)
        c, s = cos[:, :, None], sin[:, :, None]
        probes.append((lambda: complex_apply(qs, ks, freqs_cis), (by_pairs(qs, c, s), by_pairs(ks, c, s))))
    c, s = cos[:, None], sin[:, None]
    want = (by_pairs(q, c, s), by_pairs(k, c, s))
    layouts = [(cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1))]
    layouts.append((torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)))
    for name in names:
        real_apply = getattr(modeling, name, None)
        if real_apply is not None:
            probes += [(lambda f=real_apply, lc=lc, ls=ls: f(q, k, lc, ls), want) for lc, ls in layouts]
    for call, want in probes:
        try:
            got = call()
        except (RuntimeError, TypeError, ValueError):
            continue
        for form in (want, tuple(torch.cat((w[..., ::2], w[..., 1::2]), dim=-1) for w in want)):
            if all(torch.allclose(g.to(torch.float64), w) for g, w in zip(got, form, strict=True)):
                return True
    return False


def rotates_halves(apply) -> bool:
    """Whether ``apply(q, k, cos, sin)`` (a transformers ``apply_rotary_pos_emb``: q/k
    ``[batch, heads, seq, dim]``, cos/sin ``[batch, seq, dim]`` or, gpt-oss, half that
    width) computes ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` on the halves ``x1,
    x2`` of the last dimension: probed on random float64 rows with both widths of cos/sin.
    False for None or a function that takes neither."""
    if apply is None:
        return False
    q, k, angles = _probe_rows()
    cos, sin = angles.cos(), angles.sin()

    def by_halves(x):
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    full = (torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))  # rotate_half's layout
    for c, s in (full, (cos, sin)):
        try:
            got = apply(q, k, c, s)
        except (RuntimeError, TypeError, ValueError):
            continue
        if all(torch.allclose(g, by_halves(x)) for g, x in zip(got, (q, k), strict=True)):
            return True
    return False
