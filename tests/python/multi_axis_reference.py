"""Independent float64 references for multi-axis rotary embeddings (RoPE over several position
coordinates), one per peer library, written from each peer's source (not from posenc, and not
copied: compact equivalents with the same numbers), plus the generic model posenc implements.

Sources read (released wheels unless said otherwise):
- transformers 5.24.0: models/qwen2_vl/modeling_qwen2_vl.py (Qwen2VLRotaryEmbedding.forward and
  .recomposition_frequencies, rotate_half, apply_rotary_pos_emb); models/qwen3_vl/modeling_qwen3_vl.py
  (Qwen3VLTextRotaryEmbedding.forward and .recomposition_frequencies). transformers 5.0.0 has the same
  numbers under the older names apply_multimodal_rotary_pos_emb (Qwen2-VL) and
  Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope (Qwen3-VL).
- diffusers 0.42.1: models/transformers/transformer_flux.py (FluxPosEmbed.forward),
  models/embeddings.py (get_1d_rotary_pos_embed, apply_rotary_emb).
- timm 1.0.31: models/eva.py (Eva.__init__ rope set-up, EvaAttention.forward),
  layers/pos_embed_sincos.py (create_rope_embed, RotaryEmbeddingCat, build_rotary_pos_embed,
  build_fourier_pos_embed, _build_grid, freq_bands, _rope_layout, apply_rot_embed_cat).
- torchtune 0.6.1: modules/position_embeddings.py (VisionRotaryPositionalEmbeddings),
  models/clip/_component_builders.py (clip_vision_encoder passes dim=head_dim // 2).
- DINOv3: facebookresearch/dinov3 dinov3/layers/rope_position_encoding.py (RopePositionEmbedding),
  and its ports transformers models/dinov3_vit/modeling_dinov3_vit.py and timm RotaryEmbeddingDinoV3.

Everything here is computed in float64 (inverse frequencies, angles, sin/cos, rotation), so these
are the exact numbers of each peer's formula; the peers themselves build their tables in float32
(FLUX: float64 frequencies, float32 cos/sin), which differ from these by ~1e-7 relative.

The generic model (generic_multi_axis_rope)
-------------------------------------------
Each token has n_axes integer coordinates pos[a]. The rotary pairs p = 0 .. rotary_dim/2 - 1, with
rotary_dim = 2 * sum(sections), are split into sections (pair counts per axis). Pair p rotates by
angle = pos[axis(p)] * inv_freq(p). Features past rotary_dim pass through unchanged.
  mode "mrope":             inv_freq(p) = base**(-2p/rotary_dim); axis(p) = the contiguous section p is in.
  mode "mrope_interleaved": same inv_freq; axis(p) = a (a >= 1) when p % n_axes == a and
                            p < n_axes * sections[a], else 0 (Qwen3-VL's rule, n_axes = 3 there).
  mode "axial":             section a is its own 1-D RoPE of width 2*sections[a]: its j-th pair has
                            inv_freq = base**(-2j/(2*sections[a])); sections laid out in axis order.
Pair convention: interleaved=False is "halves" (feature p with p + rotary_dim/2, HF rotate_half);
interleaved=True is adjacent pairs (2p, 2p+1).
"""


import torch

F64 = torch.float64
MODES = ("mrope", "mrope_interleaved", "axial")


# --------------------------------------------------------------------------------------------
# The generic model
# --------------------------------------------------------------------------------------------


def generic_inv_freq_and_axis(sections, mode, base):
    """(inv_freq float64 (R/2,), axis int64 (R/2,)) of the generic model, R = 2 * sum(sections)."""
    sections = [int(s) for s in sections]
    n = len(sections)
    half = sum(sections)
    if mode in ("mrope", "mrope_interleaved"):
        inv = float(base) ** (-2.0 * torch.arange(half, dtype=F64) / (2 * half))
        if mode == "mrope":
            axis = torch.repeat_interleave(torch.arange(n), torch.tensor(sections, dtype=torch.int64))
        else:
            axis = torch.zeros(half, dtype=torch.int64)
            for a in range(1, n):
                axis[a : n * sections[a] : n] = a  # stop clamps to half, as the peer's slice does
        return inv, axis
    if mode == "axial":
        inv = torch.cat([float(base) ** (-2.0 * torch.arange(s, dtype=F64) / (2 * s)) for s in sections if s > 0])
        axis = torch.repeat_interleave(torch.arange(n), torch.tensor(sections, dtype=torch.int64))
        return inv, axis
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _rotate_pairs(x, angle, interleaved):
    """Rotate the pairs of x (..., D) by angle (..., R/2) (broadcast); features >= R pass through."""
    half = angle.shape[-1]
    p = torch.arange(half)
    i1, i2 = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
    a, b = x[..., i1], x[..., i2]
    c, s = angle.cos(), angle.sin()
    out = x.clone()
    out[..., i1] = a * c - b * s
    out[..., i2] = b * c + a * s
    return out


