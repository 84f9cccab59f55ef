"""rope_cos_sin and apply_rope_cos_sin against float64 references written here from the
formulas of Hugging Face transformers (LlamaRotaryEmbedding + modeling_rope_utils for the
tables, apply_rotary_pos_emb / GPT-J's rotate_every_two for the rotation), not from posenc;
and apply_rope_cos_sin(q, k, *rope_cos_sin(...)) against posenc.functional.apply_rope."""


import pytest
import torch

import posenc
from rope_reference import reference_inv_freq

F = posenc.functional
F64 = torch.float64


# --- references ------------------------------------------------------------------------------


def hf_inv_freq(dim, base, scaling, max_pos, seq_len):
    """(inv_freq, attention_scaling) in float64, as modeling_rope_utils computes them: the
    shared reference (rope_reference.py), original_max_position_embeddings defaulting to
    the model's max_position_embeddings as transformers does."""
    if scaling is not None and scaling["rope_type"] in ("dynamic", "yarn"):
        scaling = {"original_max_position_embeddings": max_pos, **scaling}
    return reference_inv_freq(dim, base, scaling, seq_len)


def hf_cos_sin(position_ids, dim, base=10000.0, scaling=None, max_pos=2048):
    """LlamaRotaryEmbedding.forward in float64: freqs = inv_freq x positions, emb = cat(freqs,
    freqs), cos/sin times the attention scaling. position_ids (batch, seq)."""
    seq_len = int(position_ids.max()) + 1
    inv_freq, attention = hf_inv_freq(dim, base, scaling, max_pos, seq_len)
    freqs = position_ids.to(F64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


def reference_rotate(x, cos, sin, layout, interleaved):
    """Pairwise rotation in float64, written out per pair: x (bhsd or bshd), cos/sin (batch or
    1, seq, rot) with the pair's angle at both of its features."""
    x = x.to(F64)
    if layout == "bshd":
        x = x.transpose(1, 2)
    c, s = cos.to(F64)[:, None], sin.to(F64)[:, None]
    rot = cos.shape[-1]
    out = x.clone()
    for i in range(rot // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rot // 2)
        out[..., a] = x[..., a] * c[..., a] - x[..., b] * s[..., a]
        out[..., b] = x[..., b] * c[..., b] + x[..., a] * s[..., b]
    return out.transpose(1, 2) if layout == "bshd" else out


def interleave_tables(cos, sin):
    """Hugging Face cat(freqs, freqs) tables -> GPT-J's repeat_interleave(freqs, 2) ones."""
    half = cos.shape[-1] // 2
    return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)


def make_qk(batch, heads, kv_heads, seq, head_dim, layout, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=F64)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=F64)
    if layout == "bshd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return q.to(dtype), k.to(dtype)


SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 96},
    "yarn_mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 24, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                              "attention_factor": 1.5},
}
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-6, atol=2e-6),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


# --- rope_cos_sin --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_cos_sin_matches_hf_rotary_embedding(name, batched, dtype):
    scaling, dim, base = SCALINGS[name], 24, 5000.0
    g = torch.Generator().manual_seed(1)
    shape = (3, 11) if batched else (11,)
    pos = torch.randint(0, 3000, shape, generator=g)
    cos, sin = F.rope_cos_sin(pos, dim, base=base, scaling=scaling, dtype=dtype)
    want_cos, want_sin = hf_cos_sin(pos.reshape(-1, 11), dim, base, scaling)
    assert cos.shape == sin.shape == shape + (dim,) and cos.dtype == sin.dtype == dtype
    torch.testing.assert_close(cos.reshape(-1, 11, dim).to(F64), want_cos.to(dtype).to(F64), **TOLERANCE[dtype])
    torch.testing.assert_close(sin.reshape(-1, 11, dim).to(F64), want_sin.to(dtype).to(F64), **TOLERANCE[dtype])


