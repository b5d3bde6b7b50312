"""model through transformers' own SDPA attention (``attn_implementation="sdpa"``:
``torch.nn.functional.scaled_dot_product_attention`` with the causal mask) instead of the
baseline's eager attention; every other module is the same transformers code."""

from kb_nano.operators.layers import CausalLM


class SdpaCausalLM(CausalLM):
    """Same constructor, forward and state_dict as kb_nano's CausalLM; weights always come
    from ``load_state_dict``, so no random init."""

    attn_implementation = "sdpa"
    init_weights = False