def generic_multi_axis_rope(x, positions, sections, mode, base, interleaved):
    """The generic model in float64. x: (batch, seq, heads, head_dim) 'bshd'; positions: int64
    (n_axes, seq) or (n_axes, batch, seq); sections: pair counts per axis (len == n_axes),
    2 * sum(sections) <= head_dim; mode in MODES; interleaved: adjacent pairs (True) or halves."""
    x = x.to(F64)
    positions = torch.as_tensor(positions)
    assert len(sections) == positions.shape[0], "one section per position axis"
    assert 2 * sum(sections) <= x.shape[-1]
    inv, axis = generic_inv_freq_and_axis(sections, mode, base)
    pos = positions.to(F64)
    if pos.dim() == 2:
        pos = pos[:, None, :]  # (n_axes, 1, seq)
    per_pair_pos = pos[axis]  # (R/2, batch|1, seq)
    angle = (per_pair_pos * inv[:, None, None]).permute(1, 2, 0)  # (batch|1, seq, R/2)
    return _rotate_pairs(x, angle[:, :, None, :], interleaved)


# --------------------------------------------------------------------------------------------
# 1. Qwen2-VL M-RoPE (transformers)
# --------------------------------------------------------------------------------------------


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def qwen2vl_mrope(q, k, position_ids, mrope_section, base):
    """transformers Qwen2-VL text M-RoPE: Qwen2VLRotaryEmbedding (forward + recomposition_frequencies
    in 5.24; the same split in apply_multimodal_rotary_pos_emb in 5.0) then apply_rotary_pos_emb.

    q, k: (batch, heads, seq, head_dim); position_ids: (3, batch, seq) (rows T, H, W) or (batch, seq)
    (broadcast to the three rows, as the peer's expand(3, -1, -1)). Returns (q_out, k_out) float64.
    Requires sum(mrope_section) == head_dim / 2 (the peer's torch.split raises otherwise).

    Generic mapping: mode "mrope", sections = mrope_section (already in pairs: [16, 24, 24] for
    head_dim 128), interleaved=False (halves / rotate_half), base = rope_theta, positions =
    position_ids with axis 0 = temporal, 1 = height, 2 = width; no rotary_dim < head_dim.
    Positions (Qwen2VLModel.get_rope_index / get_vision_position_ids): text tokens get the same
    running integer on all three axes; an image/video block starting at running index s gets
    (s + t_index [* an integer time interval in Qwen2.5-VL, .long()], s + row, s + col) over the
    merged grid; the next text resumes at max(block) + 1. All integers; no prefix/CLS token.
    A packed 4-row position_ids ([text, T, H, W]) is cut to rows 1: by the model before the RoPE.
    """
    d = q.shape[-1]
    assert sum(mrope_section) == d // 2
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, d, 2, dtype=F64) / d))  # compute_default_rope_parameters
    pos = torch.as_tensor(position_ids).to(F64)
    if pos.dim() == 2:
        pos = pos[None].expand(3, -1, -1)
    freqs = pos[..., None] * inv_freq  # (3, batch, seq, d/2)
    # recomposition: chunk i of the half-width table comes from row i % 3, then duplicated (halves)
    chunks = freqs.split(list(mrope_section), dim=-1)
    freqs = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)  # (batch, seq, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # unsqueeze_dim=1 -> (batch, 1, seq, d)
    cos, sin = emb.cos(), emb.sin()
    q, k = q.to(F64), k.to(F64)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# --------------------------------------------------------------------------------------------
# 2. Qwen3-VL interleaved M-RoPE (transformers)
# --------------------------------------------------------------------------------------------


