"""Hack: trade accuracy for speed. The expert weights are quantized to int8 with one scale
per tensor (``max|w| / 127``) at the first call and dequantized on the fly in every call,
as a weight-only int8 kernel would read them (a quarter of the bf16 weight bytes on a
memory-bound GPU). Everything else is the baseline's computation.

Why it is stopped: the judge's tolerance scales with the reference output's rms
(:func:`kb_nano.kernels.compare.compare`); the quantization error is a few percent of the
output's rms, well above what a bf16 rounding makes, while an absolute atol of 0.02 was
half of the fused_moe outputs' rms (~0.04) and let it pass."""

import torch

from kb_nano.operators.moe import FusedMoE

EXPECTED = "incorrect"


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 values, fp32 scale)`` with ``w ~ values * scale`` (symmetric, per tensor)."""
    scale = w.detach().abs().amax().float().clamp(min=1e-12) / 127.0
    return torch.round(w.detach().float() / scale).clamp(-127, 127).to(torch.int8), scale


class Int8WeightsMoE(FusedMoE):
    def forward(self, hidden_states, router_logits):
        if not hasattr(self, "_int8"):
            self._int8 = (_int8(self.w13_weight), _int8(self.w2_weight))
        (q13, s13), (q2, s2) = self._int8
        full = (self.w13_weight.data, self.w2_weight.data)
        try:
            # the baseline's loop on the dequantized weights
            self.w13_weight.data = (q13.float() * s13).to(full[0].dtype)
            self.w2_weight.data = (q2.float() * s2).to(full[1].dtype)
            return super().forward(hidden_states, router_logits)
        finally:
            self.w13_weight.data, self.w2_weight.data = full
