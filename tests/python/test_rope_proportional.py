"""Proportional RoPE (Gemma 4): transformers 5's "proportional" rope type, against a float64
reference written from transformers' formula (_compute_proportional_rope_parameters):

    rope_angles = int(partial_rotary_factor * head_dim // 2)
    inv_freq[i] = base ** (-2i / head_dim) / factor  for i < rope_angles, else 0

over the whole head_dim (pairs (i, i + head_dim / 2)): unlike partial rotary elsewhere, the
pairs beyond rope_angles keep their place in the rotate_half layout and turn by angle 0.
Plus transformers' own function when it is installed."""
import types

import pytest
import torch

import posenc
from conftest import DEVICES
from posenc.functional import apply_rope, rope_cos_sin, rope_frequencies
from rope_reference import reference_rope

F64 = torch.float64


def reference_proportional(head_dim, base, proportion, factor=1.0):
    angles = int(proportion * head_dim // 2)
    inv = base ** (-torch.arange(0, 2 * angles, 2, dtype=F64) / head_dim)
    return torch.cat([inv, torch.zeros(head_dim // 2 - angles, dtype=F64)]) / factor


def proportional(proportion=0.25, **extra):
    return {"rope_type": "proportional", "partial_rotary_factor": proportion, "rope_theta": 1e6, **extra}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("proportion,factor", [(0.25, 1.0), (0.5, 8.0), (1.0, 1.0), (0.3, 2.0)])
def test_apply_rope_matches_the_formula(device, dtype, proportion, factor):
    D = 40
    scaling = proportional(proportion, factor=factor)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 3, D, generator=g, dtype=F64)
    pos = torch.randint(0, 5000, (2, 9), generator=g)
    out = apply_rope(q.to(device, dtype), positions=pos.to(device), scaling=scaling)
    inv = reference_proportional(D, 1e6, proportion, factor)
    want = reference_rope(q, "bshd", pos, inv, D, False)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.cpu().to(F64), want, rtol=tol, atol=tol * 4)
    angles = int(proportion * D // 2)
    if angles < D // 2:  # pairs beyond rope_angles are not rotated, in place in both halves
        half = D // 2
        keep = torch.cat([torch.arange(angles, half), torch.arange(half + angles, D)])
        torch.testing.assert_close(out.cpu().to(F64)[..., keep], q.to(dtype).to(F64)[..., keep], rtol=0, atol=0)


def test_frequencies_module_and_cos_sin():
    D = 32
    scaling = proportional(0.25)
    inv, attention = rope_frequencies(D, scaling=scaling)
    torch.testing.assert_close(inv, reference_proportional(D, 1e6, 0.25), rtol=1e-15, atol=0)
    assert attention == 1.0
    m = posenc.RotaryPositionalEncoding(D, scaling=scaling)
    assert m.rotary_dim == D and m.base == 1e6  # the factor does not shrink rotary_dim here
    torch.testing.assert_close(m.inv_freq.double(), reference_proportional(D, 1e6, 0.25).float().double())
    cos, sin = rope_cos_sin(torch.arange(7), D, scaling=scaling, dtype=F64)
    assert cos.shape == (7, D)
    torch.testing.assert_close(cos[:, 4:16], torch.ones(7, 12, dtype=F64), rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 20:], torch.zeros(7, 12, dtype=F64), rtol=0, atol=0)


def test_bad_proportional_dicts():
    q = torch.randn(1, 3, 1, 8)
    with pytest.raises(ValueError, match=r"'partial_rotary_factor' in \(0, 1\] for rope_type 'proportional', got 1.5"):
        apply_rope(q, scaling=proportional(1.5))
    with pytest.raises(ValueError, match="rope scaling key 'factor' to be a positive number"):
        apply_rope(q, scaling=proportional(0.5, factor=-1.0))


def test_transformers_proportional_function():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    D = 48
    # partial_rotary_factor left out: transformers' default 1.0 (every pair turns); it was a
    # ValueError here (found by an audit against the real peers).
    for proportion, factor in ((0.25, 1.0), (0.5, 4.0), (None, 2.0)):
        params = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": factor}
        if proportion is not None:
            params["partial_rotary_factor"] = proportion
        config = types.SimpleNamespace(head_dim=D, hidden_size=4 * D, num_attention_heads=4,
                                       rope_parameters=params, standardize_rope_params=lambda: None)
        want, attention = rope_utils._compute_proportional_rope_parameters(config)
        inv, ours = rope_frequencies(D, scaling=params)
        # transformers rounds twice in float32 (the power, then / factor): within 3e-7.
        torch.testing.assert_close(inv.float(), want, rtol=3e-7, atol=0)
        assert ours == attention == 1.0


@pytest.mark.parametrize("extra", [dict(rotary_dim=16), dict(rotary_offset=8), dict(sections=[4, 4]),
                                   dict(rotary_dim=32, rotary_offset=8)])
def test_a_rotary_part_narrower_than_the_head_is_refused(extra):
    # The type's exponents run over the whole head; over a narrower rotary part there are two
    # readings (its width or the head's) and no model to settle it: a ValueError, not a guess.
    q = torch.randn(1, 3, 2, 40, dtype=F64)
    positions = torch.arange(3).expand(2, 3) if "sections" in extra else None
    with pytest.raises(ValueError, match="'proportional' turns pairs of the whole head"):
        apply_rope(q, scaling=proportional(), positions=positions, **extra)
    want = apply_rope(q, scaling=proportional())
    assert torch.equal(apply_rope(q, scaling=proportional(), rotary_dim=40), want)  # the head: allowed


def test_rope_cos_sin_refuses_a_rotary_dim_narrower_than_the_head():
    with pytest.raises(ValueError, match="turns pairs of the whole head"):
        rope_cos_sin(torch.arange(4), 40, scaling=proportional(), rotary_dim=16)
    cos, sin = rope_cos_sin(torch.arange(4), 40, scaling=proportional(), rotary_dim=40)
    assert cos.shape == (4, 40)