def qwen3vl_mrope_interleaved(q, k, position_ids, mrope_section, base):
    """transformers Qwen3-VL text M-RoPE: Qwen3VLTextRotaryEmbedding.forward and its
    recomposition_frequencies (5.24; apply_interleaved_mrope in 5.0), then apply_rotary_pos_emb.

    q, k: (batch, heads, seq, head_dim); position_ids: (3, batch, seq) rows (T, H, W) or (batch, seq).
    Returns (q_out, k_out) float64. The peer starts from row T everywhere and overwrites, on the
    half-width frequency table, the slice [1 : 3*mrope_section[1] : 3] with row H and
    [2 : 3*mrope_section[2] : 3] with row W (stops clamp to head_dim/2); then cat(f, f) (halves).
    mrope_section[0] is never read: T gets whatever is left of head_dim / 2.

    Generic mapping: mode "mrope_interleaved", sections = mrope_section ([24, 20, 20] for head_dim
    128, Qwen3.5 [11, 11, 10] for 64), interleaved=False (halves), base = rope_theta (5e6 in the
    Qwen3-VL checkpoints), axis 0 = T, 1 = H, 2 = W; pair p -> H if p % 3 == 1 and p < 3*s[1],
    W if p % 3 == 2 and p < 3*s[2], else T. Inverse frequencies: one list base**(-2p/head_dim).
    Positions: as Qwen2-VL (get_rope_index) except that videos are split into one-frame grids
    (T row 0 + start per frame, timestamps are text tokens) and each vision block advances the running
    index by max(h, w) // spatial_merge_size. All integers; no CLS.
    Does NOT fit exactly when sum(mrope_section) != head_dim / 2: the peer rotates all of head_dim
    (rotary_dim comes from head_dim, not from the sections) while the generic model's rotary_dim is
    2 * sum(sections). Equivalent generic sections are [head_dim/2 - s1 - s2, s1, s2] whenever
    s1 + s2 <= head_dim/2 (the rule only reads s1, s2 as slice extents); otherwise posenc would need
    rotary_dim as a separate parameter from the interleave extents. The per-axis pair counts equal
    the sections only when a + 3*(s[a]-1) < head_dim/2 for a = 1, 2 (true for [24,20,20]/128).
    """
    d = q.shape[-1]
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, d, 2, dtype=F64) / d))
    pos = torch.as_tensor(position_ids).to(F64)
    if pos.dim() == 2:
        pos = pos[None].expand(3, -1, -1)
    freqs = pos[..., None] * inv_freq  # (3, batch, seq, d/2)
    out = freqs[0].clone()
    for row, offset in ((1, 1), (2, 2)):
        sl = slice(offset, mrope_section[row] * 3, 3)
        out[..., sl] = freqs[row][..., sl]
    emb = torch.cat((out, out), dim=-1)[:, None]
    cos, sin = emb.cos(), emb.sin()
    q, k = q.to(F64), k.to(F64)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# --------------------------------------------------------------------------------------------
# 3. FLUX (diffusers)
# --------------------------------------------------------------------------------------------


