"""Random bad (and borderline) arguments for every op, straight through torch.ops.posenc:
each call must either succeed or be rejected by posenc's own checks (a message that starts
with "posenc:" or the op's name, with the check's exception type), never crash the process,
hang, or fail elsewhere: an internal assert or an error from inside an ATen op fails the
test, as does any other exception. The pools hold the values a fuzzing pass found
dangerous (offsets near 2**63 that wrapped a range check, meta tensors among real ones,
NaN/negative p, huge table_len and rotary_dim, positions beyond 2**53), so this guards
those fixes and their neighbours; test_add_position_errors.py / test_rope_errors.py check the messages."""

import math
import random
import re

import pytest
import torch

import posenc  # noqa: F401  (loads the ops)

ops = torch.ops.posenc
# What building the arguments may raise (torch's own tensor constructors and casts).
ALLOWED = (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError)
# The types posenc's checks raise: TORCH_CHECK (RuntimeError: shapes, devices),
# TORCH_CHECK_TYPE (TypeError: dtypes), TORCH_CHECK_VALUE (ValueError: values),
# TORCH_CHECK_INDEX (IndexError: positions).
OWN_TYPES = (RuntimeError, ValueError, IndexError, TypeError)
OWN_PREFIX = re.compile(r"^(posenc|[a-z0-9_]+):")
# torch's own rejections that the sweep's values provoke on purpose, each a clear error, not
# a defect: allocations of impossible sizes (table_len 2**62: the gradient table is
# (table_len, d)), and data-dependent ops (the bounds ops read values) on meta tensors.
TORCH_REJECTIONS = {
    RuntimeError: re.compile(r"^Storage size calculation overflowed|DefaultCPUAllocator: can't allocate memory"),
    NotImplementedError: re.compile(r"^Cannot copy out of meta tensor; no data!"),
}


def is_clean_rejection(error: Exception) -> bool:
    """posenc's own check (its prefix names posenc or one of its ops, the type is a check's),
    or one of torch's listed rejections; never an internal assert."""
    message = str(error)
    if "INTERNAL ASSERT FAILED" in message:
        return False
    prefix = OWN_PREFIX.match(message)
    if prefix is not None and (prefix.group(1) == "posenc" or hasattr(ops, prefix.group(1))):
        return type(error) in OWN_TYPES
    pattern = TORCH_REJECTIONS.get(type(error))
    return pattern is not None and pattern.search(message) is not None
HUGE = [2**31, 2**53 + 1, 2**62, 2**63 - 1, -(2**62), -(2**63), -1]
NAN = float("nan")
_SPEC = torch.ops.posenc.rope_scaling_spec()
N_KEYS = len(_SPEC[1])  # the rope ops' fixed scaling values
# The keys each type reads (bit i: key i; the op refuses the others): the usual bitmask gives
# those of the type (every key but partial_rotary_factor, proportional's, for an unknown type).
PARTIAL_KEY = list(_SPEC[1]).index("partial_rotary_factor")
TYPE_KEY_MASKS = dict(zip(_SPEC[0], _SPEC[9]))


def pick(rng, usual, unusual, p_unusual=0.3):
    return rng.choice(unusual) if rng.random() < p_unusual else rng.choice(usual)


def tensor(rng, shape, dtype=None, device=None):
    dtype = dtype or pick(rng, [torch.float32], [torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                                  torch.bool, torch.complex64])
    device = device or pick(rng, ["cpu"], ["meta"], 0.15)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.randint(0, 3, shape, device=device).to(dtype)


def index(rng, shape, high):
    values = torch.randint(0, max(high, 1), shape)
    if rng.random() < 0.3 and values.numel():
        values.view(-1)[rng.randrange(values.numel())] = rng.choice(HUGE)
    dtype = pick(rng, [torch.int64], [torch.int32, torch.float32])
    return values.to(dtype).to(pick(rng, ["cpu"], ["meta"], 0.1))


