"""apply_rope(..., inverse=True) (issue 39, item 4: DeepSeek V4 rotates its attention output
back by minus the angle): the rotation by -angle of every pair, against float64 references of
the formulas; the round trip; gradients (the forward rotation), forward AD, compile; C++ takes
it as ApplyRopeOptions().inverse(true) (tests/cpp/test_rope.cpp)."""

import pytest
import torch
from torch.library import opcheck

import posenc  # noqa: F401
from posenc.functional import apply_rope
from rope_reference import reference_inv_freq, reference_rope

F64 = torch.float64
SCALINGS = [None, {"rope_type": "linear", "factor": 2.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 16}]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
@pytest.mark.parametrize("interleaved,rotary_dim,rotary_offset", [(False, None, 0), (True, 16, 0), (True, None, 8)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_inverse_is_the_rotation_by_minus_the_angle(scaling, interleaved, rotary_dim, rotary_offset, layout):
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 7, 3, 32
    x = torch.randn(B, S, H, D, dtype=F64, generator=g)
    pos = torch.randint(0, 40, (B, S), generator=g)
    x_l = x.transpose(1, 2) if layout == "bhsd" else x
    kw = dict(positions=pos, scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim,
              rotary_offset=rotary_offset, layout=layout, base=500.0)
    got = apply_rope(x_l, inverse=True, **kw)
    rot = rotary_dim or D - rotary_offset
    inv_freq, attn = reference_inv_freq(rot, 500.0, scaling)
    # Minus the angle: the reference at negated frequencies, on the rotated part.
    part = x[..., rotary_offset:rotary_offset + rot]
    want = x.clone()
    want[..., rotary_offset:rotary_offset + rot] = reference_rope(part, "bshd", pos, -inv_freq, rot, interleaved, attn)
    torch.testing.assert_close(got.transpose(1, 2) if layout == "bhsd" else got, want)
    # The round trip: x times the attention factor squared.
    back = apply_rope(apply_rope(x_l, **kw), inverse=True, **kw)
    want_back = x_l.clone()
    r = slice(rotary_offset, rotary_offset + rot)
    want_back[..., r] = want_back[..., r] * attn**2
    torch.testing.assert_close(back, want_back)


def test_inverse_gradients_forward_ad_and_compile():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 16, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, dtype=F64, generator=g, requires_grad=True)
    pos = torch.randint(0, 30, (2, 5), generator=g)

    def f(q, k):
        return apply_rope(q, k, positions=pos, inverse=True, interleaved=True)

    assert torch.autograd.gradcheck(f, (q, k), check_forward_ad=True, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (q, k))
    # The gradient of the inverse rotation is the forward rotation.
    gq = torch.randn_like(q)
    (grad,) = torch.autograd.grad(f(q, k)[0], q, gq)
    torch.testing.assert_close(grad, apply_rope(gq, positions=pos, interleaved=True))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(q, k), f(q, k)):
        torch.testing.assert_close(a, b)
    opcheck(torch.ops.posenc.rope, (q.detach(), k.detach()), dict(positions=pos, inverse=True))


def test_inverse_in_place():
    x = torch.randn(1, 6, 2, 16)
    want = apply_rope(x, offset=3, inverse=True)
    y = x.clone()
    assert apply_rope(y, offset=3, inverse=True, inplace=True) is y
    assert torch.equal(y, want)