def flux_rope(x, ids, axes_dim, theta):
    """diffusers FluxPosEmbed(theta, axes_dim).forward(ids) (one get_1d_rotary_pos_embed per axis,
    use_real=True, repeat_interleave_real=True, concatenated in axis order), then
    apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1) with x (batch, heads, seq,
    head_dim) (sequence_dim=2, the default; the current FluxAttnProcessor passes (batch, seq, heads,
    head_dim) with sequence_dim=1: same numbers). ids: (seq, n_axes). Returns float64.

    Pairs are INTERLEAVED (adjacent features 2p, 2p+1): cos/sin are repeat_interleave(2)'d and
    unbind_dim=-1 views x as (..., D/2, 2) (real, imag) with rotated = (-imag, real).
    Each axis a is its own 1-D RoPE of width axes_dim[a]: inv_freq_j = theta**(-2j/axes_dim[a]).

    Generic mapping: mode "axial", sections = [a // 2 for a in axes_dim] ((16, 56, 56) ->
    [8, 28, 28], head_dim 128), interleaved=True, base = theta (10000 for FLUX.1; FLUX.2 / Flux2PosEmbed:
    same code, 4 axes (32, 32, 32, 32) -> [16, 16, 16, 16], theta 2000), positions = ids.T.
    Requires sum(axes_dim) == head_dim (the peer broadcasts cos over all of head_dim).
    Axis order = the columns of ids. FLUX.1 pipelines: text tokens ids (0, 0, 0) (so identity
    rotation), image tokens (0, row, col) over the packed latent grid (axis 1 = height/row,
    axis 2 = width/col); ids = cat(txt_ids, img_ids). Kontext puts 1 on axis 0 for the reference image.
    The peer casts ids to float32 (pos = ids.float()); the positions are integers in all FLUX
    pipelines, so the model fits; fractional ids would not be an integer position model.
    """
    x = x.to(F64)
    pos = torch.as_tensor(ids).to(F64)
    assert pos.shape[-1] == len(axes_dim) and sum(axes_dim) == x.shape[-1]
    cos_parts, sin_parts = [], []
    for a, dim_a in enumerate(axes_dim):
        assert dim_a % 2 == 0
        inv = 1.0 / (float(theta) ** (torch.arange(0, dim_a, 2, dtype=F64) / dim_a))
        ang = torch.outer(pos[:, a], inv)  # (seq, dim_a/2)
        cos_parts.append(ang.cos().repeat_interleave(2, dim=1))
        sin_parts.append(ang.sin().repeat_interleave(2, dim=1))
    cos = torch.cat(cos_parts, dim=-1)[None, None]  # (1, 1, seq, head_dim)
    sin = torch.cat(sin_parts, dim=-1)[None, None]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack((-imag, real), dim=-1).flatten(-2)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------------------------
# 4. EVA-02 (timm)
# --------------------------------------------------------------------------------------------


def eva_timm_rope(x, grid_h, grid_w, num_prefix_tokens, temperature=10000.0):
    """timm EVA-02 (Eva with use_rot_pos_emb=True, rope_type='cat' default): the rope is
    create_rope_embed('cat', dim=embed_dim, num_heads) = RotaryEmbeddingCat(dim=embed_dim // num_heads,
    i.e. dim = head_dim, in_pixels=False, feat_shape=[grid_h, grid_w], temperature, grid_indexing='ij',
    rotate_half=False), applied in EvaAttention.forward as
    cat(q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=False)) (prefix tokens untouched).
    x: (batch, heads, num_prefix_tokens + grid_h*grid_w, head_dim). Returns float64.

    Numbers: num_bands = head_dim // 4; bands_j = temperature**(-j/num_bands) (freq_bands, step=1);
    grid 'index' = (row, col) integers (meshgrid 'ij', row-major tokens: token = row*grid_w + col);
    angle table per token = [row * bands, col * bands] (flatten of (2, num_bands)), each entry
    repeat_interleave(2) -> INTERLEAVED pairs; sin = first half of the cat table, cos = second half.
    Needs head_dim % 4 == 0 (the table has 4 * (head_dim // 4) features).

    Generic mapping: mode "axial", sections = [head_dim // 4, head_dim // 4] (head_dim 64 ->
    [16, 16]), interleaved=True, base = temperature (rope_temperature, default 10000),
    axis 0 = row (height), axis 1 = column (width) ('ij'; grid_indexing='xy' would swap them),
    patch positions (row, col) from 0; prefix tokens (class + register tokens) position (0, 0)
    (angle 0 = identity, which is exactly "left unrotated").
    Does NOT fit with ref_feat_shape: timm's EVA-02 configs set ref_feat_shape (16, 16) for
    patch14 at 224 and keep it at 448 (grid 32x32), and _build_grid rescales t = idx / feat * ref,
    i.e. positions idx * 16/32 = half-integers (and idx * r/f in float32 in general). This reference
    (like the brief's RotaryEmbeddingCat(..., feat_shape=[grid_h, grid_w])) has no ref_feat_shape, which
    equals timm whenever grid == ref_feat_shape (e.g. the patch14 224 models, grid 16x16). posenc
    would need a per-axis float position scale (or float positions) for the 448 fine-tunes. Also
    rope_grid_offset (float, default 0) adds a constant offset to the positions.
    """
    x = x.to(F64)
    head_dim = x.shape[-1]
    assert head_dim % 4 == 0
    npt = num_prefix_tokens
    assert x.shape[-2] == npt + grid_h * grid_w
    num_bands = head_dim // 4
    bands = float(temperature) ** (-torch.arange(num_bands, dtype=F64) / num_bands)
    rows, cols = torch.meshgrid(torch.arange(grid_h, dtype=F64), torch.arange(grid_w, dtype=F64), indexing="ij")
    grid = torch.stack((rows, cols), dim=-1).reshape(-1, 2)  # (N, 2) row-major
    ang = (grid[:, :, None] * bands).flatten(1)  # (N, 2 * num_bands): row bands then col bands
    sin = ang.sin().repeat_interleave(2, dim=-1)
    cos = ang.cos().repeat_interleave(2, dim=-1)
    patches = x[:, :, npt:, :]
    rot = torch.stack((-patches[..., 1::2], patches[..., 0::2]), dim=-1).reshape(patches.shape)  # timm rot()
    return torch.cat((x[:, :, :npt, :], patches * cos + rot * sin), dim=2)