def add_position_call(rng):
    B, S, d = rng.choice([0, 1, 3]), rng.choice([0, 1, 5]), rng.choice([1, 4, 8])
    L = rng.choice([S, S + 2, max(S - 1, 0)])
    x = tensor(rng, pick(rng, [(B, S, d)], [(B, S), (B, S, d + 1), (1, B, S, d)]))
    table = tensor(rng, pick(rng, [(L, d), (1, L, d)], [(L,), (2, L, d)]), device="cpu")
    positions = None if rng.random() < 0.5 else index(rng, pick(rng, [(S,), (B, S)], [(S + 1,), (B, S, 1)]), L)
    offset = 0 if positions is not None and rng.random() < 0.8 else pick(rng, [0, 1], HUGE)
    p = pick(rng, [0.0, 0.5], [-0.5, 1.0, 1.5, NAN, math.inf])
    return lambda: ops.add_position(x, table, positions, offset, rng.random() < 0.5, p)


def add_position_backward_call(rng):
    B, S, d = rng.choice([0, 2]), rng.choice([1, 4]), rng.choice([1, 8])
    grad = tensor(rng, pick(rng, [(B, S, d)], [(B, S), (B * S * d,)]))
    rng_t = pick(rng, [torch.tensor([7, 0])], [torch.tensor([1]), torch.empty(2, dtype=torch.long, device="meta"),
                                              torch.zeros(2, dtype=torch.int32), torch.tensor([2**63 - 1, -(2**63)])])
    p = pick(rng, [0.0, 0.3], [-0.5, 1.5, NAN, math.inf])
    if rng.random() < 0.4:
        return lambda: ops.add_position_backward(grad, rng_t, p)
    table_len = pick(rng, [S, S + 3], [0, -1, 2**40, 2**62, 2**63 - 1])
    positions = None if rng.random() < 0.5 else index(rng, pick(rng, [(S,), (B, S)], [(S + 2,)]), S)
    offset = 0 if positions is not None else pick(rng, [0, 1], HUGE)
    return lambda: ops.add_position_backward_with_table(grad, rng_t, positions, offset, rng.random() < 0.5, p,
                                                        table_len, rng.random() < 0.5)


def rope_call(rng):
    # Many arguments, each possibly bad: a low rate per argument keeps some calls valid.
    def pick(rng, usual, unusual, p_unusual=0.06):
        return rng.choice(unusual) if rng.random() < p_unusual else rng.choice(usual)

    layout = pick(rng, ["bshd", "bhsd", "sbhd", "thd"], ["", "BSHD", "xyz"])
    D = pick(rng, [8, 16], [0, 7, 1024])
    shape = (3, 2, D) if layout == "thd" else (1, 3, 2, D)
    q = tensor(rng, pick(rng, [shape], [shape[:-1], (1,) + shape]))
    k = None if rng.random() < 0.3 else tensor(rng, shape, dtype=q.dtype if q.dtype.is_floating_point else None,
                                                 device=q.device.type)
    positions = None if rng.random() < 0.6 else index(rng, pick(rng, [(3,), (1, 3)], [(4,)]), 100)
    offsets = None if rng.random() < 0.7 else index(rng, pick(rng, [(1,)], [(2,)]), 100)
    cu = None
    if layout == "thd" or rng.random() < 0.1:
        cu = index(rng, (3,), 4) if rng.random() < 0.3 else torch.tensor(pick(rng, [[0, 1, 3]], [[0, 4], [1, 3], [0, 3, 1]]))
    rope_type = pick(rng, ["default", "linear", "dynamic", "yarn", "llama3"], ["", "ntk"])
    # A few unusual values per list (one in twenty keys): most lists still reach the kernels.
    # The op's list: the bitmask of the keys given (all of them here), then the values.
    scaling = [pick(rng, [2.0, 4.0, 64.0], [NAN, 0.0, -1.0, 1e-310, math.inf], 0.05)
               for _ in range(rng.choice([0, N_KEYS, N_KEYS, 3]))]
    if len(scaling) == N_KEYS:
        mask = TYPE_KEY_MASKS.get(rope_type, 2**N_KEYS - 1 - 2**PARTIAL_KEY)
        scaling = [v if mask >> i & 1 else 0.0 for i, v in enumerate(scaling)]
        scaling.insert(0, pick(rng, [float(mask)], [0.5, -1.0, float(2**N_KEYS), NAN]))
    base = pick(rng, [10000.0], [1.0, -1.0, NAN, 1e300])
    seq_len = pick(rng, [0, -1], [2**62, -5])
    rotary_dim = pick(rng, [-1, 4], [0, 3, 2 * D + 2])
    # Multi-axis: sections (pairs per axis) with (n_axes, ...) coordinates, often mismatched.
    sections = [] if rng.random() < 0.8 else pick(rng, [[2, 2], [1, 1, 2]], [[0, 4], [5], [1] * 5, [-1, 3], [2**40, 1]], 0.3)
    if sections and rng.random() < 0.7:
        positions = index(rng, pick(rng, [(len(sections), 3), (len(sections), 1, 3)], [(4, 3), (len(sections), 2, 3)]), 100)
    mode = pick(rng, ["axial", "mrope", "mrope_interleaved"], ["", "MROPE"])
    args = (q, k, positions, offsets, pick(rng, [0, 5], HUGE), cu, base, rope_type, scaling, seq_len, rotary_dim,
            rng.random() < 0.5, layout, rng.random() < 0.5, sections, mode)
    if rng.random() < 0.3:
        return lambda: ops.rope_(*args)
    return lambda: ops.rope(*args)