def test_rope_cos_sin_yarn_attention_factor_can_be_left_out():
    scaling = SCALINGS["yarn"]
    pos = torch.arange(50)
    cos, sin = F.rope_cos_sin(pos, 16, scaling=scaling, dtype=F64, attention_scaling=False)
    inv_freq, attention = hf_inv_freq(16, 10000.0, scaling, 2048, 50)
    assert attention > 1.1
    freqs = pos.to(F64)[:, None] * inv_freq
    torch.testing.assert_close(cos, torch.cat((freqs, freqs), -1).cos(), rtol=1e-12, atol=1e-12)
    scaled, _ = F.rope_cos_sin(pos, 16, scaling=scaling, dtype=F64)
    torch.testing.assert_close(scaled, cos * attention, rtol=1e-12, atol=1e-12)


def test_rope_cos_sin_dynamic_and_max_position_embeddings():
    """dynamic scales by the longest position; yarn and dynamic take original_max_position_embeddings
    from max_position_embeddings when the dict has none, as transformers fills it from the config."""
    pos = torch.tensor([[0, 5, 100, 399]])
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    cos, sin = F.rope_cos_sin(pos, 32, scaling=dynamic, max_position_embeddings=128, dtype=F64)
    want_cos, want_sin = hf_cos_sin(pos, 32, scaling=dynamic, max_pos=128)
    torch.testing.assert_close(cos, want_cos, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, want_sin, rtol=1e-12, atol=1e-12)
    short = torch.tensor([[0, 5, 100]])  # within max_position_embeddings: the unscaled table
    torch.testing.assert_close(F.rope_cos_sin(short, 32, scaling=dynamic, max_position_embeddings=128, dtype=F64),
                               F.rope_cos_sin(short, 32, dtype=F64), rtol=0, atol=0)
    # A dynamic dict that states another baseline than the model's: transformers scales by
    # max_position_embeddings and ignores the key, posenc read the key (tables 1.5 off): refused.
    with pytest.raises(ValueError, match=r"transformers reads the config's max_position_embeddings \(128\) and "
                                         r"ignores the dict's original_max_position_embeddings \(64\)"):
        F.rope_cos_sin(pos, 32, scaling={**dynamic, "original_max_position_embeddings": 64},
                       max_position_embeddings=128)
    cos, _ = F.rope_cos_sin(pos, 32, scaling={**dynamic, "original_max_position_embeddings": 128},
                            max_position_embeddings=128, dtype=F64)
    torch.testing.assert_close(cos, want_cos, rtol=1e-12, atol=1e-12)  # the same length twice: one reading
    yarn = {"rope_type": "yarn", "factor": 4.0}
    cos, sin = F.rope_cos_sin(pos, 32, scaling=yarn, max_position_embeddings=96, dtype=F64)
    want_cos, want_sin = hf_cos_sin(pos, 32, scaling=yarn, max_pos=96)
    torch.testing.assert_close(cos, want_cos, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, want_sin, rtol=1e-12, atol=1e-12)


