"""Building a candidate's module: deferred torch init and randomised constant parameters."""

from __future__ import annotations

import pytest
import torch

from kb_nano.kernels.inputs import randomize_constant_parameters
from kb_nano.operators.norms import RMSNorm


def test_randomize_constant_parameters():
    m = RMSNorm(64)
    randomize_constant_parameters(m, seed=3)
    w = m.weight.detach()
    assert not torch.equal(w, torch.ones(64))
    assert 0.5 < float(w.mean()) < 1.5 and float(w.std()) > 0.01
    again = RMSNorm(64)
    randomize_constant_parameters(again, seed=3)
    assert torch.equal(again.weight, m.weight)  # seeded
    # randomly initialised parameters are left alone
    lin = torch.nn.Linear(4, 4, bias=False)
    before = lin.weight.detach().clone()
    randomize_constant_parameters(lin, seed=0)
    assert torch.equal(lin.weight, before)


def test_skip_init_defers_torch_init_to_tensors_outside_the_state_dict():
    from kb_nano.kernels.build import skip_init

    class Built(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64, 64))
            torch.nn.init.normal_(self.weight)  # loaded from the baseline next: never drawn
            self.register_buffer("scale", torch.zeros(4), persistent=False)
            torch.nn.init.ones_(self.scale)  # not in the state_dict: drawn after the build

    normal = torch.nn.init.normal_
    with skip_init() as deferred:
        module = Built()
        assert bool((module.weight == 0).all()) and bool((module.scale == 0).all())
    assert torch.nn.init.normal_ is normal
    deferred.replay(module)
    assert bool((module.weight == 0).all()) and bool((module.scale == 1).all())
    with pytest.raises(ValueError), skip_init():
        raise ValueError("a failing constructor")
    assert torch.nn.init.normal_ is normal