def qk_norm_rope_call(rng):
    """qk_norm_rope, its in-place twin and its backward: weights of wrong lengths, dtypes and devices, bad eps,
    weight_offset and norm, with a few of RoPE's arguments (rope_call sweeps those)."""
    def pick(rng, usual, unusual, p_unusual=0.08):
        return rng.choice(unusual) if rng.random() < p_unusual else rng.choice(usual)

    layout = pick(rng, ["bshd", "bhsd", "thd"], ["xyz"])
    D = pick(rng, [8, 16], [0, 7])
    shape = (3, 2, D) if layout == "thd" else (1, 3, 2, D)
    q = tensor(rng, pick(rng, [shape], [shape[:-1]]))
    k = tensor(rng, shape, dtype=q.dtype if q.dtype.is_floating_point else None, device=q.device.type)
    norm = pick(rng, ["head", "hidden"], ["", "layer"])
    length = D if norm == "head" else 2 * D
    wdtype = q.dtype if q.dtype.is_floating_point and rng.random() > 0.1 else None
    wq, wk = (tensor(rng, pick(rng, [(length,)], [(length + 1,), (), (2, length)]), dtype=wdtype,
                     device=pick(rng, [q.device.type], ["meta", "cpu"])) for _ in range(2))
    eps = pick(rng, [1e-6, 1e-5], [0.0, -1.0, NAN, math.inf, 1e300])
    offset = pick(rng, [0.0, 1.0], [NAN, -math.inf])
    cu = torch.tensor(pick(rng, [[0, 1, 3]], [[0, 4], [1, 3]])) if layout == "thd" else None
    positions = None if rng.random() < 0.6 else index(rng, pick(rng, [(3,), (1, 3)], [(4,)]), 100)
    rope = dict(positions=positions, offset=pick(rng, [0, 5], HUGE), cu_seqlens=cu, layout=layout,
                rotary_dim=pick(rng, [-1, 4], [0, 3, 2 * D + 2]), interleaved=rng.random() < 0.5,
                base=pick(rng, [10000.0], [1.0, NAN]))
    if rng.random() < 0.3:
        gq = tensor(rng, pick(rng, [tuple(q.shape)], [(1,)]), dtype=q.dtype if q.dtype.is_floating_point else None,
                    device=q.device.type)
        return lambda: ops.qk_norm_rope_backward(q, k, gq, gq if gq.shape == k.shape else k, wq, wk, eps, offset,
                                                 norm, **rope)
    if rng.random() < 0.25:  # the in-place op: the same checks, then its own
        return lambda: ops.qk_norm_rope_(q, k, wq, wk, eps, offset, norm, **rope)
    return lambda: ops.qk_norm_rope(q, k, wq, wk, eps, offset, norm, **rope)


