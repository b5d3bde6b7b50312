"""Building a candidate's module in its worker without paying for values it never keeps.

A candidate's parameters are the baseline's, loaded right after it is built, so drawing
its own initial values (``torch.nn.init``) and casting them to the scenario dtype is
wasted work that grows with the weights (an embedding of 128256 x 4096: seconds on the
CPU). :func:`skip_init` defers the draws, :func:`unset_storage` gives what the state_dict
loads fresh storage in its final dtype instead of a cast.
"""

from __future__ import annotations

import contextlib

import torch


def unset_storage(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every tensor of ``module``'s state_dict new, uninitialized storage on ``device``
    in the dtype ``module.to(device, dtype)`` would give it (floating point: ``dtype``;
    others keep theirs), through ``.data`` as ``Module.to`` itself does, so references to
    the Parameter objects stay valid. Call only when the state_dict is loaded next."""
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            want = dtype if t.is_floating_point() else t.dtype
            t.data = torch.empty(t.shape, dtype=want, device=device)


class _Deferred:
    """The ``torch.nn.init`` calls :func:`skip_init` skipped: ``(function, tensor, args,
    kwargs)``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def replay(self, module: torch.nn.Module) -> None:
        """Run the skipped calls whose tensor shares no storage with ``module``'s
        ``state_dict`` (a non-persistent buffer, a plain tensor attribute): what
        ``load_state_dict`` overwrites is not drawn, everything else is as built."""
        loaded = {t.untyped_storage().data_ptr() for t in module.state_dict().values() if t.numel()}
        for fn, tensor, args, kwargs in self.calls:
            if not tensor.numel() or tensor.untyped_storage().data_ptr() not in loaded:
                with torch.no_grad():
                    fn(tensor, *args, **kwargs)
        self.calls = []


@contextlib.contextmanager
def skip_init():
    """``torch.nn.init``'s in-place initializers (``normal_``, ``kaiming_uniform_``, ...)
    are deferred inside: a module whose parameters are loaded afterwards is built without
    drawing them (``normal_`` over a 128256 x 4096 embedding: 2.0 s on one core of the 2-core
    AMD EPYC, ``torch.empty(128256 * 4096).normal_()``). Yields a :class:`_Deferred`
    whose ``replay(module)`` then runs the calls on tensors outside the module's
    state_dict. transformers' ``no_init_weights`` skips them the same way (without the
    replay, and with a ``PreTrainedModel`` part that would import transformers' modeling
    code into every worker)."""
    from torch.nn import init

    names = [n for n, f in vars(init).items() if n.endswith("_") and not n.startswith("_") and callable(f)]
    saved = {n: getattr(init, n) for n in names}
    deferred = _Deferred()

    def later(fn):
        def skipped(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor):
                deferred.calls.append((fn, tensor, args, kwargs))
            return tensor

        return skipped

    try:
        for n in names:
            setattr(init, n, later(saved[n]))
        yield deferred
    finally:
        for n, f in saved.items():
            setattr(init, n, f)