def test_rope_cos_sin_transformers5_dict_keys():
    """rope_theta and partial_rotary_factor of a rope_parameters dict set base and the width."""
    pos = torch.arange(9)
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    cos, sin = F.rope_cos_sin(pos, 32, scaling=params, dtype=F64)
    assert cos.shape == (9, 16)
    want_cos, want_sin = hf_cos_sin(pos[None], 16, 500.0, {"rope_type": "linear", "factor": 2.0})
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-12, atol=1e-12)
    cos8, _ = F.rope_cos_sin(pos, 32, rotary_dim=8, dtype=F64)
    torch.testing.assert_close(cos8, hf_cos_sin(pos[None], 8)[0][0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq", [50, 200])  # below and above max_position_embeddings (dynamic rescales above)
def test_rope_cos_sin_matches_transformers_rotary_embedding(seq):
    """Against the real LlamaRotaryEmbedding, which computes in float32: float32 rounding of
    angles up to ~200 rad (absolute error ~ position * 2**-24)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for params in ({"rope_type": "default", "rope_theta": 10000.0},
                   {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                   {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                   {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}):
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=96,
                                          rope_parameters=params)
        rotary = LlamaRotaryEmbedding(config)
        pos = torch.arange(seq)[None]
        hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = F.rope_cos_sin(pos, 32, scaling=params, max_position_embeddings=96)
        torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-4)
        torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-4)
        # The module, given the model's length, rotates with the same tables (theirs rounded
        # to float32 first: a few float32 ulps apart).
        q = torch.randn(1, seq, 2, 32, generator=torch.Generator().manual_seed(seq))
        module = posenc.RotaryPositionalEncoding(32, max_len=256, max_position_embeddings=96, scaling=params)
        torch.testing.assert_close(module(q), F.apply_rope_cos_sin(q, None, cos, sin, layout="bshd"),
                                   rtol=2**-20, atol=1e-6)


def test_rope_cos_sin_device_and_empty():
    cos, sin = F.rope_cos_sin(torch.zeros(0, dtype=torch.long), 8)
    assert cos.shape == sin.shape == (0, 8)
    cos, sin = F.rope_cos_sin(torch.tensor([0], dtype=torch.int32), 8)
    torch.testing.assert_close(cos, torch.ones(1, 8))
    torch.testing.assert_close(sin, torch.zeros(1, 8))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(positions=[0, 1], dim=8), TypeError, "positions to be a Tensor"),
        (dict(positions=torch.zeros(3), dim=8), TypeError, "positions to be an integer tensor"),
        (dict(positions=torch.zeros(2, 2, 2, dtype=torch.long), dim=8), ValueError, r"\(seq,\) or \(batch, seq\)"),
        (dict(positions=torch.arange(3), dim=0), ValueError, "dim .* positive integer, got 0"),
        (dict(positions=torch.arange(3), dim=8.0), TypeError, "dim .* positive integer, got 8.0"),
        (dict(positions=torch.arange(3), dim=8, rotary_dim=10), ValueError, r"rotary_dim .* \[2, dim=8\], got 10"),
        (dict(positions=torch.arange(3), dim=8, rotary_dim=3), ValueError, "rotary_dim to be even"),
        (dict(positions=torch.arange(3), dim=8, rotary_dim=4.0), TypeError, "rotary_dim to be an int or None"),
        (dict(positions=torch.arange(3), dim=8, dtype=torch.int32), TypeError, "dtype to be a floating-point"),
        (dict(positions=torch.arange(3), dim=8, scaling={"rope_type": "yarn", "factor": 2.0}), ValueError,
         "original_max_position_embeddings"),
        (dict(positions=torch.arange(3), dim=8, scaling={"rope_type": "xpos"}), ValueError, "unknown rope scaling"),
        (dict(positions=torch.arange(3), dim=8, scaling={"rope_type": "default", "mrope_section": [2, 1, 1]}),
         ValueError, "multi-axis"),
        (dict(positions=torch.arange(3), dim=8, max_position_embeddings=-1), ValueError, "max_position_embeddings"),
    ],
)
def test_rope_cos_sin_bad_arguments(kwargs, error, match):
    positions, dim = kwargs.pop("positions"), kwargs.pop("dim")
    with pytest.raises(error, match=match):
        F.rope_cos_sin(positions, dim, **kwargs)


# --- apply_rope_cos_sin --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot, table", [(20, "batch"), (20, "shared"), (12, "batch1"), (6, "shared")])
def test_apply_rope_cos_sin_matches_reference(layout, interleaved, dtype, rot, table):
    batch, heads, kv_heads, seq, head_dim = 3, 5, 1, 7, 20  # odd sizes, GQA (k has 1 head), partial rotary
    q, k = make_qk(batch, heads, kv_heads, seq, head_dim, layout, dtype)
    g = torch.Generator().manual_seed(2)
    rows = {"batch": batch, "batch1": 1, "shared": 1}[table]
    angles = torch.rand(rows, seq, rot // 2, generator=g, dtype=F64) * 200
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    scale = 1.3  # tables need not be unit: yarn's attention factor
    cos, sin = (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
    args = (cos[0], sin[0]) if table == "shared" else (cos, sin)
    out_q, out_k = F.apply_rope_cos_sin(q, k, *args, layout=layout, interleaved=interleaved)
    assert out_q.dtype == out_k.dtype == dtype and out_q.shape == q.shape and out_k.shape == k.shape
    for out, x in ((out_q, q), (out_k, k)):
        want = reference_rotate(x, cos, sin, layout, interleaved)
        torch.testing.assert_close(out.to(F64), want, **TOLERANCE[dtype])
        torch.testing.assert_close(out[..., rot:], x[..., rot:], rtol=0, atol=0)  # pass-through features
    only_q = F.apply_rope_cos_sin(q, None, *args, layout=layout, interleaved=interleaved)
    torch.testing.assert_close(only_q, out_q, rtol=0, atol=0)


def test_apply_rope_cos_sin_mixed_table_dtype():
    """float32 tables with bfloat16 q: computed in float32, returned in bfloat16."""
    q, k = make_qk(2, 3, 3, 5, 8, "bhsd", torch.bfloat16)
    cos, sin = F.rope_cos_sin(torch.arange(5), 8)
    out_q, out_k = F.apply_rope_cos_sin(q, k, cos, sin)
    assert out_q.dtype == out_k.dtype == torch.bfloat16
    want = reference_rotate(q, cos[None], sin[None], "bhsd", False)
    torch.testing.assert_close(out_q.to(F64), want.to(torch.bfloat16).to(F64), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_apply_rope_cos_sin_non_contiguous(layout):
    batch, heads, seq, head_dim, rot = 2, 3, 6, 16, 12
    base_q = torch.randn(seq, batch, heads, 2 * head_dim, dtype=F64)
    # every other feature of a (seq, batch, heads, 2 * head_dim) buffer, permuted to the layout
    q = base_q[..., ::2].permute(1, 2, 0, 3) if layout == "bhsd" else base_q[..., ::2].transpose(0, 1)
    k = q.flip(1)
    assert not q.is_contiguous()
    tables = F.rope_cos_sin(torch.arange(seq).expand(batch, seq), rot, dtype=F64)
    cos, sin = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in tables)  # (batch, seq, rot), seq-major
    assert not cos.is_contiguous()
    out_q, out_k = F.apply_rope_cos_sin(q, k, cos, sin, layout=layout)
    torch.testing.assert_close(out_q, reference_rotate(q, cos, sin, layout, False), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_k, reference_rotate(k, cos, sin, layout, False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_apply_rope_cos_sin_gradcheck(interleaved, layout):
    q, k = make_qk(2, 3, 1, 4, 10, layout, F64)
    q.requires_grad_(), k.requires_grad_()
    angles = torch.rand(2, 4, 4, dtype=F64) * 10
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    cos, sin = angles.cos().requires_grad_(), angles.sin().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, c, s: F.apply_rope_cos_sin(q, k, c, s, layout=layout, interleaved=interleaved), (q, k, cos, sin)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_apply_rope_cos_sin_table_gradients_of_half_q_in_float32(dtype, interleaved, layout):
    """float32 tables, half-precision q and k: the tables' gradients (sums over batch and
    heads of products of q and the incoming gradient) are the float64 ones rounded to float32.
    They were taken in q's dtype: float16 sums overflowed to inf (here ~1e5), bfloat16 ones
    lost 3 digits."""
    batch, heads, seq, head_dim, rot = 64, 8, 3, 10, 8
    g = torch.Generator().manual_seed(3)
    q, k = (torch.rand(batch, heads, seq, head_dim, generator=g) * 4 + 8).to(dtype), None
    k = (torch.rand(batch, 2, seq, head_dim, generator=g) * 4 + 8).to(dtype)
    if layout == "bshd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angles = torch.rand(seq, rot // 2, generator=g, dtype=F64) * 10
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    cos, sin = angles.cos().float().requires_grad_(), angles.sin().float().requires_grad_()
    out_q, out_k = F.apply_rope_cos_sin(q, k, cos, sin, layout=layout, interleaved=interleaved)
    torch.autograd.backward((out_q, out_k), (q, k))  # incoming gradients correlated with q, k
    c64, s64 = cos.detach().double().requires_grad_(), sin.detach().double().requires_grad_()
    want_q = reference_rotate(q.double(), c64[None], s64[None], layout, interleaved)
    want_k = reference_rotate(k.double(), c64[None], s64[None], layout, interleaved)
    torch.autograd.backward((want_q, want_k), (q.double(), k.double()))
    assert c64.grad.abs().max() > 6e4  # beyond float16
    for got, want in ((cos.grad, c64.grad), (sin.grad, s64.grad)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)


# --- the same rotation as apply_rope ---------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn_mscale"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 10])
def test_apply_rope_cos_sin_equals_apply_rope(name, layout, interleaved, rotary_dim):
    scaling, head_dim, seq = SCALINGS[name], 18, 9
    q, k = make_qk(2, 4, 2, seq, head_dim, layout, F64, seed=3)
    pos = torch.randint(0, 5000, (2, seq), generator=torch.Generator().manual_seed(4))
    cos, sin = F.rope_cos_sin(pos, head_dim, base=20000.0, scaling=scaling, rotary_dim=rotary_dim, dtype=F64)
    if interleaved:
        cos, sin = interleave_tables(cos, sin)
    got = F.apply_rope_cos_sin(q, k, cos, sin, layout=layout, interleaved=interleaved)
    want = F.apply_rope(q, k, positions=pos, base=20000.0, scaling=scaling, rotary_dim=rotary_dim, layout=layout,
                        interleaved=interleaved)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_apply_rope_cos_sin_equals_apply_rope_float32_shared_positions():
    q, k = make_qk(3, 8, 2, 33, 64, "bhsd", torch.float32, seed=5)
    pos = torch.arange(100, 133)
    got = F.apply_rope_cos_sin(q, k, *F.rope_cos_sin(pos, 64, scaling=SCALINGS["llama3"]))
    want = F.apply_rope(q, k, positions=pos, scaling=SCALINGS["llama3"], layout="bhsd")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # tables rounded to float32 once


# --- bad arguments ------------------------------------------------------------------------------


def _valid():
    q, k = make_qk(2, 4, 2, 5, 8, "bhsd", torch.float32)
    cos, sin = F.rope_cos_sin(torch.arange(5), 8)
    return dict(q=q, k=k, cos=cos, sin=sin)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q=[1.0]), TypeError, "expected q to be a Tensor, got list"),
        (dict(k=3), TypeError, "expected k to be a Tensor, got int"),
        (dict(cos=None), TypeError, "expected cos to be a Tensor, got NoneType"),
        (dict(q=torch.zeros(2, 4, 5, 8, dtype=torch.long)), TypeError,
         "q to be a float16, bfloat16, float32 or float64 tensor, got torch.int64"),
        # float8: the error named a kernel (q) or came from autograd at backward (cos, sin)
        (dict(q=torch.zeros(2, 4, 5, 8).to(torch.float8_e4m3fn)), TypeError, "q to be a float16, .* got torch.float8_e4m3fn"),
        (dict(cos=torch.zeros(5, 8).to(torch.float8_e4m3fn)), TypeError, "cos to be a float16, .* got torch.float8_e4m3fn"),
        (dict(sin=torch.zeros(5, 8).to(torch.float8_e5m2)), TypeError, "sin to be a float16, .* got torch.float8_e5m2"),
        (dict(layout="sbhd"), ValueError, "unknown layout 'sbhd'; expected one of bhsd, bshd"),
        (dict(interleaved=1), TypeError, "interleaved to be a bool, got 1"),
        (dict(q=torch.zeros(2, 5, 8)), ValueError, r"q of shape \(batch, heads, seq, head_dim\) .* got \(2, 5, 8\)"),
        (dict(k=torch.zeros(2, 2, 6, 8)), ValueError, r"k of shape .* got k \(2, 2, 6, 8\)"),
        (dict(k=torch.zeros(2, 2, 5, 8, dtype=F64)), TypeError, "expected k to have q's dtype torch.float32, got torch.float64"),
        (dict(sin=torch.zeros(5, 6)), ValueError, r"cos and sin of the same shape, got \(5, 8\) and \(5, 6\)"),
        (dict(cos=torch.zeros(4, 8), sin=torch.zeros(4, 8)), ValueError, r"with seq=5 .* got \(4, 8\)"),
        (dict(cos=torch.zeros(3, 5, 8), sin=torch.zeros(3, 5, 8)), ValueError, r"batch=2 \(or 1\), got \(3, 5, 8\)"),
        (dict(cos=torch.zeros(5, 7), sin=torch.zeros(5, 7)), ValueError, r"even and in \[2, head_dim=8\], got 7"),
        (dict(cos=torch.zeros(5, 10), sin=torch.zeros(5, 10)), ValueError, r"head_dim=8\], got 10"),
        (dict(cos=torch.zeros(1, 1, 5, 8), sin=torch.zeros(1, 1, 5, 8)), ValueError, r"\(seq, rotary_dim\) or"),
    ],
)
def test_apply_rope_cos_sin_bad_arguments(change, error, match):
    args = _valid()
    layout = change.pop("layout", "bhsd")
    interleaved = change.pop("interleaved", False)
    args.update(change)
    with pytest.raises(error, match=match):
        F.apply_rope_cos_sin(args["q"], args["k"], args["cos"], args["sin"], layout=layout, interleaved=interleaved)


# --- the fused op: devices, opcheck, torch.compile, empty tensors -----------------------------

from conftest import DEVICES  # noqa: E402
from torch.library import opcheck  # noqa: E402


@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_rotary_dim_beyond_512_is_refused_like_apply_rope(device):
    """The CUDA kernel stages rotary_dim / 2 pairs per token in shared memory (256 at most):
    issue 26 item 1, a rotary_dim of 514 wrote past that table. The op checks refuse it
    before dispatch, with apply_rope's message, on every device; 512 still works."""
    q = torch.randn(1, 2, 3, 520, device=device)
    message = "posenc: rotary_dim 514 is not supported; expected at most 512"
    cos, sin = torch.ones(3, 514, device=device), torch.zeros(3, 514, device=device)
    with pytest.raises(ValueError, match=message):
        F.apply_rope_cos_sin(q, None, cos, sin)
    with pytest.raises(ValueError, match=message):
        F.apply_rope(q, rotary_dim=514)
    cos, sin = torch.ones(3, 512, device=device), torch.zeros(3, 512, device=device)
    out_q = F.apply_rope_cos_sin(q, None, cos, sin)  # the identity rotation
    if device != "meta":
        torch.testing.assert_close(out_q, q, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fused_op_on_every_device_and_dtype(device, dtype):
    q, k = make_qk(2, 4, 2, 9, 14, "bshd", dtype)
    q, k = q.to(device), k.to(device)
    cos, sin = F.rope_cos_sin(torch.arange(9, device=device).expand(2, 9), 10, dtype=F64)
    out_q, out_k = F.apply_rope_cos_sin(q, k, cos, sin, layout="bshd")
    for out, x in ((out_q, q), (out_k, k)):
        assert out.device == x.device and out.dtype == dtype
        want = reference_rotate(x.cpu(), cos.cpu(), sin.cpu(), "bshd", False)
        tol = TOLERANCE.get(dtype, dict(rtol=2e-3, atol=2e-3))
        torch.testing.assert_close(out.cpu().to(F64), want, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_apply_rope_cos_sin(device):
    q, k = make_qk(2, 3, 1, 5, 8, "bhsd", F64)
    q, k = q.to(device), k.to(device)
    cos, sin = (t.to(device) for t in F.rope_cos_sin(torch.arange(5), 6, dtype=F64))
    for args, kwargs in (
        ((q, k, cos, sin), {}),
        ((q, None, cos, sin), dict(interleaved=True)),
        ((q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None]), dict(layout="bshd", transpose=True)),
    ):
        opcheck(torch.ops.posenc.apply_rope_cos_sin.default, args, kwargs)
    cos_g, sin_g = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    opcheck(torch.ops.posenc.apply_rope_cos_sin.default,
            (q.clone().requires_grad_(), k.clone().requires_grad_(), cos_g, sin_g), {})


def test_compile_fullgraph_equals_eager_forward_and_backward():
    q, k = make_qk(2, 4, 2, 6, 8, "bhsd", torch.float32)
    q.requires_grad_(), k.requires_grad_()
    cos, sin = F.rope_cos_sin(torch.arange(6), 8)

    def f(q, k):
        a, b = F.apply_rope_cos_sin(q, k, cos, sin)
        return (a * a).sum() + (b * 3).sum()

    eager = f(q, k)
    gq, gk = torch.autograd.grad(eager, (q, k))
    compiled = torch.compile(f, fullgraph=True)(q, k)
    cq, ck = torch.autograd.grad(compiled, (q, k))
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cq, gq, rtol=0, atol=0)
    torch.testing.assert_close(ck, gk, rtol=0, atol=0)


def test_empty_tensors_and_unused_outputs():
    cos, sin = F.rope_cos_sin(torch.arange(0), 8)
    q = torch.randn(2, 3, 0, 8, requires_grad=True)
    out_q, out_k = F.apply_rope_cos_sin(q, q[:, :1], cos, sin)
    assert out_q.shape == (2, 3, 0, 8) and out_k.shape == (2, 1, 0, 8)
    # Only k's output used: q gets a zero gradient, k the transposed rotation.
    q, k = make_qk(1, 2, 1, 4, 8, "bhsd", F64)
    q.requires_grad_(), k.requires_grad_()
    cos, sin = F.rope_cos_sin(torch.arange(4), 8, dtype=F64)
    _, out_k = F.apply_rope_cos_sin(q, k, cos, sin)
    g = torch.randn_like(out_k)
    gq, gk = torch.autograd.grad((out_k * g).sum(), (q, k), allow_unused=True)
    assert gq is None or torch.count_nonzero(gq) == 0
    # gk is the transpose (the inverse: unit tables) of the rotation applied to g.
    torch.testing.assert_close(F.apply_rope_cos_sin(gk, None, cos, sin), g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,layout,interleaved,rot", [
    (torch.float32, "bhsd", False, 128),
    (torch.bfloat16, "bshd", True, 128),
    (torch.float32, "bshd", False, 64),  # partial rotary: the row (128 features) still streams
    (torch.float16, "bhsd", False, 96),
])
def test_large_call_streams_with_the_bits_of_small_calls(dtype, layout, interleaved, rot):
    """A call that writes >= 8 MiB computes each aligned row into an L1 buffer and streams it
    (rope_cos_sin/cpu/kernel.cpp, kStreamBytes): the same bits as eight calls small enough for
    plain stores, forward and backward, and the float64 reference's values."""
    S = 2048 if dtype == torch.float32 else 4096
    q, k = make_qk(1, 8, 4, S, 128, layout, dtype, seed=3)
    q.requires_grad_(True)
    pos = torch.arange(5, 5 + S)[None]
    cos, sin = hf_cos_sin(pos, rot)
    if interleaved:
        cos, sin = interleave_tables(cos, sin)
    cos, sin = cos.float(), sin.float()
    out_q, out_k = F.apply_rope_cos_sin(q, k, cos, sin, layout=layout, interleaved=interleaved)
    tol = TOLERANCE.get(dtype, dict(rtol=2e-3, atol=4e-3))
    torch.testing.assert_close(out_k.to(F64), reference_rotate(k, cos, sin, layout, interleaved), **tol)
    torch.testing.assert_close(out_q.detach().to(F64), reference_rotate(q.detach(), cos, sin, layout, interleaved),
                               **tol)
    grad = torch.randn_like(out_q)
    (grad_q,) = torch.autograd.grad(out_q, q, grad)
    seq_dim = 2 if layout == "bhsd" else 1
    chunk = S // 8
    parts = []
    for start in range(0, S, chunk):
        q_part = q.detach().narrow(seq_dim, start, chunk).clone().requires_grad_(True)
        tables = cos[:, start:start + chunk], sin[:, start:start + chunk]
        pq, pk = F.apply_rope_cos_sin(q_part, k.narrow(seq_dim, start, chunk), *tables, layout=layout,
                                      interleaved=interleaved)
        (pg,) = torch.autograd.grad(pq, q_part, grad.narrow(seq_dim, start, chunk))
        parts.append((pq.detach(), pk, pg))
    assert torch.equal(out_q.detach(), torch.cat([p[0] for p in parts], seq_dim))
    assert torch.equal(out_k, torch.cat([p[1] for p in parts], seq_dim))
    assert torch.equal(grad_q, torch.cat([p[2] for p in parts], seq_dim))