def other_call(rng):
    kind = rng.randrange(3)
    if kind == 0:
        return lambda: ops.rope_frequencies(pick(rng, [8, 64], [0, 3, 1026, 2**40]), pick(rng, [10000.0], [NAN, 0.5]),
                                            pick(rng, ["default", "dynamic"], ["x"]),
                                            [float(2**N_KEYS - 1)] + [pick(rng, [2.0, 64.0], [NAN, 1e-310]) for _ in range(N_KEYS)],
                                            pick(rng, [0, 100], [2**62, -1]))
    if kind == 1:
        q = tensor(rng, (1, 3, 2, 8))
        bounds = ops.rope_position_bounds if rng.random() < 0.5 else ops.rope_position_extremes  # host / device
        return lambda: bounds(q, None, index(rng, (3,), 10) if rng.random() < 0.5 else None,
                              index(rng, (1,), 10) if rng.random() < 0.5 else None,
                              pick(rng, [0, 3], HUGE), cu_seqlens=None, layout="bshd")
    positions = index(rng, pick(rng, [(4,), (2, 3)], [(0,)]), 50)
    return lambda: ops.sinusoidal_table(positions, pick(rng, [4, 7], [0, -3, 2**40]), pick(rng, [10000.0], [NAN, 1.0]))


def helper_call(rng):
    """The helper ops (make_positions, sinusoidal_2d_table, resample_position_table,
    timestep_embedding) and position_bounds, raw: the Python wrappers only normalise types."""
    kind = rng.randrange(5)
    if kind == 0:
        shape = pick(rng, [(2, 5)], [(5,), (0, 3), (1, 2, 3)])
        tokens = tensor(rng, shape, dtype=pick(rng, [torch.int64], [torch.float32, torch.bool]))
        padding_idx = pick(rng, [0, 1], HUGE)
        return lambda: ops.make_positions(tokens, padding_idx)
    if kind == 1:
        h, w = (pick(rng, [1, 3], [0, -2, 2**40, 2**62]) for _ in range(2))
        dim = pick(rng, [8, 16], [0, 6, -4, 2**40])
        base = pick(rng, [10000.0], [NAN, 1.0, -3.0, math.inf])
        prefix = pick(rng, [0, 1], [-1, 2**62])
        dtype = pick(rng, [None, torch.float64], [torch.int64, torch.bool])
        device = pick(rng, [None], ["meta"])
        return lambda: ops.sinusoidal_2d_table(h, w, dim, base, prefix, dtype, device)
    if kind == 2:
        prefix = pick(rng, [0, 1], [-1, 40, 2**62])
        shape = (1, 17, 4)
        if prefix < 40:
            shape = pick(rng, [(1, max(prefix, 0) + 16, 4)], [(16, 4), (2, 17, 4), (1, 15, 4)])
        pe = tensor(rng, shape, device="cpu")
        grids = ([[4, 4], [3, 5]], [[0, 4], [-1, 2], [4], [2, 2, 2], [2**40, 2**40]])
        new, old = (pick(rng, *grids) for _ in range(2))
        old = None if rng.random() < 0.5 else old
        mode = pick(rng, ["bicubic", "nearest"], ["", "cubic"])
        antialias = rng.random() < 0.5
        return lambda: ops.resample_position_table(pe, new, old, prefix, mode, antialias)
    if kind == 3:
        t = tensor(rng, pick(rng, [(5,)], [(2, 3), (), (0,)]))
        dim = pick(rng, [3, 8], [0, -1, 2**40])
        period = pick(rng, [10000.0], [0.0, NAN, -1.0])
        shift = pick(rng, [1.0, 0.0], [4.0, math.inf, NAN])
        scale = pick(rng, [1.0], [NAN, -math.inf])
        flip = rng.random() < 0.5
        return lambda: ops.timestep_embedding(t, dim, period, flip, shift, scale)
    positions = index(rng, pick(rng, [(5,), (2, 3)], [(0,)]), 10)
    max_len = pick(rng, [None, 10], [0, -1, 2**63 - 1])
    return lambda: ops.position_bounds(positions, max_len)


@pytest.mark.parametrize("family", [add_position_call, add_position_backward_call, rope_call, other_call,
                                    helper_call, qk_norm_rope_call])