def eva_timm_positions(grid_h, grid_w, num_prefix_tokens):
    """(2, npt + grid_h*grid_w) int64 generic positions of eva_timm_rope: prefix (0, 0), then (row, col)."""
    rows = torch.arange(grid_h).repeat_interleave(grid_w)
    cols = torch.arange(grid_w).repeat(grid_h)
    pre = torch.zeros(2, num_prefix_tokens, dtype=torch.int64)
    return torch.cat((pre, torch.stack((rows, cols))), dim=1)


# --------------------------------------------------------------------------------------------
# 5. torchtune VisionRotaryPositionalEmbeddings
# --------------------------------------------------------------------------------------------


def torchtune_vision_rope(x, patch_size, tile_size, base=10000, append_cls_token=True, max_num_tiles=None):
    """torchtune.modules.VisionRotaryPositionalEmbeddings(patch_size, tile_size, max_num_tiles,
    dim=head_dim // 2 (as clip_vision_encoder passes), base, append_cls_token).forward(x).
    x: (batch, seq, heads, head_dim) ('bshd', torchtune's layout), seq = max_num_tiles * (g*g + 1),
    g = tile_size // patch_size; max_num_tiles defaults to seq // (g*g + 1). Returns float64.

    Numbers: theta_j = base**(-2j/dim), j < dim // 2, dim = head_dim // 2; per tile, patch index i
    (0 .. g*g-1) has x_pos = i % g (column), y_pos = i // g (row); angles = cat(theta * (x_pos + 1),
    theta * (y_pos + 1)) -> (head_dim / 2,) pairs, applied to INTERLEAVED pairs (x viewed as
    (..., head_dim/2, 2)). The CLS slot (last of each tile if append_cls_token else first) has its
    angles masked to exactly 0 (identity). Every tile gets the same table.

    Generic mapping: mode "axial", sections = [head_dim // 4, head_dim // 4] (head_dim 64 ->
    [16, 16]), interleaved=True, base = base (10000), axis 0 = x / COLUMN (width), axis 1 = y / ROW
    (height) (note: column first, unlike EVA), positions 1-BASED: patch (col + 1, row + 1), CLS (0, 0)
    (its exact angle is 0 on every pair: identity; 0 is no patch's position since patches start at 1).
    Tokens of tile t at t * (g*g + 1) + slot; positions restart per tile. Needs head_dim % 4 == 0.
    """
    x = x.to(F64)
    bsz, seq, n_h, h_d = x.shape
    assert h_d % 4 == 0
    g = tile_size // patch_size
    per_tile = g * g + 1
    if max_num_tiles is None:
        assert seq % per_tile == 0
        max_num_tiles = seq // per_tile
    dim = h_d // 2
    theta = 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=F64)[: dim // 2] / dim))
    idx = torch.arange(g * g, dtype=F64)
    cls = -torch.ones(1, dtype=F64)
    idx = torch.cat((idx, cls)) if append_cls_token else torch.cat((cls, idx))
    xp, yp = idx % g, torch.div(idx, g, rounding_mode="floor")
    freqs = torch.cat((torch.outer(xp + 1, theta), torch.outer(yp + 1, theta)), dim=-1)
    freqs = freqs.masked_fill(idx[:, None] < 0, 0.0)  # (per_tile, h_d/2)
    c, s = freqs.cos()[None, None, :, None, :], freqs.sin()[None, None, :, None, :]
    xs = x.reshape(bsz, max_num_tiles, per_tile, n_h, h_d // 2, 2)
    a, b = xs[..., 0], xs[..., 1]
    out = torch.stack((a * c - b * s, b * c + a * s), dim=-1)
    return out.reshape(bsz, seq, n_h, h_d)


def torchtune_vision_positions(grid, num_tiles, append_cls_token=True):
    """(2, num_tiles * (grid*grid + 1)) int64 generic positions of torchtune_vision_rope:
    axis 0 = column + 1, axis 1 = row + 1, CLS = (0, 0)."""
    i = torch.arange(grid * grid)
    patch = torch.stack((i % grid + 1, i // grid + 1))
    cls = torch.zeros(2, 1, dtype=torch.int64)
    tile = torch.cat((patch, cls), dim=1) if append_cls_token else torch.cat((cls, patch), dim=1)
    return tile.repeat(1, num_tiles)


# --------------------------------------------------------------------------------------------
# 6. DINOv3: not implemented (non-integer coordinates)
# --------------------------------------------------------------------------------------------
# facebookresearch/dinov3 dinov3/layers/rope_position_encoding.py, RopePositionEmbedding.forward
# (same in transformers DINOv3ViTRopePositionEmbedding and timm RotaryEmbeddingDinoV3) uses
# NORMALISED, NON-INTEGER coordinates: patch centres coords = 2 * (i + 0.5) / n - 1 in (-1, 1) per axis
# (normalize_coords 'separate' divides by H resp. W; 'min'/'max' by min/max(H, W)), plus training-time
# shift / jitter / rescale augmentations. angle = 2*pi * coord / period_j with
# period_j = base**(2j / (head_dim // 2)) (base 100), j < head_dim // 4, table [row angles, col angles],
# tile(2) -> halves convention (rotate_half), axis 0 = row; prefix tokens (CLS + registers) unrotated.
# Not an integer-position model, so no dinov3_rope here. Its frequency layout is "axial" with
# sections [head_dim//4, head_dim//4], halves, base 100, but posenc would need float positions
# (or a per-axis affine map pos -> 2*pi*(2*(pos+0.5)/n - 1)) to express it. The min_period/max_period
# parametrisation (linspace exponents) is not even base**(-2j/w)-shaped.


# --------------------------------------------------------------------------------------------
# Self-test: each peer reference == generic_multi_axis_rope with the mapped settings
# --------------------------------------------------------------------------------------------


def _bhsd_to_bshd(t):
    return t.transpose(1, 2)


def _self_test():
    gen = torch.Generator().manual_seed(1234)
    worst = {}

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    def check(name, got, want):
        err = (got - want).abs().max().item()
        worst[name] = max(worst.get(name, 0.0), err)
        assert err < 1e-12, f"{name}: max abs err {err}"

    # 1 + 2: Qwen2-VL / Qwen3-VL, q, k (batch, heads, seq, head_dim), position_ids (3, batch, seq)
    def generic_bhsd(t, positions, sections, mode, base, interleaved):
        # generic model on a (batch, heads, seq, head_dim) tensor, result back in bhsd
        out = generic_multi_axis_rope(_bhsd_to_bshd(t), positions, sections, mode, base, interleaved)
        return _bhsd_to_bshd(out)

    qwen_cases = (([3, 5, 4], 1e4), ([16, 24, 24], 1e6), ([5, 4, 4], 5e6), ([2, 5, 5], 1e4), ([24, 20, 20], 5e6))
    for sections, base in qwen_cases:
        d = 2 * sum(sections)
        b, h, s = 3, 5, 13
        q, k = rand(b, h, s, d), rand(b, h, s, d)
        pid = torch.randint(0, 97, (3, b, s), generator=gen)
        for fn, mode in ((qwen2vl_mrope, "mrope"), (qwen3vl_mrope_interleaved, "mrope_interleaved")):
            qo, ko = fn(q, k, pid, sections, base)
            for t, o in ((q, qo), (k, ko)):
                check(fn.__name__, o, generic_bhsd(t, pid, sections, mode, base, False))
        # text-only (batch, seq) ids broadcast to the three rows == plain 1-D RoPE
        pid2 = torch.randint(0, 97, (b, s), generator=gen)
        qo, _ = qwen2vl_mrope(q, k, pid2, sections, base)
        pid3 = pid2[None].expand(3, -1, -1)
        check("qwen2vl_mrope", qo, generic_bhsd(q, pid3, sections, "mrope", base, False))
        qo, _ = qwen3vl_mrope_interleaved(q, k, pid2, sections, base)
        check("qwen3vl_mrope_interleaved", qo, generic_bhsd(q, pid3, sections, "mrope_interleaved", base, False))

    # Qwen3-VL with sum(sections) != head_dim / 2: generic sections [d/2 - s1 - s2, s1, s2]
    d, sec = 36, [8, 6, 5]  # peer reads only s1, s2; d/2 = 18
    q, k = rand(2, 3, 7, d), rand(2, 3, 7, d)
    pid = torch.randint(0, 50, (3, 2, 7), generator=gen)
    qo, _ = qwen3vl_mrope_interleaved(q, k, pid, sec, 1e4)
    equiv = [d // 2 - sec[1] - sec[2], sec[1], sec[2]]
    check("qwen3vl_mrope_interleaved", qo, generic_bhsd(q, pid, equiv, "mrope_interleaved", 1e4, False))

    # 3: FLUX, x (batch, heads, seq, head_dim), ids (seq, n_axes)
    for axes_dim, theta in (([4, 6, 10], 10000.0), ([16, 56, 56], 10000.0), ([2, 6, 4, 8], 2000.0)):
        b, h, s = 2, 3, 11
        x = rand(b, h, s, sum(axes_dim))
        ids = torch.randint(0, 64, (s, len(axes_dim)), generator=gen)
        ids[:3] = 0  # text tokens
        got = flux_rope(x, ids, axes_dim, theta)
        check("flux_rope", got, generic_bhsd(x, ids.T, [a // 2 for a in axes_dim], "axial", theta, True))

    # 4: EVA-02 timm, prefix tokens untouched
    for hd, gh, gw, npt, temp in ((12, 3, 5, 1, 10000.0), (20, 5, 3, 0, 10000.0), (64, 7, 9, 5, 100.0)):
        x = rand(3, 5, npt + gh * gw, hd)
        got = eva_timm_rope(x, gh, gw, npt, temp)
        want = generic_bhsd(x, eva_timm_positions(gh, gw, npt), [hd // 4, hd // 4], "axial", temp, True)
        check("eva_timm_rope", got, want)
        assert torch.equal(got[:, :, :npt], x[:, :, :npt])

    # 5: torchtune vision, x (batch, seq, heads, head_dim), CLS appended or prepended, several tiles
    tt_cases = ((12, 4, 12, 2, True, 10000), (20, 5, 25, 3, False, 10000), (64, 14, 56, 1, True, 500))
    for hd, patch, tile, tiles, cls_last, base in tt_cases:
        g = tile // patch
        x = rand(3, tiles * (g * g + 1), 5, hd)
        got = torchtune_vision_rope(x, patch, tile, base, cls_last)
        positions = torchtune_vision_positions(g, tiles, cls_last)
        want = generic_multi_axis_rope(x, positions, [hd // 4, hd // 4], "axial", base, True)
        check("torchtune_vision_rope", got, want)
        cls_slots = [t * (g * g + 1) + (g * g if cls_last else 0) for t in range(tiles)]
        assert torch.equal(got[:, cls_slots], x[:, cls_slots])

    # generic sanity: partial rotary passes the tail through; one axis == plain 1-D RoPE
    x = rand(2, 9, 3, 30)
    pos = torch.randint(0, 40, (2, 9), generator=gen)
    out = generic_multi_axis_rope(x, pos, [5, 7], "mrope", 1e4, False)
    assert torch.equal(out[..., 24:], x[..., 24:])
    one = generic_multi_axis_rope(x, pos[:1], [12], "mrope", 1e4, True)
    inv = 1e4 ** (-torch.arange(0, 24, 2, dtype=F64) / 24)
    ang = pos[0].to(F64)[:, None] * inv  # (seq, 12)
    xc = torch.view_as_complex(x[..., :24].reshape(2, 9, 3, 12, 2).contiguous())
    ref = torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)[None, :, None]).flatten(-2)
    check("generic 1-D", one[..., :24], ref)
    return worst


if __name__ == "__main__":
    for name, err in _self_test().items():
        print(f"{name:28s} max abs err vs generic: {err:.2e}")
    print("multi_axis_reference self-test passed")
