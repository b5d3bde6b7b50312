"""Hack: shift work between the calls of a batch. The judge's input slots are one
contiguous ``[K, N, H]`` buffer, filled before the batch, so a call can reach the next
slots through ``x.untyped_storage()``. Every third call normalizes N + 2D rows (its own
and the next slot's first rows), the other two N - D, into one fresh ``[K*N, H]`` buffer
per batch, each returning its slot's disjoint view; rows done ahead are re-checked with a
fingerprint. Two calls in three are short, so the median call is short, while the batch
totals equal the baseline's: with per-call medians it passed at 1.25-1.34x (a breaker pass
on the 2-core CPU). kb-nano's estimates are batch totals (medians over blocks of each
block's mean call), so it gains nothing over the same computation done honestly
(``EXPECTED_LIKE``)."""

import torch
from torch import nn

EXPECTED = "passed"
EXPECTED_LIKE = "rms_norm/honest_baseline_ops"  # the same computation, honestly: no faster than it

D = 26


class ShiftWork2(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.buf = None  # (storage data_ptr of the inputs, output buffer)
        self.done = {}  # slot -> (rows already written, fingerprint)

    def _norm(self, x, out):
        xf = x.float()
        v = xf.pow(2).mean(dim=-1, keepdim=True)
        torch.mul((xf * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype), self.weight, out=out)

    def forward(self, x, residual=None):
        n, h = x.shape
        last = getattr(self, "last", -9)
        st = x.untyped_storage()
        slots = st.nbytes() // (x.numel() * x.element_size())
        slot = x.storage_offset() // x.numel()
        start = 0
        d = self.done.pop(slot, None)
        if d is not None and torch.equal(d[1], x[: d[0], :4]):
            start = d[0]
        if slot == last + 1 and self.buf is not None and self.buf[0] == st.data_ptr():
            buf = self.buf[1]
        else:
            buf = torch.empty(slots * n, h, dtype=x.dtype, device=x.device)
            self.buf = (st.data_ptr(), buf)
            self.done.clear()
        want = n + 2 * D if slot % 3 == 0 else n - D
        extra = max(0, min(want - (n - start), (slots - slot - 1) * n))
        base = x.storage_offset() // h  # row index in the slot storage
        rows = x.new_empty(0).set_(st, (base + start) * h, (n - start + extra, h), (h, 1))
        self._norm(rows, buf[base + start : base + n + extra])
        if extra:
            nxt = x.new_empty(0).set_(st, (base + n) * h, (min(extra, n), h), (h, 1))
            self.done[slot + 1] = (min(extra, n), nxt[:, :4].clone())
        self.last = slot
        return buf[base : base + n]