def test_random_bad_arguments_raise_cleanly(family):
    rng = random.Random(f"sweep-{family.__name__}")  # a fixed seed per family
    torch.manual_seed(0)
    outcomes = {"ok": 0, "raised": 0}
    unclean = []
    for _ in range(800):
        try:
            call = family(rng)
        except ALLOWED:  # building the arguments themselves (e.g. a float tensor cast) can fail
            continue
        try:
            call()
            outcomes["ok"] += 1
        except Exception as e:  # noqa: BLE001 (every exception is judged below)
            outcomes["raised"] += 1
            if not is_clean_rejection(e):
                unclean.append(f"{type(e).__name__}: {str(e)[:200]}")
    assert not unclean, unclean[:5]
    # Both kinds happen: the sweep reaches the kernels, not only the first check.
    assert outcomes["ok"] > 10 and outcomes["raised"] > 50, outcomes


@pytest.mark.parametrize("error, clean", [
    (ValueError("posenc: expected base > 1, got 1"), True),
    (ValueError("sinusoidal_2d_table: expected dim to be a multiple of 4, got 6"), True),
    (IndexError("posenc: expected positions in [0, max_len=9), found 9"), True),
    (NotImplementedError("posenc: expected base > 1, got 1"), False),  # not a check's type
    (ValueError("not_an_op: expected something"), False),  # no posenc op of that name
    (RuntimeError("false INTERNAL ASSERT FAILED at \"rope_pairs.cuh\":255, posenc: rotary_dim 600"), False),
    (RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1"), False),
    (RuntimeError("Storage size calculation overflowed with sizes=[4611686018427387904, 1]"), True),
    (NotImplementedError("Cannot copy out of meta tensor; no data!"), True),
    (KeyError("posenc: x"), False),
])
def test_clean_rejection_judge(error, clean):
    """The judge itself: a sweep whose judge accepted everything could not fail."""
    assert is_clean_rejection(error) is clean


def _calls_with_misused_arguments():
    """Arguments the Python front ends used to accept and misuse (bool() of "False" is True;
    int() truncates 8.9; float() takes "100"; True is 1), each refused now, naming itself."""
    from posenc import functional as F

    q, x, table, t = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 4), torch.randn(5, 4), torch.tensor([1.0, 2.0])
    cache = torch.zeros(1, 6, 2, 8)
    return [
        ("interleaved", lambda: F.apply_rope(q, interleaved="False")),
        ("inplace", lambda: F.apply_rope(q.clone(), inplace="False")),
        ("inverse", lambda: F.apply_rope(q, inverse="False")),
        ("base", lambda: F.apply_rope(q, base="100")),
        ("interleaved", lambda: posenc.RotaryPositionalEncoding(8, interleaved="False")),
        ("base", lambda: F.rope_cos_sin(torch.arange(3), 8, base="100")),
        ("attention_scaling", lambda: F.rope_cos_sin(torch.arange(3), 8, attention_scaling="False")),
        ("rotary_dim", lambda: F.rope_frequencies(8.9)),
        ("seq_len", lambda: F.rope_frequencies(8, seq_len=True)),
        ("grid", lambda: F.grid_positions(True, 2)),
        ("num_prefix_tokens", lambda: F.grid_positions(2, 2, num_prefix_tokens=True)),
        ("d_model", lambda: F.sinusoidal_table(torch.arange(4), True)),
        ("base", lambda: F.sinusoidal_table(torch.arange(4), 8, base="10000")),
        ("offset", lambda: F.add_position(x, table, offset=True)),
        ("p", lambda: F.add_position(x, table, p=True)),
        ("p", lambda: F.add_position(x, table, p="0.5")),
        ("p", lambda: F.add_position(x, table, p=1.5, training=False)),
        ("training", lambda: F.add_position(x, table, training="False")),
        ("batch_first", lambda: F.add_position(x, table, batch_first=None)),
        ("batch_first", lambda: posenc.PositionalEncoding(4, batch_first="False")),
        ("flip_sin_to_cos", lambda: F.timestep_embedding(t, 8, flip_sin_to_cos="False")),
        ("flip_sin_to_cos", lambda: posenc.Timesteps(8, "False", 0)),
        ("antialias", lambda: F.resample_position_table(torch.randn(1, 17, 8), 3, antialias="False")),
        ("return_k", lambda: F.rope_append_kv(q, q[:, :, :2], q[:, :, :2], cache, cache.clone(), return_k="False")),
        ("inplace", lambda: F.qk_norm_rope(q, q, torch.ones(8), torch.ones(8), inplace="False")),
        ("num_heads", lambda: posenc.QKNormRotary(8, norm="hidden", num_heads=0, num_kv_heads=0)),
        ("num_heads", lambda: posenc.QKNormRotary(8, norm="hidden", num_heads=True, num_kv_heads=1)),
        ("eps", lambda: posenc.QKNormRotary(8, eps=-1.0)),
        ("head_dim", lambda: posenc.QKNormRotary(8.0)),
        # A fuzz of the Python API (these reached ATen's generic messages):
        ("num_prefix_tokens", lambda: F.resample_position_table(torch.randn(1, 17, 8), 3, num_prefix_tokens=17)),
        ("dim > 0", lambda: F.resample_position_table(torch.randn(1, 17, 0), 3)),
        ("num_heads", lambda: posenc.QKNormRotary(8, norm="hidden", num_heads=2**62, num_kv_heads=1)),
        ("dtype", lambda: posenc.QKNormRotary(8, dtype=torch.int64)),
        ("dtype", lambda: posenc.QKNormRotary(8, dtype=torch.float8_e4m3fn)),  # floating, but no op takes it
        ("dtype", lambda: posenc.PositionalEncoding(8, dtype=torch.int64)),
        ("dtype", lambda: posenc.LearnedPositionalEncoding(8, dtype=torch.complex64)),
        ("real table", lambda: posenc.LearnedPositionalEncoding(4, max_len=5).load_table(
            torch.randn(5, 4, dtype=torch.complex64))),
        ("real table", lambda: posenc.LearnedPositionalEncoding(4, max_len=5).load_table(
            torch.randn(5, 4, device="meta"))),
        ("meta device", lambda: F.rope_cos_sin(torch.arange(5, device="meta"), 8, scaling=dict(
            rope_type="dynamic", factor=2.0, original_max_position_embeddings=2))),
        # Ints past int64 reached the op's schema ("Expected a value of type 'int' ... found
        # type 'int'", a RuntimeError naming the op, or position_range_check's "lo").
        ("offset to fit in int64", lambda: F.apply_rope(q, offset=2**63)),
        ("rotary_dim to fit in int64", lambda: F.apply_rope(q, rotary_dim=2**63)),
        ("rotary_offset to fit in int64", lambda: F.apply_rope(q, rotary_offset=2**63)),
        ("seq_len to fit in int64", lambda: F.apply_rope(q, seq_len=2**63, scaling=dict(
            rope_type="dynamic", factor=2.0, original_max_position_embeddings=2))),
        ("offset to fit in int64", lambda: F.qk_norm_rope(q, q, torch.ones(8), torch.ones(8), offset=-(2**63) - 1)),
        ("offset to fit in int64", lambda: posenc.RotaryPositionalEncoding(8)(q, offset=2**63)),
        ("offset to fit in int64", lambda: F.rope_append_kv(q, q[:, :, :2], q[:, :, :2], cache, cache.clone(),
                                                            offset=2**63)),
        ("from_seq_len to fit in int64", lambda: F.rope_shift_kv(cache, torch.arange(2), torch.arange(2),
                                                                 rows=torch.arange(2), from_seq_len=2**63)),
        # Non-tensors where a tensor goes: a TypeError naming the argument, not the schema's
        # RuntimeError (or an AttributeError from the module).
        ("expected x to be a Tensor", lambda: F.add_position([[1.0]], table)),
        ("expected table to be a Tensor", lambda: F.add_position(x, [[1.0]])),
        ("expected x to be a Tensor", lambda: posenc.PositionalEncoding(4)([[1.0]])),
        ("expected q to be a Tensor", lambda: posenc.RotaryPositionalEncoding(8)([1.0])),
        ("expected k to be a Tensor or None", lambda: F.apply_rope(q, [1.0])),
        ("expected positions to be a Tensor or None", lambda: F.apply_rope(q, positions=[0, 1, 2])),
        ("expected cu_seqlens to be a Tensor or None", lambda: F.apply_rope(q[0], cu_seqlens=[0, 3], layout="thd")),
        ("expected q_weight to be a Tensor or None", lambda: F.rope_append_kv(
            q, q[:, :, :2], q[:, :, :2], cache, cache.clone(), q_weight=[1.0] * 8, k_weight=torch.ones(8))),
        # Flags and settings taken loosely: "False" was True, True was 1, 2.5 heads were ignored.
        ("check_inputs", lambda: F.apply_rope(q, check_inputs="False")),
        ("check_inputs", lambda: F.qk_norm_rope(q, q, torch.ones(8), torch.ones(8), check_inputs="no")),
        ("num_heads", lambda: posenc.QKNormRotary(8, num_heads=2.5)),
        ("num_kv_heads", lambda: posenc.QKNormRotary(8, num_kv_heads="x")),
        ("num_channels", lambda: posenc.Timesteps(torch.tensor(8), True, 0)),
        # A set or dict has no order: {4, 3} was read as (3, 4), height and width swapped.
        ("new_grid", lambda: F.resample_position_table(torch.randn(1, 12, 4), {4, 3}, old_grid=(3, 4))),
        ("new_grid", lambda: F.resample_position_table(torch.randn(1, 12, 4), {4: 0, 3: 0}, old_grid=(3, 4))),
        # Past 2**53 the float64 angle rounded the position: 2**60 + 1 got 2**60's tables.
        ("positions within", lambda: F.rope_cos_sin(torch.tensor([2**60 + 1]), 8)),
        # Added in float32, an eps below float32's range was 0 (a subnormal one is 0 under
        # flush-to-zero): an all-zero head gave NaN.
        ("eps >= 1.1754943508222875e-38", lambda: F.qk_norm_rope(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8),
                                                                  torch.ones(8), torch.ones(8), eps=1e-300)),
        ("eps >= 1.1754943508222875e-38", lambda: posenc.QKNormRotary(8, eps=1e-46)(q, q)),
        ("eps >= 1.1754943508222875e-38", lambda: posenc.QKNormRotary(8, eps=1e-40)(q, q)),
        ("eps >= 2.2250738585072014e-308", lambda: posenc.QKNormRotary(8, eps=1e-310).double()(q.double(),
                                                                                              q.double())),
        # Attention factors that made every output inf or NaN: longrope's default
        # sqrt(1 + ln(factor) / ln(original)) at original 1 or below, yarn's given 0 or its
        # mscale ratio over a zero.
        ("attention factor", lambda: F.apply_rope(q, scaling=dict(
            rope_type="longrope", factor=4.0, original_max_position_embeddings=1, short_factor=[1.0] * 4,
            long_factor=[1.0] * 4))),
        ("attention_factor", lambda: F.apply_rope(q, scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=8, attention_factor=0.0))),
        ("attention factor", lambda: F.apply_rope(q, scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=1.0,
            mscale_all_dim=-10 / math.log(4.0)))),
        ("attention factor", lambda: F.apply_rope(q, scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=8, attention_factor=1e300))),
    ]


