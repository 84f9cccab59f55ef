"""Multi-axis RoPE (sections): against each peer's formula written out in float64
(multi_axis_reference.py: Qwen2-VL / Qwen3-VL M-RoPE, FLUX, EVA-02 / timm, torchtune vision) and
against the generic model on layouts, conventions, GQA, partial rotary, strides, in place,
dtypes, packed sequences and empty tensors; gradients, opcheck, compile, export; bad inputs."""

import pytest
import torch
from torch.library import opcheck

import posenc
from conftest import DEVICES, DTYPES, torchtune_position_embeddings
from multi_axis_reference import (
    eva_timm_positions,
    eva_timm_rope,
    flux_rope,
    generic_inv_freq_and_axis,
    generic_multi_axis_rope,
    qwen2vl_mrope,
    qwen3vl_mrope_interleaved,
    torchtune_vision_positions,
    torchtune_vision_rope,
)
from posenc.functional import apply_rope, grid_positions, rope_frequencies
from rope_reference import from_bshd, to_bshd

F64 = torch.float64
TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}


def rand(*shape, dtype=F64, device="cpu"):
    return (torch.randn(*shape, dtype=F64) * 2 + 0.5).to(dtype=dtype, device=device)


def close(out, ref, dtype=F64):
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().to(F64), ref.cpu(), **TOL[dtype])


# ---- The peers' formulas.


