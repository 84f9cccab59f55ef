"""LongRoPE scaling (Phi-3, Phi-3.5, Phi-4-mini): Hugging Face's "longrope" rope type, against
a float64 reference written from transformers' formula (modeling_rope_utils
_compute_longrope_parameters and dynamic_rope_update's longrope switch):

    inv_freq[i] = 1 / (ext[i] * base ** (2i / d)),  ext = long_factor if the longest position
                  + 1 exceeds original_max_position_embeddings, else short_factor
    attention_factor = given, else sqrt(1 + ln(factor) / ln(original)) (1 for factor <= 1),
                  factor = max_position_embeddings / original when not given
    cos, sin multiplied by attention_factor.

Plus the real transformers Phi-3 rotary embedding when transformers is installed."""
import math

import pytest
import torch
from torch.library import opcheck

import posenc
from conftest import DEVICES
from posenc.functional import apply_rope, rope_cos_sin, rope_frequencies
from posenc._rope import SCALING_KEYS
from rope_reference import reference_rope

F64 = torch.float64
ORIG = 64


def factors(n, seed, low=1.0, high=4.0):
    g = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(n, generator=g, dtype=F64)).tolist()


def longrope_dict(rotary_dim, **extra):
    d = {
        "rope_type": "longrope",
        "short_factor": factors(rotary_dim // 2, 1, 1.0, 1.5),
        "long_factor": factors(rotary_dim // 2, 2, 1.5, 8.0),
        "original_max_position_embeddings": ORIG,
    }
    d.update(extra)
    return d


def reference_longrope(rotary_dim, scaling, seq_len, base=10000.0, max_position_embeddings=None):
    """(inv_freq, attention_factor) in float64 from transformers' formula."""
    orig = scaling["original_max_position_embeddings"]
    ext = scaling["long_factor"] if seq_len > orig else scaling["short_factor"]
    ext = torch.tensor(ext, dtype=F64)
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim))
    attn = scaling.get("attention_factor")
    if attn is None:
        factor = scaling.get("factor")
        if factor is None:
            factor = max_position_embeddings / orig
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv_freq, attn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("regime", ["short", "long"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_apply_rope_matches_the_formula(device, dtype, regime, layout):
    B, S, H, D = 2, 23, 3, 32
    scaling = longrope_dict(D, factor=16.0)
    g = torch.Generator().manual_seed(3)
    start = 0 if regime == "short" else ORIG  # the longest position decides the regime
    pos = (start + torch.randperm(S, generator=g)).to(device)
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    q = torch.randn(shape, generator=g, dtype=F64).to(device)
    k = torch.randn(shape[:2] + (1,) + shape[3:] if layout == "bshd" else (B, 1, S, D), generator=g,
                    dtype=F64).to(device)
    out_q, out_k = apply_rope(q.to(dtype), k.to(dtype), positions=pos, scaling=scaling, layout=layout)
    seq_len = int(pos.max()) + 1
    assert (seq_len > ORIG) == (regime == "long")
    inv, attn = reference_longrope(D, scaling, seq_len)
    want_q = reference_rope(q.cpu(), layout, pos.cpu().expand(B, S), inv, D, False, attn)
    want_k = reference_rope(k.cpu(), layout, pos.cpu().expand(B, S), inv, D, False, attn)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out_q.cpu().to(F64), want_q, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(out_k.cpu().to(F64), want_k, atol=tol * 4, rtol=tol)


def test_regimes_differ_and_seq_len_switches_them():
    """The same positions rotate with the short factors, or with the long ones when seq_len
    (the global length, e.g. under context parallel) says the call is long."""
    D = 16
    scaling = longrope_dict(D, factor=8.0)
    q = torch.randn(1, 10, 2, D, dtype=F64)
    short = apply_rope(q, scaling=scaling)
    long = apply_rope(q, scaling=scaling, seq_len=ORIG + 1)
    at_orig = apply_rope(q, scaling=scaling, seq_len=ORIG)  # not beyond: still short
    assert not torch.allclose(short, long)
    torch.testing.assert_close(at_orig, short, rtol=0, atol=0)
    inv, attn = reference_longrope(D, scaling, ORIG + 1)
    pos = torch.arange(10)[None]
    torch.testing.assert_close(long, reference_rope(q, "bshd", pos, inv, D, False, attn), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("extra,max_len", [
    (dict(factor=32.0), None),
    (dict(attention_factor=1.25), None),
    (dict(factor=0.5), None),  # factor <= 1: attention factor 1
    ({}, 2048),  # the module fills factor = max_len / original, as transformers does
])
def test_attention_factor_and_frequencies(extra, max_len):
    D = 24
    scaling = longrope_dict(D, **extra)
    for seq_len in (0, ORIG, ORIG + 1, 10 * ORIG):
        if max_len is None:
            inv, attn = rope_frequencies(D, scaling=scaling, seq_len=seq_len)
        else:
            m = posenc.RotaryPositionalEncoding(D, max_len=max_len, scaling=scaling)
            inv, attn = m.inv_freq.double(), m.attention_scaling
            if seq_len != 0:
                continue  # the module's buffer holds the short (seq_len 0) frequencies
        want_inv, want_attn = reference_longrope(D, scaling, seq_len, max_position_embeddings=max_len)
        torch.testing.assert_close(inv.double(), want_inv, rtol=1e-7 if max_len else 1e-15, atol=0)
        assert attn == pytest.approx(want_attn, rel=1e-15)


def test_the_models_length_apart_from_max_len():
    """max_position_embeddings= gives the model's length the scaling defaults come from; max_len
    (the range check) stood for it, so a module whose max_len was set below the model's took a
    Phi-3 dict's attention factor (no factor in the dict) from max_len, silently."""
    D = 24
    scaling = longrope_dict(D)
    narrow = posenc.RotaryPositionalEncoding(D, max_len=128, max_position_embeddings=2048, scaling=scaling)
    model = posenc.RotaryPositionalEncoding(D, max_len=2048, scaling=scaling)
    assert narrow.attention_scaling == model.attention_scaling == pytest.approx(
        reference_longrope(D, scaling, 0, max_position_embeddings=2048)[1], rel=1e-15)
    assert posenc.RotaryPositionalEncoding(D, max_len=128, scaling=scaling).attention_scaling != model.attention_scaling
    q = torch.randn(2, 100, 3, D, dtype=F64)
    assert torch.equal(narrow(q, offset=20), model(q, offset=20))
    # yarn's original_max_position_embeddings likewise.
    yarn = {"rope_type": "yarn", "factor": 4.0}
    narrow = posenc.RotaryPositionalEncoding(D, max_len=128, max_position_embeddings=512, scaling=yarn)
    assert torch.equal(narrow(q), posenc.RotaryPositionalEncoding(D, max_len=512, scaling=yarn)(q))
    for bad, error in ((0, ValueError), (2048.0, TypeError)):
        with pytest.raises(error, match="RotaryPositionalEncoding: expected max_position_embeddings to be a positive"):
            posenc.RotaryPositionalEncoding(D, max_len=128, max_position_embeddings=bad, scaling=scaling)


def test_module_partial_rotary_and_packed_sequences():
    """Phi-3's partial_rotary_factor (lists of rotary_dim / 2), the module's max_len as
    max_position_embeddings, and packed "thd" sequences whose longest position decides."""
    D, rot = 32, 16
    scaling = longrope_dict(rot, partial_rotary_factor=0.5, rope_theta=5000.0)
    m = posenc.RotaryPositionalEncoding(D, max_len=4 * ORIG, scaling=scaling, layout="thd")
    assert m.rotary_dim == rot and m.base == 5000.0
    x = torch.randn(90, 2, D, dtype=F64)
    cu = torch.tensor([0, 20, 90])  # second sequence reaches position 69 >= ORIG: long factors
    out = m(x, cu_seqlens=cu)
    pos = torch.cat([torch.arange(20), torch.arange(70)])
    inv, attn = reference_longrope(rot, scaling, 70, base=5000.0, max_position_embeddings=4 * ORIG)
    want = reference_rope(x.unsqueeze(0), "bshd", pos[None], inv, rot, False, attn)[0]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[..., rot:], x[..., rot:], rtol=0, atol=0)


def test_rope_cos_sin_and_interleaved():
    D = 16
    scaling = longrope_dict(D, attention_factor=1.1)
    pos = torch.arange(ORIG - 3, ORIG + 5)
    cos, sin = rope_cos_sin(pos, D, scaling=scaling, dtype=F64)
    inv, attn = reference_longrope(D, scaling, ORIG + 5)
    angles = pos.to(F64)[:, None] * inv
    torch.testing.assert_close(cos, torch.cat([angles.cos(), angles.cos()], -1) * attn, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, torch.cat([angles.sin(), angles.sin()], -1) * attn, rtol=1e-12, atol=1e-12)
    q = torch.randn(2, 8, 3, D, dtype=F64)
    got = apply_rope(q, positions=pos, scaling=scaling, interleaved=True)
    want = reference_rope(q, "bshd", pos.expand(2, 8), inv, D, True, attn)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_and_opcheck(device):
    D = 8
    scaling = longrope_dict(D, factor=4.0)
    q = torch.randn(1, 5, 2, D, dtype=F64, device=device, requires_grad=True)
    k = torch.randn(1, 5, 1, D, dtype=F64, device=device, requires_grad=True)
    pos = torch.tensor([0, 70, 3, 9, 1], device=device)
    assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, positions=pos, scaling=scaling), (q, k))
    from posenc._rope import scaling_arguments

    rope_type, values = scaling_arguments(scaling)
    kwargs = dict(positions=pos, rope_type=rope_type, scaling=values, seq_len=-1)
    opcheck(torch.ops.posenc.rope.default, (q.detach(), k.detach()), kwargs)
    opcheck(torch.ops.posenc.rope_.default, (q.detach().clone(), k.detach().clone()), kwargs)