@pytest.mark.parametrize("index", range(len(_calls_with_misused_arguments())))
def test_misused_arguments_are_refused_naming_them(index):
    name, call = _calls_with_misused_arguments()[index]
    with pytest.raises((TypeError, ValueError), match=name):
        call()


def test_position_bounds_of_meta_positions_names_the_device():
    with pytest.raises(RuntimeError, match=r"^position_bounds: reads the positions' values.*meta device"):
        ops.position_bounds(torch.arange(3, device="meta"), 5)


def test_numpy_scalars_are_taken_as_python_numbers():
    """numpy integers, floats and bools, which the ops take, were refused by some front ends
    only (apply_rope's offset, qk_norm_rope's eps, apply_rope_cos_sin's interleaved,
    rope_shift_kv's seq lengths) and accepted by others: each now equals the Python number."""
    import numpy as np
    from posenc import functional as F

    q = torch.randn(1, 4, 2, 8)
    w = torch.rand(8) + 0.5
    cos, sin = F.rope_cos_sin(torch.arange(4), 8)
    same = dict(rtol=0, atol=0)
    torch.testing.assert_close(F.apply_rope(q, offset=np.int64(3)), F.apply_rope(q, offset=3), **same)
    torch.testing.assert_close(F.qk_norm_rope(q, q, w, w, eps=np.float32(0.5))[0],
                               F.qk_norm_rope(q, q, w, w, eps=float(np.float32(0.5)))[0], **same)
    torch.testing.assert_close(F.apply_rope_cos_sin(q, None, cos, sin, layout="bshd", interleaved=np.bool_(True)),
                               F.apply_rope_cos_sin(q, None, cos, sin, layout="bshd", interleaved=True), **same)
    scaling = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=4)
    caches = [torch.randn(1, 16, 2, 8) for _ in range(2)]
    caches[1].copy_(caches[0])
    for cache, (a, b) in zip(caches, [(np.int64(16), np.int64(12)), (16, 12)]):
        F.rope_shift_kv(cache, torch.arange(4, 8), torch.arange(2, 6), rows=torch.arange(4, 8),
                        scaling=scaling, from_seq_len=a, to_seq_len=b)
    torch.testing.assert_close(caches[0], caches[1], **same)