def test_position_range_check_under_compile_keeps_narrow_dtypes_and_tracers():
    """rope_cos_sin refuses int64 positions past 2**53 (their float64 angle rounds them). Its
    first device-side form compared int32 positions with 2**53 converted to int32 (0), so
    under torch.compile every positive int32 position was refused, and its host read broke
    vmap, FakeTensorMode and make_fx, which took the tables before."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from posenc.functional import rope_cos_sin

    torch._dynamo.reset()
    compiled = torch.compile(lambda p: rope_cos_sin(p, 8), fullgraph=True, backend="aot_eager")
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.int64):
        positions = torch.arange(5, dtype=dtype)
        assert torch.equal(compiled(positions)[0], rope_cos_sin(positions, 8)[0])
    with pytest.raises(RuntimeError, match=r"expected positions within \[-2\*\*53, 2\*\*53\]"):
        compiled(torch.tensor([2**60]))
    with pytest.raises(ValueError, match=r"expected positions within \[-2\*\*53, 2\*\*53\].*got 1152921504606846977"):
        rope_cos_sin(torch.tensor([2**60 + 1]), 8)
    # The eager CPU check's edges (its extremes against the op's range, the op's message past them).
    assert torch.equal(rope_cos_sin(torch.tensor([-2**53, 0, 2**53]), 8)[0][1], torch.ones(8))
    for bad in (-2**53 - 1, 2**53 + 1, -2**63, 2**63 - 1):
        with pytest.raises(ValueError, match=rf"expected positions within \[-2\*\*53, 2\*\*53\].*got {bad}"):
            rope_cos_sin(torch.tensor([[0, bad, 3]]), 8)
    with pytest.raises(TypeError, match=r"integer tensor \(int64 position_ids\), got torch.uint64"):
        rope_cos_sin(torch.tensor([2**60 + 1], dtype=torch.uint64), 8)  # was 2**60's tables, unchecked
    grid = torch.arange(10).view(2, 5)
    assert torch.equal(torch.vmap(lambda p: rope_cos_sin(p, 8)[0])(grid), rope_cos_sin(grid, 8)[0])
    with FakeTensorMode():
        assert rope_cos_sin(torch.arange(5), 8)[0].shape == (5, 8)
    traced = make_fx(lambda p: rope_cos_sin(p, 8)[0], tracing_mode="symbolic")(torch.arange(5))
    assert torch.equal(traced(torch.arange(7)), rope_cos_sin(torch.arange(7), 8)[0])
    torch._dynamo.reset()


def test_every_call_asks_the_op_for_its_frequencies():
    """No process-wide cache: the frequencies come from op rope_frequencies at every call, as
    torch's profiler sees (an lru_cache once kept them per configuration, out of its sight)."""
    from posenc.functional import rope_cos_sin

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            rope_cos_sin(torch.arange(4), 8, base=321.0)
    assert sum(e.name == "posenc::rope_frequencies" for e in prof.events()) == 3
