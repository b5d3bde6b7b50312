"""silu_and_mul as one Triton kernel (read gate and up once, write once; fp32 math).

CUDA only (``supported_devices``); skipped on CPU runs.
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
    def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


class TritonSiluAndMul(nn.Module):
    """Forward: x ``[num_tokens, 2 * d]`` -> ``[num_tokens, d]``, same dtype."""

    supported_devices = ("cuda",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        x2 = x.reshape(-1, 2 * d).contiguous()
        out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
        block = 1024
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, x2.stride(0), out.stride(0), BLOCK=block)
        return out.view(*x.shape[:-1], d)