def test_a_numpy_rotary_dim_is_an_int():
    """RopeConfig.parse refused np.int64 rotary_dim (an isinstance test) where rope_cos_sin
    and every other int argument took it."""
    import numpy as np
    from posenc import functional as F

    q = torch.randn(1, 4, 2, 8)
    assert torch.equal(F.apply_rope(q, rotary_dim=np.int64(4)), F.apply_rope(q, rotary_dim=4))
    assert posenc.RotaryPositionalEncoding(8, rotary_dim=np.int64(4)).rotary_dim == 4


def test_a_modules_bad_dropout_p_is_refused_in_eval_mode_too():
    """nn.Dropout's F.dropout refuses p outside [0, 1] in eval mode too; the fused module
    passed p=0 in eval mode and so ran with dropout.p = 2.0."""
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"dropout probability has to be between 0 and 1, but got 2\.0"):
        torch.nn.functional.dropout(x, 2.0, False)
    for module in (posenc.PositionalEncoding(8), posenc.LearnedPositionalEncoding(8)):
        module.eval()
        torch.testing.assert_close(module(x), x + module.pe[:, :5], rtol=0, atol=0)  # p=0.1 off in eval
        module.dropout.p = 2.0
        scripted = torch.jit.script(module)  # (a scripted nn.Dropout's p is a constant)
        with pytest.raises(ValueError, match=r"dropout probability p in \[0, 1\], got 2\.0"):
            module(x)
        with pytest.raises(torch.jit.Error, match=r"ValueError: posenc: expected dropout probability p in \[0, 1\], got 2"):
            scripted(x)  # (TorchScript's str(2.0) is "2.")


