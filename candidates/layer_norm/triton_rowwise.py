"""layer_norm as a Triton kernel: one program per token row, mean and variance in fp32, the
affine in fp32, one rounding.

Runs on CUDA only (``supported_devices``); on a CPU run the harness records it as
``skipped``. Triton is optional at import time so CPU-only installs can still list it.
"""

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the harness skips this candidate before calling it
    triton = None

if triton is not None:

    @triton.jit
    def _layer_norm_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, stride_x, stride_out, n_cols, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        centred = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        y = centred * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


class TritonLayerNorm(nn.Module):
    """Same constructor, forward and state_dict (``weight``, ``bias``) as kb_nano's LayerNorm
    baseline.

    Forward: x ``[num_tokens, hidden_size]`` -> same shape and dtype.
    """

    supported_devices = ("cuda",)

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.hidden_size).contiguous()
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        block = triton.next_power_of_2(self.hidden_size)
        bias = self.bias if self.bias is not None else self.weight  # not read without HAS_BIAS
        _layer_norm_kernel[(x2.shape[0],)](
            x2,
            self.weight,
            bias,
            out,
            x2.stride(0),
            out.stride(0),
            self.hidden_size,
            self.eps,
            HAS_BIAS=self.bias is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
        return out.view(x.shape)