def test_compile_fullgraph_equals_eager():
    D = 16
    m = posenc.RotaryPositionalEncoding(D, max_len=4 * ORIG, scaling=longrope_dict(D))
    q = torch.randn(2, 12, 2, D)
    eager = m(q)
    compiled = torch.compile(lambda x: m(x), fullgraph=True)(q)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_bad_longrope_dicts():
    D = 8
    q = torch.randn(1, 3, 1, D)
    good = longrope_dict(D, factor=2.0)
    cases = [
        ({k: v for k, v in good.items() if k != "long_factor"}, ValueError, "needs the scaling key 'long_factor'"),
        ({**good, "short_factor": [1.0, 2.0]}, ValueError, "of equal lengths, got 2, 4"),
        ({**good, "short_factor": "1,2"}, TypeError, "'short_factor' to be a list of numbers"),
        ({**good, "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, ValueError,
         r"rotary_dim / 2 = 4 values each, got 3"),
        ({**good, "long_factor": [1.0, -2.0, 1.0, 1.0]}, ValueError, r"to hold positive numbers, got .* and -2 at index 1"),
        ({**good, "short_factor": [1.0, math.inf, 1.0, 1.0]}, ValueError, "to hold finite numbers, got inf"),
        ({k: v for k, v in good.items() if k != "factor"}, ValueError, "needs 'factor'"),
        ({k: v for k, v in good.items() if k != "original_max_position_embeddings"}, ValueError,
         "original_max_position_embeddings"),
        ({"rope_type": "linear", "factor": 2.0, "short_factor": [1.0] * 4}, ValueError,
         "belong to rope_type 'longrope'"),
    ]
    for scaling, error, message in cases:
        with pytest.raises(error, match=message):
            apply_rope(q, scaling=scaling)
    with pytest.raises(ValueError, match="'longrope' is for one position axis"):
        apply_rope(torch.randn(1, 3, 1, 8), scaling=good, sections=[2, 2])
    # The op itself: a list cut short is caught from its length.
    with pytest.raises(ValueError, match="then the lists short_factor and long_factor"):
        torch.ops.posenc.rope(q, rope_type="longrope", scaling=[0.0] * (1 + len(SCALING_KEYS)) + [1.0])


def test_transformers_phi3_rotary_embedding():
    """The real Phi-3 rotary embedding (transformers, when installed) against rope_cos_sin
    given its config's rope parameters and max_position_embeddings: float32 rounding."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    D, heads = 16, 2
    short, long = factors(D // 2, 4, 1.0, 1.3), factors(D // 2, 5, 2.0, 9.0)
    config = transformers.Phi3Config(
        hidden_size=D * heads, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
        original_max_position_embeddings=ORIG,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
    )
    emb = Phi3RotaryEmbedding(config)
    params = dict(config.rope_parameters)
    for length in (ORIG - 10, ORIG + 30):
        pos = torch.arange(length)[None]
        x = torch.randn(1, length, D)
        cos_hf, sin_hf = emb(x, pos)
        cos, sin = rope_cos_sin(pos, D, scaling=params, max_position_embeddings=config.max_position_embeddings)
        torch.testing.assert_close(cos, cos_hf, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(sin, sin_hf, rtol=2e-5, atol=2e-5)