def test_transformers_apply_rotary_pos_emb_refuses_a_bool_unsqueeze_dim():
    pytest.importorskip("transformers")  # the integration module needs it (the peer's own skip)
    from posenc.integrations.transformers import posenc_apply_rotary_pos_emb

    q = torch.randn(1, 2, 3, 8)
    cos, sin = posenc.functional.rope_cos_sin(torch.arange(3).unsqueeze(0), 8)
    for bad in (True, 1.0, 3):
        with pytest.raises(ValueError, match="expected unsqueeze_dim 1"):
            posenc_apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=bad)
    assert torch.equal(posenc_apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=1)[0],
                       posenc_apply_rotary_pos_emb(q, q, cos, sin)[0])


def test_qk_norm_rotary_repr_names_its_rope_settings_and_head_counts():
    m = posenc.QKNormRotary(8, norm="hidden", num_heads=2, num_kv_heads=1, base=500.0,
                            scaling={"rope_type": "linear", "factor": 2.0})
    assert repr(m) == (
        "QKNormRotary(\n"
        "  head_dim=8, eps=1e-06, weight_offset=0.0, norm='hidden', num_heads=2, num_kv_heads=1, base=500.0, "
        "scaling={'rope_type': 'linear', 'factor': 2.0}\n"
        "  (q_norm): _NormWeight(16)\n  (k_norm): _NormWeight(8)\n)")
    # The settings as the module took them: a later edit of the caller's objects is not shown.
    sections, scaling = [1, 1, 2], {"rope_type": "linear", "factor": 2.0}
    m = posenc.QKNormRotary(8, sections=sections, scaling=scaling)
    sections[0], scaling["factor"] = 7, 9.0
    assert "sections=[1, 1, 2]" in repr(m) and "'factor': 2.0" in repr(m)