QWEN_CASES = [
    # transformers' Qwen2-VL apply_multimodal_rotary_pos_emb, and Qwen3-VL's interleaved M-RoPE
    (qwen2vl_mrope, "mrope", 128, [16, 24, 24], 1e6),
    (qwen2vl_mrope, "mrope", 20, [2, 4, 4], 1e6),
    (qwen2vl_mrope, "mrope", 14, [3, 2, 2], 1e6),
    (qwen3vl_mrope_interleaved, "mrope_interleaved", 128, [24, 20, 20], 5e6),
    (qwen3vl_mrope_interleaved, "mrope_interleaved", 64, [12, 10, 10], 5e6),
    (qwen3vl_mrope_interleaved, "mrope_interleaved", 20, [4, 3, 3], 5e6),
    # 3 x 3 > 8 pairs, but axis 1's last pair is 7: transformers' slice(1, 9, 3) turns 1, 4, 7
    (qwen3vl_mrope_interleaved, "mrope_interleaved", 16, [3, 3, 2], 5e6),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", QWEN_CASES, ids=lambda c: f"{c[1]}-{c[2]}")
def test_qwen_vl_mrope(device, case):
    """Qwen-VL M-RoPE in the HF layout (B, H, S, D), with GQA, on random (t, h, w) positions."""
    reference, mode, head_dim, section, base = case
    torch.manual_seed(0)
    B, S = 2, 13
    q, k = rand(B, 4, S, head_dim, device=device), rand(B, 2, S, head_dim, device=device)
    pos = torch.randint(0, 5000, (3, B, S), device=device)
    rq, rk = reference(q.cpu(), k.cpu(), pos.cpu(), section, base)
    oq, ok = apply_rope(q, k, positions=pos, sections=section, sections_mode=mode, base=base, layout="bhsd")
    close(oq, rq)
    close(ok, rk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["mrope", "mrope_interleaved"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_text_tokens_are_exactly_1d_rope(device, mode, dtype):
    """All axes equal (text tokens): M-RoPE gives 1-D RoPE's bits exactly."""
    q = rand(2, 9, 4, 128, dtype=dtype, device=device)
    pos1 = torch.randint(0, 10**6, (2, 9), device=device)
    pos3 = pos1.expand(3, 2, 9)
    sections = [16, 24, 24] if mode == "mrope" else [24, 20, 20]
    one = apply_rope(q, positions=pos1, base=1e6, offset=7)
    multi = apply_rope(q, positions=pos3, sections=sections, sections_mode=mode, base=1e6, offset=7)
    assert torch.equal(one, multi)
    # Default positions (all axes 0 .. seq-1) too.
    assert torch.equal(apply_rope(q), apply_rope(q, sections=sections, sections_mode=mode))


@pytest.mark.parametrize("device", DEVICES)
def test_flux_pos_embed(device):
    """diffusers FluxPosEmbed(theta=10000, axes_dim=(16, 56, 56)) + apply_rotary_emb
    (use_real_unbind_dim=-1): axial, adjacent pairs, sections = axes_dim // 2."""
    torch.manual_seed(2)
    S = 37
    x = rand(1, 3, S, 128, device=device)
    ids = torch.stack([torch.zeros(S, dtype=torch.long), torch.randint(0, 64, (S,)), torch.randint(0, 64, (S,))], 1)
    ref = flux_rope(x.cpu(), ids, (16, 56, 56), 10000)
    out = apply_rope(x, positions=ids.T.contiguous().to(device), sections=[8, 28, 28], interleaved=True,
                     layout="bhsd")
    close(out, ref)
    # ids as the (seq, 3) tensor diffusers keeps, transposed without a copy.
    close(apply_rope(x, positions=ids.to(device).T, sections=[8, 28, 28], interleaved=True, layout="bhsd"), ref)


@pytest.mark.parametrize("axes, theta", [((16, 56, 56), 10000), ((4, 6, 6), 10000), ((8, 8, 8, 8), 2000)])
def test_real_diffusers_flux_pos_embed(axes, theta):
    """The real diffusers FluxPosEmbed + apply_rotary_emb (diffusers when installed; the test
    above is a written-out copy): sections = axes_dim // 2, adjacent pairs, to float32 rounding."""
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    torch.manual_seed(5)
    S = 13
    ids = torch.randint(0, 64, (S, len(axes)))
    ids[:, 0] = torch.randint(0, 2, (S,))
    x = torch.randn(1, 3, S, sum(axes))
    cos, sin = embeddings.FluxPosEmbed(theta=theta, axes_dim=list(axes))(ids.float())
    want = embeddings.apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)
    got = apply_rope(x, positions=ids.T, sections=[a // 2 for a in axes], interleaved=True, base=float(theta),
                     layout="bhsd")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sections, head_dim", [([12, 10, 10], 64), ([24, 20, 20], 128), ([3, 3, 2], 16)])
def test_real_transformers_qwen3_vl_interleaved_mrope(sections, head_dim):
    """The real transformers Qwen3-VL text rotary (mrope_interleaved) and its
    apply_rotary_pos_emb, against apply_rope with the sections given and with its config's
    rope_parameters as scaling, at positions up to 300 (float32 angles: ~3e-5)."""
    transformers = pytest.importorskip("transformers")
    qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    torch.manual_seed(6)
    heads = 2
    config = transformers.Qwen3VLTextConfig(
        hidden_size=head_dim * heads, head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=1,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                      "mrope_section": sections, "mrope_interleaved": True})
    rotary = qwen3_vl.Qwen3VLTextRotaryEmbedding(config)
    pos = torch.randint(0, 300, (3, 2, 11))
    q, k = torch.randn(2, heads, 11, head_dim), torch.randn(2, 1, 11, head_dim)
    want = qwen3_vl.apply_rotary_pos_emb(q, k, *rotary(q, pos))
    got = apply_rope(q, k, positions=pos, sections=sections, sections_mode="mrope_interleaved", base=5e6, layout="bhsd")
    from_config = apply_rope(q, k, positions=pos, scaling=dict(config.rope_parameters), layout="bhsd")
    for g, w in zip(got + from_config, want + want):
        torch.testing.assert_close(g, w, rtol=0, atol=5e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grid, prefix", [((7, 5), 1), ((4, 4), 5), ((3, 6), 0)])
def test_eva02_timm(device, grid, prefix):
    """timm's EVA-02 RotaryEmbeddingCat: (row, col) patches after unrotated prefix tokens."""
    torch.manual_seed(3)
    h, w = grid
    x = rand(2, 4, prefix + h * w, 64, device=device)
    ref = eva_timm_rope(x.cpu(), h, w, prefix, 10000.0)
    pos = grid_positions(h, w, num_prefix_tokens=prefix, device=device)
    assert torch.equal(pos.cpu(), eva_timm_positions(h, w, prefix))
    out = apply_rope(x, positions=pos, sections=[16, 16], interleaved=True, layout="bhsd")
    close(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("append_cls_token", [True, False])
def test_torchtune_vision_rotary(device, append_cls_token):
    """torchtune's VisionRotaryPositionalEmbeddings: (col + 1, row + 1), CLS unrotated, per tile."""
    torch.manual_seed(4)
    g, tiles = 4, 2
    x = rand(2, tiles * (g * g + 1), 3, 32, device=device)
    ref = torchtune_vision_rope(x.cpu(), patch_size=14, tile_size=14 * g, append_cls_token=append_cls_token)
    # From posenc's grid: columns first, 1-based, the CLS slot at the origin.
    patches = grid_positions(g, g).flip(0) + 1
    cls = torch.zeros(2, 1, dtype=torch.long)
    tile = torch.cat([patches, cls] if append_cls_token else [cls, patches], 1)
    pos = tile.repeat(1, tiles)
    assert torch.equal(pos, torchtune_vision_positions(g, tiles, append_cls_token))
    out = apply_rope(x, positions=pos.to(device), sections=[8, 8], interleaved=True)
    close(out, ref)


@pytest.mark.parametrize("append_cls_token", [True, False])
def test_real_torchtune_vision_rotary(append_cls_token):
    """torchtune's own VisionRotaryPositionalEmbeddings (CLIP's vision encoder passes dim =
    head_dim // 2) against apply_rope on the grid written as the test above writes it."""
    position_embeddings = torchtune_position_embeddings()
    g, tiles = 4, 2
    theirs = position_embeddings.VisionRotaryPositionalEmbeddings(
        patch_size=14, tile_size=14 * g, max_num_tiles=tiles, dim=16, append_cls_token=append_cls_token)
    x = torch.randn(2, tiles * (g * g + 1), 3, 32, generator=torch.Generator().manual_seed(5))
    patches = grid_positions(g, g).flip(0) + 1
    cls = torch.zeros(2, 1, dtype=torch.long)
    pos = torch.cat([patches, cls] if append_cls_token else [cls, patches], 1).repeat(1, tiles)
    out = apply_rope(x, positions=pos, sections=[8, 8], interleaved=True)
    torch.testing.assert_close(out, theirs(x), rtol=2e-5, atol=2e-5)


# ---- The generic model on every supported combination.

CASES = [
    # layout, sections, mode, interleaved, head_dim (partial rotary when > 2 * sum), per-row positions
    ("bshd", [3, 5, 4], "axial", False, 24, False),
    ("bhsd", [2, 3], "mrope", True, 13, True),
    ("sbhd", [4, 2, 2], "mrope_interleaved", False, 16, True),
    ("bshd", [1, 1, 1, 1], "axial", True, 8, True),
    ("bhsd", [6], "mrope", False, 15, False),
    ("sbhd", [5, 2, 2], "mrope_interleaved", True, 19, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_generic_layouts_and_conventions(device, case, dtype):
    layout, sections, mode, interleaved, D, per_row = case
    torch.manual_seed(5)
    B, S = 3, 7
    q = from_bshd(rand(B, S, 5, D), layout).to(dtype=dtype, device=device)
    k = from_bshd(rand(B, S, 1, D), layout).to(dtype=dtype, device=device)  # GQA
    n = len(sections)
    pos = torch.randint(-50, 3000, (n, B, S) if per_row else (n, S))
    offsets = torch.randint(0, 100, (B,))
    base = 777.0
    kw = dict(positions=pos.to(device), offset=offsets.to(device), sections=sections, sections_mode=mode,
              interleaved=interleaved, base=base, layout=layout)
    oq, ok = apply_rope(q, k, **kw)
    full = (pos if per_row else pos[:, None, :]) + offsets[None, :, None]
    for out, x in ((oq, q), (ok, k)):
        ref = generic_multi_axis_rope(to_bshd(x.cpu().to(F64), layout), full, sections, mode, base, interleaved)
        close(to_bshd(out, layout), ref, dtype)
    if dtype in (torch.float16, torch.bfloat16):  # rotated in float32, rounded once: those bits
        wq, wk = apply_rope(q.float(), k.float(), **kw)
        assert torch.equal(oq, wq.to(dtype)) and torch.equal(ok, wk.to(dtype))
    # In place gives the same numbers.
    q2, k2 = q.clone(), k.clone()
    apply_rope(q2, k2, inplace=True, **kw)
    assert torch.equal(q2, oq) and torch.equal(k2, ok)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_views_and_offset_positions(device):
    """Non-contiguous q (a slice of a fused buffer), positions a strided, offset view."""
    torch.manual_seed(6)
    qkv = rand(2, 9, 3 * 6, 20, device=device)
    q = qkv[:, :, 1:6:2, 2:18]  # head_dim 16, strided heads and features
    big = torch.randint(0, 400, (5, 2, 2, 30), device=device)
    pos = big[1:4, :, 1, 3:21:2]  # (3, 2, 9), strided and offset
    out = apply_rope(q, positions=pos, sections=[2, 3, 3], sections_mode="mrope", rotary_dim=16)
    ref = generic_multi_axis_rope(q.cpu().to(F64), pos.cpu(), [2, 3, 3], "mrope", 10000.0, False)
    close(out, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_sequences(device):
    """'thd' with (n_axes, tokens) positions (absolute per token) and per-sequence offsets."""
    torch.manual_seed(7)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)
    q = rand(11, 3, 12, device=device)
    pos = torch.randint(0, 99, (2, 11), device=device)
    offsets = torch.tensor([5, 1000, 20], device=device)
    out = apply_rope(q, positions=pos, offset=offsets, cu_seqlens=cu, sections=[2, 4], layout="thd")
    per_token = torch.tensor([5] * 4 + [20] * 7)
    ref = generic_multi_axis_rope(q.cpu()[None], pos.cpu() + per_token, [2, 4], "axial", 10000.0, False)[0]
    close(out, ref)
    # Without positions, every axis restarts at each sequence: plain packed RoPE per axis.
    out0 = apply_rope(q, cu_seqlens=cu, sections=[2, 4], layout="thd")
    local = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6])
    ref0 = generic_multi_axis_rope(q.cpu()[None], local.expand(2, 11), [2, 4], "axial", 10000.0, False)[0]
    close(out0, ref0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensors(device):
    for shape, pos_shape in (((0, 5, 2, 8), (2, 0, 5)), ((2, 0, 2, 8), (2, 0)), ((2, 5, 0, 8), (2, 5))):
        q = torch.randn(shape, device=device)
        out = apply_rope(q, positions=torch.zeros(pos_shape, dtype=torch.long, device=device), sections=[2, 2])
        assert out.shape == q.shape


def test_frequencies_follow_the_sections():
    for sections, mode in (([16, 24, 24], "mrope"), ([24, 20, 20], "mrope_interleaved"), ([8, 28, 28], "axial")):
        inv, factor = rope_frequencies(2 * sum(sections), base=1e4, sections=sections, sections_mode=mode)
        want, _ = generic_inv_freq_and_axis(sections, mode, 1e4)
        torch.testing.assert_close(inv, want, atol=0, rtol=1e-15)
        assert factor == 1.0


# ---- The module.


@pytest.mark.parametrize("device", DEVICES)
def test_module_with_sections(device):
    rope = posenc.RotaryPositionalEncoding(64, max_len=100, sections=[8, 12, 12], sections_mode="mrope").to(device)
    q, k = rand(2, 6, 4, 64, device=device), rand(2, 6, 2, 64, device=device)
    pos = torch.randint(0, 100, (3, 2, 6), device=device)
    oq, ok = rope(q, k, positions=pos)
    wq, wk = apply_rope(q, k, positions=pos, sections=[8, 12, 12], sections_mode="mrope")
    assert torch.equal(oq, wq) and torch.equal(ok, wk)
    assert "sections=[8, 12, 12]" in repr(rope)
    inv, _ = generic_inv_freq_and_axis([8, 12, 12], "mrope", 10000.0)
    torch.testing.assert_close(rope.inv_freq.cpu(), inv.float())
    # Every axis is range-checked, not only the first.
    bad = pos.clone()
    bad[2, 1, 3] = 100
    with pytest.raises(IndexError, match=r"max_len=100\), found 100 \(positions range from \d+ to 100\)"):
        rope(q, k, positions=bad)


# ---- Autograd, opcheck, compile, export.


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["axial", "mrope", "mrope_interleaved"])
def test_gradcheck(device, mode):
    q = torch.randn(2, 4, 3, 14, dtype=F64, device=device, requires_grad=True)
    k = torch.randn(2, 4, 1, 14, dtype=F64, device=device, requires_grad=True)
    pos = torch.randint(0, 50, (3, 2, 4), device=device)

    def f(q, k):
        return apply_rope(q, k, positions=pos, sections=[2, 2, 2], sections_mode=mode, rotary_dim=12)

    assert torch.autograd.gradcheck(f, (q, k))
    assert torch.autograd.gradgradcheck(f, (q, k))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q = torch.randn(2, 5, 3, 12, device=device, requires_grad=True)
    k = torch.randn(2, 5, 1, 12, device=device, requires_grad=True)
    pos = torch.randint(0, 50, (3, 2, 5), device=device)
    kwargs = dict(positions=pos, sections=[2, 2, 2], sections_mode="mrope_interleaved")
    opcheck(torch.ops.posenc.rope.default, (q, k), kwargs)
    opcheck(torch.ops.posenc.rope_.default, (q.detach().clone(), k.detach().clone()), kwargs)
    opcheck(torch.ops.posenc.rope_grid_positions.default, ([3, 4], 2, torch.device(device)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_and_export(device):
    class Attn(torch.nn.Module):
        def forward(self, q, k, pos):
            return apply_rope(q, k, positions=pos, sections=[4, 2, 2], sections_mode="mrope")

    q, k = torch.randn(2, 6, 4, 16, device=device), torch.randn(2, 6, 2, 16, device=device)
    pos = torch.randint(0, 50, (3, 2, 6), device=device)
    want = Attn()(q, k, pos)
    torch._dynamo.reset()
    got = torch.compile(Attn(), fullgraph=True)(q, k, pos)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ep = torch.export.export(Attn(), (q, k, pos))
    for a, b in zip(ep.module()(q, k, pos), want):
        assert torch.equal(a, b)


# ---- Bad inputs: each a clear error naming the argument.


def test_bad_inputs():
    q = torch.randn(2, 5, 3, 16)
    pos = torch.randint(0, 9, (3, 2, 5))
    with pytest.raises(ValueError, match=r"sections .* sum to rotary_dim / 2 = 8, got sections=\[4, 2, 1\]"):
        apply_rope(q, positions=pos, sections=[4, 2, 1], rotary_dim=16)
    with pytest.raises(ValueError, match=r"expected sections to hold at most head_dim / 2 = 8 rotary pairs, got sections=\[4, 3, 2\] \(9 pairs\)"):
        apply_rope(q, positions=pos, sections=[4, 3, 2])  # sections wider than the head
    with pytest.raises(RuntimeError, match=r"positions of shape \(n_axes, seq\) = \(2, 5\).*got shape \[3, 2, 5\]"):
        apply_rope(q, positions=pos, sections=[4, 4])
    with pytest.raises(TypeError, match="positions to have dtype torch.int64"):
        apply_rope(q, positions=pos.float(), sections=[4, 2, 2])
    with pytest.raises(RuntimeError, match=r"positions of shape \(seq,\)"):
        apply_rope(q, positions=pos)  # coordinates without sections
    with pytest.raises(ValueError, match="at most 4 sections"):
        apply_rope(q, positions=torch.zeros(5, 5, dtype=torch.long), sections=[4, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="positive number of rotary pairs"):
        apply_rope(q, positions=pos, sections=[8, 0, 0])
    with pytest.raises(ValueError, match="unknown sections_mode 'qwen'; expected one of 'axial', 'mrope' or 'mrope_interleaved'"):
        apply_rope(q, positions=pos, sections=[4, 2, 2], sections_mode="qwen")
    with pytest.raises(ValueError, match="sections_mode 'mrope' needs sections"):
        apply_rope(q, sections_mode="mrope")
    with pytest.raises(ValueError, match="mrope_interleaved.*axis 1 every 3-th pair from pair 1, 4 of them up to pair 10"):
        apply_rope(q, positions=pos, sections=[1, 4, 3], sections_mode="mrope_interleaved")
    with pytest.raises(TypeError, match="sections to be a list of ints"):
        apply_rope(q, positions=pos, sections=[4.0, 2, 2])
    with pytest.raises(ValueError, match=r"sections .* sum to rotary_dim / 2 = 6"):
        posenc.RotaryPositionalEncoding(16, rotary_dim=12, sections=[4, 4])
    with pytest.raises(ValueError, match="grid sizes"):
        grid_positions(3, 0)
    # The meta kernel checks the same.
    with pytest.raises(ValueError, match="sum to rotary_dim / 2"):
        apply_rope(q.to("meta"), positions=pos.to("meta"), sections=[4, 2, 1], rotary_dim=16)


@pytest.mark.parametrize("rope", [
    dict(rope_type="default"),
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
], ids=lambda rope: rope["rope_type"])
def test_transformers_qwen2_vl_rotary_embedding(rope):
    """The real Qwen2-VL text rotary embedding (transformers, when installed): its M-RoPE
    cos/sin with its apply_rotary_pos_emb against apply_rope(sections_mode="mrope") on the
    same (3, batch, seq) position ids, to float32 rounding; with a scaling type, transformers
    scales the frequencies of the whole rotary width (and yarn its attention factor) before
    the sections pick the axes, and so must posenc."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    head_dim, heads = 32, 2
    section = [4, 6, 6]
    config = transformers.Qwen2VLTextConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=128,
        rope_parameters={**rope, "rope_theta": 10000.0, "mrope_section": section},
    )
    emb = qwen2_vl.Qwen2VLRotaryEmbedding(config)
    g = torch.Generator().manual_seed(7)
    pos = torch.randint(0, 300, (3, 2, 11), generator=g)
    q = torch.randn(2, heads, 11, head_dim, generator=g)
    k = torch.randn(2, 1, 11, head_dim, generator=g)
    cos, sin = emb(q, pos)
    want_q, want_k = qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rope(q, k, positions=pos, scaling=dict(config.rope_parameters), layout="bhsd")
    torch.testing.assert_close(got_q, want_q, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_k, want_k, rtol=2e-5, atol=2e-5)


def test_a_dict_whose_mrope_sections_sum_short_turns_the_features_they_cover():
    """GLM-4V's transformers 4 dict leaves partial_rotary_factor on the config: its sections
    cover the rotary part, half the head, and the rest passes through (a review of a refusal
    that broke it; transformers' Qwen2-VL refuses such a dict, its rotary is the whole head)."""
    rope = {"type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # 8 of 16 pairs
    q = torch.randn(1, 2, 4, 32)
    pos = torch.randint(0, 50, (3, 1, 4))
    got = apply_rope(q, positions=pos, scaling=rope, interleaved=True, layout="bhsd")
    want = apply_rope(q, positions=pos, sections=[2, 3, 3], sections_mode="mrope", rotary_dim=16, interleaved=True,
                      layout="bhsd")
    assert torch.equal(got, want)
    assert torch.equal(got[..., 16:], q[..., 16:]) and not torch.equal(got[..., :16], q[..., :16])


def test_timm_rotary_embedding_cat():
    """The real timm RotaryEmbeddingCat + apply_rot_embed_cat (EVA-02's 2-D RoPE; timm when
    installed) against apply_rope with axial sections on grid_positions, prefix tokens left
    unrotated as EvaAttention does, to float32 rounding."""
    sincos = pytest.importorskip("timm.layers.pos_embed_sincos")
    head_dim, h, w, prefix = 64, 5, 7, 1
    rope = sincos.RotaryEmbeddingCat(dim=head_dim, in_pixels=False, feat_shape=[h, w], temperature=10000.0)
    embed = rope.get_embed()
    x = torch.randn(2, 3, prefix + h * w, head_dim)
    want = torch.cat([x[:, :, :prefix], sincos.apply_rot_embed_cat(x[:, :, prefix:], embed)], dim=2)
    pos = grid_positions(h, w, num_prefix_tokens=prefix)
    got = apply_rope(x, positions=pos, sections=[head_dim // 4, head_dim // 4], interleaved=True, layout="bhsd")
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name, base, flip", [("vit_medium_patch16_rope_reg1_gap_256", 10000.0, False),
                                               ("vit_small_patch16_rope_224", 100.0, True)])
def test_timm_rope_vit_families_take_their_documented_recipe(name, base, flip):
    """Which recipe each family of timm's ROPE ViTs takes (docs/integrations.md), read from the
    models timm builds: the register/GAP models are EVA-02's (ij indexing, base 10000; the
    docs gave every vit_*_patch16_rope_* the naver models' xy and base 100: 7.2 off), exact at
    their reference grid only (another grid scales positions to fractions posenc cannot take);
    the naver models are xy, base 100, at any grid."""
    timm = pytest.importorskip("timm")
    sincos = pytest.importorskip("timm.layers.pos_embed_sincos")
    model = timm.create_model(name, pretrained=False, depth=1)
    rope = model.rope
    assert isinstance(rope, sincos.RotaryEmbeddingCat)
    h, w = rope.feat_shape
    head_dim = model.blocks[0].attn.head_dim
    x = torch.randn(1, 2, h * w, head_dim, dtype=torch.float64)
    want = sincos.apply_rot_embed_cat(x, rope.get_embed().double())
    pos = grid_positions(h, w).flip(0) if flip else grid_positions(h, w)
    got = apply_rope(x, positions=pos, sections=[head_dim // 4] * 2, interleaved=True, base=base, layout="bhsd")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if rope.ref_feat_shape is not None:  # at another grid timm's positions are fractions
        other = sincos.RotaryEmbeddingCat(dim=rope.dim, in_pixels=False, feat_shape=[h // 2, w // 2],
                                          ref_feat_shape=list(rope.ref_feat_shape))
        x = x[:, :, : (h // 2) * (w // 2)]
        want = sincos.apply_rot_embed_cat(x, other.get_embed().double())
        got = apply_rope(x, positions=grid_positions(h // 2, w // 2), sections=[head_dim // 4] * 2,
                         interleaved=True, base=base, layout="bhsd")
        assert (got - want).abs().max() > 0.1


def test_timm_rope_vit_settings():
    """timm's ROPE ViTs (vit_*_patch16_rope_*): RotaryEmbeddingCat with grid_indexing='xy' and
    temperature 100, as docs/integrations.md gives them: the patches' grid_positions with the
    axes swapped and base 100 (the EVA-02 recipe on these models is 6.3 off)."""
    sincos = pytest.importorskip("timm.layers.pos_embed_sincos")
    head_dim, h, w = 64, 4, 6
    rope = sincos.RotaryEmbeddingCat(dim=head_dim, in_pixels=False, feat_shape=[h, w], temperature=100.0,
                                     grid_indexing="xy")  # timm is pinned (requirements-peers.txt)
    x = torch.randn(2, 3, 1 + h * w, head_dim, dtype=torch.float64)
    want = torch.cat([x[:, :, :1], sincos.apply_rot_embed_cat(x[:, :, 1:], rope.get_embed().double())], dim=2)
    pos = torch.cat([torch.zeros(2, 1, dtype=torch.long), grid_positions(h, w).flip(0)], 1)
    got = apply_rope(x, positions=pos, sections=[16, 16], interleaved=True, base=100.0, layout="bhsd")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
