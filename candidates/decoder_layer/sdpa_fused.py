"""decoder_layer with fused torch ops around the same transformers weights:
``F.rms_norm`` for the norms (and Qwen3's per-head q/k norms), rotary in float32 with one
rounding, ``F.scaled_dot_product_attention`` (causal, grouped KV heads) instead of eager
attention, and ``silu(gate) * up`` written out for gated-SiLU MLPs. Other MLPs (MoE blocks)
run the transformers module unchanged."""

import torch
import torch.nn.functional as F

from kb_nano.operators.layers import DecoderLayer


class SdpaFusedDecoderLayer(DecoderLayer):
    """Same constructor, forward and state_dict (the transformers keys) as kb_nano's
    DecoderLayer; weights always come from ``load_state_dict``, so no random init."""

    init_weights = False

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not hasattr(self.input_layernorm, "variance_epsilon") or hasattr(self, "pre_feedforward_layernorm"):
            raise TypeError(
                f"{type(self).__name__} implements Llama/Qwen-style layers (x*w RMSNorm, no sandwich norms); "
                f"this model's layer uses {type(self.input_layernorm).__name__}"
            )
        attn = self.self_attn
        n, d = hidden_states.shape[0], attn.head_dim
        dtype = hidden_states.dtype
        x = self._norm(self.input_layernorm, hidden_states)

        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(n, -1, d)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(n, -1, d)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(n, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        cos, sin = self._cos_sin(positions)
        q, k = self._rotate(q, cos, sin, dtype), self._rotate(k, cos, sin, dtype)

        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=n > 1,
            scale=attn.scaling,
            enable_gqa=True,
        )
        out = F.linear(out.transpose(0, 1).reshape(n, -1), attn.o_proj.weight, attn.o_proj.bias)
        hidden_states = hidden_states + out

        x = self._norm(self.post_attention_layernorm, hidden_states)
        return hidden_states + self._mlp(x)

    @staticmethod
    def _norm(norm, x):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    def _cos_sin(self, positions):
        rot = self.rotary_emb
        freqs = positions.float()[:, None] * rot.inv_freq.float()[None, :]
        return freqs.cos() * rot.attention_scaling, freqs.sin() * rot.attention_scaling

    @staticmethod
    def _rotate(x, cos, sin, dtype):
        x = x.float()
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)

    def _mlp(self, x):
        mlp = self.mlp
        gated = all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
        if not gated or self.hf_config.hidden_act != "silu":
            return mlp(x)
        return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
