"""Independent float64 references for RoPE, written from the formulas (not from posenc).

- frequencies: base**(-2i/d) and the scaling rules of Hugging Face transformers'
  modeling_rope_utils (linear, dynamic, yarn, llama3), written out here in float64;
- the rotation: Hugging Face's ``rotate_half`` formulation (GPT-NeoX convention) and the
  complex-multiplication formulation of Meta's LLaMA (GPT-J convention).
"""

import math

import torch

F64 = torch.float64


def default_inv_freq(dim, base):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=F64) / dim))


def reference_inv_freq(dim, base=10000.0, scaling=None, seq_len=0):
    """(inv_freq float64, attention_factor) for a Hugging Face rope_scaling dict."""
    if scaling is None:
        return default_inv_freq(dim, base), 1.0
    kind = scaling["rope_type"]
    factor = scaling.get("factor")
    if kind == "default":
        return default_inv_freq(dim, base), 1.0
    if kind == "linear":
        return default_inv_freq(dim, base) / factor, 1.0
    if kind == "dynamic":
        orig = scaling["original_max_position_embeddings"]
        seq_len = max(seq_len, orig)
        if dim == 2:  # the one frequency is base**0 = 1 for any base (HF divides by zero)
            return default_inv_freq(dim, base), 1.0
        new_base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        return default_inv_freq(dim, new_base), 1.0
    if kind == "llama3":
        inv = default_inv_freq(dim, base)
        orig = scaling["original_max_position_embeddings"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > orig / lo, inv / factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        orig = scaling["original_max_position_embeddings"]
        beta_fast = scaling.get("beta_fast", 32)
        beta_slow = scaling.get("beta_slow", 1)

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            if scaling.get("mscale") and scaling.get("mscale_all_dim"):
                attn = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
            else:
                attn = mscale(factor)

        def correction_dim(rotations):
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
        extrapolation = default_inv_freq(dim, base)
        interpolation = extrapolation / factor
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep, attn
    raise ValueError(kind)


def longrope_inv_freq(dim, base, scaling, seq_len):
    """transformers' _compute_longrope_parameters (and dynamic_rope_update's switch):
    inv_freq[i] = 1 / (ext[i] * base**(2i/dim)), ext = long_factor when seq_len >
    original_max_position_embeddings, else short_factor; attention factor = given, else
    sqrt(1 + ln(factor) / ln(original)) (1 for factor <= 1)."""
    orig = scaling["original_max_position_embeddings"]
    ext = torch.tensor(scaling["long_factor"] if seq_len > orig else scaling["short_factor"], dtype=F64)
    inv = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=F64) / dim))
    attn = scaling.get("attention_factor")
    if attn is None:
        factor = scaling["factor"]
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv, attn


def proportional_inv_freq(head_dim, base, scaling):
    """transformers' _compute_proportional_rope_parameters (Gemma 4): over the whole head,
    inv_freq[i] = base**(-2i/head_dim) / factor for i < int(partial_rotary_factor * head_dim // 2),
    else 0 (those pairs never turn); attention factor 1."""
    angles = int(scaling["partial_rotary_factor"] * head_dim // 2)
    inv = base ** (-torch.arange(0, 2 * angles, 2, dtype=F64) / head_dim)
    return torch.cat([inv, torch.zeros(head_dim // 2 - angles, dtype=F64)]) / scaling.get("factor", 1.0), 1.0


def formula_inv_freq(rot, base, scaling, seq_len, head_dim):
    """(inv_freq float64, attention factor) of every scaling type: reference_inv_freq's, and
    longrope's and proportional's above (proportional turns over the whole head: rot == head_dim)."""
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "longrope":
        return longrope_inv_freq(rot, base, scaling, seq_len)
    if kind == "proportional":
        assert rot == head_dim
        return proportional_inv_freq(head_dim, base, scaling)
    return reference_inv_freq(rot, base, scaling, seq_len)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_neox(x, pos, inv_freq, rotary_dim, attn=1.0):
    """Hugging Face: x * cos + rotate_half(x) * sin on the first rotary_dim features.
    x: (B, S, H, D) float64; pos: (B, S) integer positions."""
    angle = pos.to(F64)[..., None] * inv_freq  # (B, S, rot/2)
    emb = torch.cat((angle, angle), dim=-1)[:, :, None, :]
    cos, sin = emb.cos() * attn, emb.sin() * attn
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def rope_gptj(x, pos, inv_freq, rotary_dim, attn=1.0):
    """Meta LLaMA: adjacent pairs as complex numbers times exp(i * angle)."""
    angle = pos.to(F64)[..., None] * inv_freq
    rot = torch.polar(torch.full_like(angle, attn), angle)[:, :, None, :]
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    # clone, not contiguous(): a contiguous view at an odd storage offset is no complex view.
    xc = torch.view_as_complex(xr.reshape(*xr.shape[:-1], -1, 2).clone(memory_format=torch.contiguous_format))
    out = torch.view_as_real(xc * rot).flatten(-2)
    return torch.cat((out, xp), dim=-1)


def to_bshd(x, layout):
    if layout == "bhsd":
        return x.transpose(1, 2)
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "thd":
        return x.unsqueeze(0)
    return x


def from_bshd(x, layout):
    if layout == "thd":
        return x.squeeze(0)
    return to_bshd(x, layout)  # the transposes are their own inverses


def reference_rope(x, layout, pos, inv_freq, rotary_dim, interleaved, attn=1.0):
    """x in the user's layout (any dtype) -> float64 reference in the same layout.
    pos: (B, S) positions of the canonical (batch, seq) grid ((1, T) for thd)."""
    xb = to_bshd(x.to(F64), layout)
    f = rope_gptj if interleaved else rope_neox
    return from_bshd(f(xb, pos, inv_freq, rotary_dim, attn), layout)


def thd_positions(cu_seqlens, offsets=None):
    """(1, T) positions restarting at each sequence of cu_seqlens, plus per-sequence offsets."""
    cu = cu_seqlens.tolist()
    pos = []
    for j in range(len(cu) - 1):
        shift = int(offsets[j]) if offsets is not None else 0
        pos.extend(range(shift, shift + cu[j + 1] - cu[j]))
    return torch.tensor(pos, dtype=torch.int64).reshape(1, -1)


def scaling_samples(rotary_dim):
    """A valid configuration of every scaling type (Hugging Face's keys) for rotary_dim; the
    per-pair factor lists (longrope) have rotary_dim / 2 values."""
    half = rotary_dim // 2
    return {
        "default": {"rope_type": "default"},
        "linear": {"rope_type": "linear", "factor": 4.0},
        "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16},
        "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                     "short_factor": [1.0 + 2.0 * i / half for i in range(half)],
                     "long_factor": [2.0 + 8.0 * i / half for i in range(half)]},
        "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    }
