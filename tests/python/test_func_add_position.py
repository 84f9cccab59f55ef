"""torch.func transforms and forward-mode AD through add_position (buffer and learned tables,
dropout), its modules, sinusoidal_table at float positions and the differentiable helpers
(timestep_embedding, resample_position_table), against the same transforms of plain-PyTorch
float64 references. The derivatives are the ops' own C++ autograd kernels
(csrc/ops/add_position/autograd.cpp, csrc/ops/sinusoidal_table/autograd.cpp): one definition
for LibTorch autograd, torch.func and forward AD.

Dropout: every call draws a fresh mask, so the reference takes the mask of one call. Either
the function reseeds the CPU generator before each call (then every transform, gradcheck
included, sees the same mask), or one call gives the output and its tangent / pullback
(jvp, vjp, grad with has_aux) and the mask is read off that output. Under vmap every sample
draws its own mask (randomness="different"); see test_vmap_randomness_modes."""

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import functional_call, grad, jvp, vjp, vmap

import posenc
from posenc import functional as F
from conftest import reference_table
from func_transforms import check_transforms, gradcheck_all
from timestep_reference import diffusers_float32

F64 = torch.float64
B, S, D, L = 2, 3, 4, 7


def rows_of(table, positions, offset, batch_first, b=B, s=S):
    """table[rows] in x's layout: (B, S, D) or (S, B, D)."""
    t = table.reshape(table.shape[-2:])
    if positions is None:
        r = t[offset:offset + s].unsqueeze(0).expand(b, s, t.shape[-1])
    elif positions.dim() == 1:
        r = t[positions].unsqueeze(0).expand(b, s, t.shape[-1])
    else:
        r = t[positions]
    return r if batch_first else r.transpose(0, 1)


POSITIONS = {
    "offset": (None, 2),
    "positions_1d": (torch.tensor([6, 0, 3]), 0),
    "positions_2d": (torch.tensor([[0, 2, 2], [5, 1, 0]]), 0),
}


def x_of(batch_first, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((B, S, D) if batch_first else (S, B, D), dtype=F64, generator=g)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("where", list(POSITIONS))
def test_buffer_table_gradient_to_x(batch_first, where):
    positions, offset = POSITIONS[where]
    x = x_of(batch_first)
    table = torch.randn(L, D, dtype=F64)

    def f(x):
        return F.add_position(x, table, positions=positions, offset=offset, batch_first=batch_first)

    def ref(x):
        return x + rows_of(table, positions, offset, batch_first)

    check_transforms(f, ref, (x,))
    gradcheck_all(f, (x,))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("table_rank", [2, 3])
def test_learned_table_gradients_to_x_and_table(batch_first, where, table_rank):
    positions, offset = POSITIONS[where]
    x = x_of(batch_first)
    table = torch.randn((L, D) if table_rank == 2 else (1, L, D), dtype=F64)

    def f(x, table):
        return F.add_position(x, table, positions=positions, offset=offset, batch_first=batch_first)

    def ref(x, table):
        return x + rows_of(table, positions, offset, batch_first)

    check_transforms(f, ref, (x, table))
    gradcheck_all(f, (x, table))


def test_table_only_tangent_and_float32_table_with_float64_x():
    """Tangent of the table alone (x constant), and a table of another dtype than x."""
    x = x_of(True)
    table = torch.randn(L, D, dtype=torch.float32)
    t_table = torch.randn(L, D, dtype=torch.float32)
    positions, _ = POSITIONS["positions_2d"]
    out, out_t = jvp(lambda t: F.add_position(x, t, positions=positions), (table,), (t_table,))
    torch.testing.assert_close(out, x + table.double()[positions], rtol=0, atol=0)
    torch.testing.assert_close(out_t, t_table.double()[positions], rtol=0, atol=0)


@pytest.mark.parametrize("table_dtype", [torch.float16, torch.float32])
def test_a_wider_tangent_keeps_its_dtype(table_dtype):
    """float16 x: a float32 tangent of the table (or of x) is carried in float32, as torch's
    x + table carries it; the table's tangent alone was rounded to x's float16."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, L, D, generator=g).to(torch.float16)
    table = torch.randn(L, D, generator=g).to(table_dtype)
    tx, tt = torch.randn(x.shape, generator=g), torch.randn(table.shape, generator=g)
    for tangents in ((None, tt), (tx, tt.to(table_dtype)), (tx.half(), tt)):
        with forward_ad.dual_level():
            xd = forward_ad.make_dual(x, tangents[0]) if tangents[0] is not None else x
            out = F.add_position(xd, forward_ad.make_dual(table, tangents[1]))
            got = forward_ad.unpack_dual(out).tangent
        want = (0 if tangents[0] is None else tangents[0].double()) + tangents[1].double()
        assert out.dtype == torch.float16 and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want.expand_as(got), rtol=1e-6, atol=1e-6)


# ---- dropout: the mask of one call

P = 0.4


def seeded(fn, seed=7):
    """fn drawing the same mask at every call (the CPU generator reseeded first)."""
    def wrapped(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return wrapped


def mask_of(out):
    """keep / (1 - p) read off an output (random inputs: no kept element is exactly 0)."""
    return (out != 0).to(out.dtype) / (1 - P)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("where", ["offset", "positions_2d"])
def test_dropout_every_transform_with_the_mask_of_one_call(batch_first, where):
    positions, offset = POSITIONS[where]
    x = x_of(batch_first)
    table = torch.randn(L, D, dtype=F64)
    f = seeded(lambda x, table: F.add_position(x, table, positions=positions, offset=offset,
                                               batch_first=batch_first, p=P))
    mask = mask_of(f(x, table))
    assert 0 < (mask == 0).sum() < mask.numel()

    def ref(x, table):
        return (x + rows_of(table, positions, offset, batch_first)) * mask

    # No vmap here: under vmap each sample draws its own mask (tested below). jacfwd's vmap of
    # the forward and gradcheck's batched checks: randomness "error" refuses the draw, as it
    # refuses torch's dropout's; jacfwd with "same" keeps the one call's mask.
    check_transforms(f, ref, (x, table), batched=False, randomness="same")
    gradcheck_all(f, (x, table), batched=False)


def test_dropout_jvp_vjp_forward_ad_share_the_primal_mask():
    """One unseeded call each: the tangent and the gradients use the output's own mask."""
    positions, _ = POSITIONS["positions_2d"]
    x, table = x_of(True), torch.randn(L, D, dtype=F64)
    tx, tt = torch.randn_like(x), torch.randn_like(table)

    def f(x, table):
        return F.add_position(x, table, positions=positions, p=P)

    out, out_t = jvp(f, (x, table), (tx, tt))
    torch.testing.assert_close(out, (x + table[positions]) * mask_of(out))
    torch.testing.assert_close(out_t, (tx + tt[positions]) * mask_of(out))

    out, out_t = jvp(lambda x: f(x, table), (x,), (tx,))  # x's tangent alone
    torch.testing.assert_close(out_t, tx * mask_of(out))

    w = torch.randn_like(x)
    out, pullback = vjp(f, x, table)
    gx, gt = pullback(w)
    torch.testing.assert_close(gx, w * mask_of(out))
    torch.testing.assert_close(gt, torch.zeros_like(table).index_put((positions,), w * mask_of(out), accumulate=True))

    # forward AD alone (no graph recorded): the CPU mask is still kept for the tangent.
    for tangents in ((tx, None), (None, tt), (tx, tt)):
        with forward_ad.dual_level():
            xd = forward_ad.make_dual(x, tangents[0]) if tangents[0] is not None else x
            td = forward_ad.make_dual(table, tangents[1]) if tangents[1] is not None else table
            primal, tangent = forward_ad.unpack_dual(f(xd, td))
        expected = (tangents[0] if tangents[0] is not None else 0) + (
            tangents[1][positions] if tangents[1] is not None else 0)
        torch.testing.assert_close(tangent, expected * mask_of(primal))


def test_dropout_vmap_per_sample_gradients_and_jvp():
    """vmap(grad) and vmap(jvp) with dropout: each sample's own mask, read off its output."""
    positions, _ = POSITIONS["positions_2d"]
    xs = torch.randn(4, B, S, D, dtype=F64)
    table = torch.randn(L, D, dtype=F64)
    w = torch.randn(B, S, D, dtype=F64)

    def loss(table, x):
        out = F.add_position(x, table, positions=positions, p=P)
        return (out * w).sum(), out

    (gt, gx), outs = vmap(grad(loss, argnums=(0, 1), has_aux=True), in_dims=(None, 0), randomness="different")(table, xs)
    masks = mask_of(outs)
    torch.testing.assert_close(gx, w * masks)
    for i in range(xs.shape[0]):
        torch.testing.assert_close(gt[i], torch.zeros_like(table).index_put((positions,), w * masks[i], accumulate=True))

    tx = torch.randn(B, S, D, dtype=F64)
    outs, tangents = vmap(lambda x: jvp(lambda x: F.add_position(x, table, positions=positions, p=P), (x,), (tx,)),
                          randomness="different")(xs)
    torch.testing.assert_close(tangents, tx * mask_of(outs))


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_dropout_vmap_grad_uses_the_backward_batching_rule(randomness, no_vmap_fallback):
    """vmap(grad) with dropout reaches add_position_backward batched: its batching rule (one
    call per sample, each with its own rng state or the shared one) gives each sample its own
    mask's gradient, not torch's per-sample fallback (which warned users to file an issue on
    PyTorch for a posenc op; the fixture makes it an error)."""
    xs = torch.randn(3, B, S, D, dtype=F64)
    table = torch.randn(L, D, dtype=F64)

    def loss(x):
        out = F.add_position(x, table, p=P)
        return out.square().sum(), out

    gx, outs = vmap(grad(loss, has_aux=True), randomness=randomness)(xs)
    torch.testing.assert_close(gx, 2 * outs * mask_of(outs))
    if randomness == "same":
        assert torch.equal(outs != 0, (outs[:1] != 0).expand_as(outs))


@pytest.mark.parametrize("randomness", ["error", "same"])
def test_vmap_randomness_modes(randomness):
    xs = torch.randn(3, B, S, D, dtype=F64)
    table = torch.randn(L, D, dtype=F64)
    fn = vmap(lambda x: F.add_position(x, table, p=P), randomness=randomness)
    if randomness == "error":
        with pytest.raises(RuntimeError, match="randomness"):
            fn(xs)
    else:
        keep = fn(xs) != 0
        assert torch.equal(keep, keep[:1].expand_as(keep))


@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_vmap_randomness_where_no_input_is_batched(randomness):
    """Monte-Carlo dropout of one input, and per-sample gradients of a model whose dropout input
    is unbatched: torch calls an op's batching rule only where an input is batched at the vmap
    level, and the dropout drew one mask for every sample under "different" and did not raise
    under "error" (a torch.func audit). The contract holds as for torch's own dropout; the values
    kept are x + table exactly."""
    x = torch.randn(B, S, D, dtype=F64)
    table = torch.randn(L, D, dtype=F64)
    module = posenc.PositionalEncoding(D, dropout=P, max_len=L, dtype=F64)  # in training mode, as built
    idx = torch.arange(6)
    calls = {"add_position": lambda i: F.add_position(x, table, p=P), "module": lambda i: module(x),
             "per-sample grad": lambda d: grad(lambda x, d: (F.add_position(x, table, p=P) * d).sum())(x, d)}
    for name, call in calls.items():
        fn = vmap(call, randomness=randomness)
        arg = torch.randn(6, B, S, D, dtype=F64) if name == "per-sample grad" else idx
        if randomness == "error":
            with pytest.raises(RuntimeError, match="vmap: called random operation while in randomness error mode"):
                fn(arg)
            continue
        torch.manual_seed(5)
        out = fn(arg)
        after = torch.get_rng_state()
        keep = out != 0
        masks = {tuple(k.flatten().tolist()) for k in keep}
        if randomness == "same" and name == "add_position":  # the one call's mask, its one draw
            torch.manual_seed(5)
            assert torch.equal(out[0], F.add_position(x, table, p=P)) and torch.equal(torch.get_rng_state(), after)
        assert len(masks) == (1 if randomness == "same" else 6), name
        if name != "per-sample grad":
            base = x + (table[:S] if name == "add_position" else module.pe[0, :S])
            assert torch.equal(out[keep], (base / (1 - P)).expand_as(out)[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_vmap_same_randomness_draws_once_and_never_rewinds_the_generator(dtype, monkeypatch):
    """randomness="same": every sample gets the first sample's mask, bit for bit what the op
    gives each sample from the same generator state, and the generator advances as for one
    call. It used to restore the process's generator state before each sample, which under
    other threads' draws repeated ~30% of their random numbers and gave samples different
    masks (a review's threaded run); now the generator is never set."""
    ops = torch.ops.posenc
    xs = torch.randn(4, B, S, D).to(dtype)
    table = torch.randn(L, D)
    start = torch.get_rng_state()
    want = []
    for x in xs:
        torch.set_rng_state(start)
        want.append(ops.add_position(x, table, None, 2, True, P))
    after_one = torch.get_rng_state()
    torch.set_rng_state(start)
    calls = []
    monkeypatch.setattr(torch, "set_rng_state", lambda *a: calls.append(a))
    got = vmap(lambda x: F.add_position(x, table, offset=2, p=P), randomness="same")(xs)
    assert not calls
    assert torch.equal(got, torch.stack(want))
    assert torch.equal(torch.get_rng_state(), after_one)
    out, rng = vmap(lambda x: ops.add_position_forward(x, table, None, 2, True, P, False), randomness="same")(xs)
    keep = out != 0
    assert torch.equal(keep, keep[:1].expand_as(keep)) and torch.equal(rng, rng[:1].expand_as(rng))


# ---- the modules, as a user has them (training mode)

@pytest.mark.parametrize("batch_first", [True, False])
def test_vmap_over_per_sample_tensor_offsets(batch_first):
    """A 0-dim offset batched by vmap (one decode offset per sample) is added as rows on the
    device: the op's int offset cannot read a batched value (it raised the dispatcher's
    RuntimeError). Gradients to x and the table follow the same rows."""
    table = torch.randn(L, D, dtype=F64)
    xs = torch.stack([x_of(batch_first, seed=i) for i in range(3)])
    offsets = torch.tensor([0, 4, 2])
    got = vmap(lambda x, o: F.add_position(x, table, offset=o, batch_first=batch_first))(xs, offsets)
    for i in range(3):
        assert torch.equal(got[i], xs[i] + rows_of(table, None, int(offsets[i]), batch_first))
    g = vmap(grad(lambda t, x, o: F.add_position(x, t, offset=o, batch_first=batch_first).square().sum()),
             in_dims=(None, 0, 0))(table, xs, offsets)
    for i in range(3):
        want = grad(lambda t, i=i: (xs[i] + rows_of(t, None, int(offsets[i]), batch_first)).square().sum())(table)
        torch.testing.assert_close(g[i], want, rtol=1e-12, atol=1e-12)
    # offset 5 + 3 rows > 7
    with pytest.raises(IndexError, match=r"expected positions in \[0, max_len=7\), found 7 at flat index 2"):
        vmap(lambda x, o: F.add_position(x, table, offset=o, batch_first=batch_first))(xs, torch.tensor([0, 5, 2]))


def test_positional_encoding_grad_in_training_mode():
    torch.manual_seed(0)
    m = posenc.PositionalEncoding(8, dropout=0.1, max_len=16)  # training mode, no .eval()
    x = torch.randn(2, 5, 8)
    g = torch.func.grad(lambda x: m(x).sum())(x)
    assert g.shape == x.shape and set(g.unique().tolist()) <= {0.0, torch.tensor(1 / 0.9).item()}
    g, out = torch.func.grad(lambda x: (lambda o: (o.sum(), o))(m(x)), has_aux=True)(x)
    torch.testing.assert_close(g, (out != 0).float() / 0.9)
    torch.testing.assert_close(out, (x + m.pe[:, :5]) * (out != 0) / 0.9)
    # per-sample gradients (Opacus-style): one mask per sample
    xs = torch.randn(3, 2, 5, 8)
    gs, outs = vmap(grad(lambda x: (lambda o: ((o * x).sum(), o))(m(x)), has_aux=True), randomness="different")(xs)
    keep = (outs != 0).float() / 0.9
    torch.testing.assert_close(gs, keep * (xs + m.pe[:, :5]) + keep * xs)
    m.eval()
    torch.testing.assert_close(torch.func.grad(lambda x: m(x).sum())(x), torch.ones_like(x))
    out, out_t = jvp(m, (x,), (torch.ones_like(x),))
    torch.testing.assert_close(out_t, torch.ones_like(x))


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("batch_first", [True, False])
def test_learned_positional_encoding_functional_call_grad(dropout, batch_first):
    torch.manual_seed(1)
    m = posenc.LearnedPositionalEncoding(D, dropout=dropout, max_len=L, batch_first=batch_first).double()
    params = {k: v.detach() for k, v in m.named_parameters()}
    assert list(params) == ["pe"]
    x = x_of(batch_first)
    w = torch.randn_like(x)

    def loss(params, x, offset):
        out = functional_call(m, params, (x, offset))
        return (out * w).square().sum(), out

    for offset in (0, 3):
        g, out = grad(loss, has_aux=True)(params, x, offset)
        mask = (out != 0).to(out.dtype) / (1 - dropout)
        pe = params["pe"].requires_grad_(True)
        ref = ((x + rows_of(pe, None, offset, batch_first)) * mask * w).square().sum()
        torch.testing.assert_close(out, (x + rows_of(pe, None, offset, batch_first)) * mask)
        torch.testing.assert_close(g["pe"], torch.autograd.grad(ref, pe)[0])
        params["pe"] = pe.detach()
    # per-sample gradients of the parameters (eval: no dropout)
    m.eval()
    xs = torch.randn(3, *x.shape, dtype=F64)
    per_sample = vmap(grad(lambda p, x: loss(p, x, 1)[0]), in_dims=(None, 0))(params, xs)["pe"]
    pe = params["pe"]
    for i in range(3):
        pe_i = pe.clone().requires_grad_(True)
        ref = ((xs[i] + rows_of(pe_i, None, 1, batch_first)) * w).square().sum()
        torch.testing.assert_close(per_sample[i], torch.autograd.grad(ref, pe_i)[0])


# ---- the table ops and helpers

@pytest.mark.parametrize("d,base", [(6, 10000.0), (5, 100.0)])
def test_sinusoidal_table_float_positions(d, base):
    pos = torch.rand(4, 3, dtype=F64) * 50

    def f(q):
        return F.sinusoidal_table(q, d, base=base, dtype=F64)

    def ref(q):
        return reference_table(q, d, base)

    check_transforms(f, ref, (pos,))
    gradcheck_all(f, (pos,))
    # float32 positions: the gradient comes back in their dtype
    p32 = pos.float()
    g = grad(lambda q: F.sinusoidal_table(q, d, base=base, dtype=F64).sum())(p32)
    assert g.dtype == torch.float32


@pytest.mark.parametrize("kwargs", [dict(), dict(flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=2.0)])
@pytest.mark.parametrize("dim", [8, 7])
def test_timestep_embedding(kwargs, dim):
    """Computed in float32 as diffusers does: the reference is diffusers' float32 formula, so
    the transforms agree to the last bit, whatever the float64 inputs."""
    t = torch.rand(5, dtype=F64) * 100

    def f(t):
        return F.timestep_embedding(t, dim, **kwargs)

    def ref(t):
        return diffusers_float32(t, dim, **kwargs)

    check_transforms(f, ref, (t,))


def test_timestep_embedding_has_a_batching_rule(no_vmap_fallback):
    """vmap of timestep_embedding is one pass on every sample's timesteps (its composite
    batched; the same bits as a loop), not PyTorch's per-sample fallback (which printed that the
    op has no batching rule; the fixture makes it an error)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten.sin.default  # once in the op's (composite) body
            return func(*args, **(kwargs or {}))

    t = torch.rand(3, 5) * 100
    for in_dim in (0, 1):
        with Calls() as calls:
            out = vmap(lambda x: F.timestep_embedding(x, 7, flip_sin_to_cos=True), in_dims=in_dim)(t)
        assert calls.n == 1
        loop = [F.timestep_embedding(t.select(in_dim, i), 7, flip_sin_to_cos=True) for i in range(t.shape[in_dim])]
        assert torch.equal(out, torch.stack(loop))


@pytest.mark.parametrize("mode,antialias", [("bicubic", True), ("bicubic", False), ("bilinear", True),
                                            ("nearest", False)])
def test_resample_position_table(mode, antialias):
    prefix, d = 1, 3
    pe = torch.randn(1, prefix + 16, d, dtype=F64)

    def f(pe):
        return F.resample_position_table(pe, (3, 5), mode=mode, antialias=antialias, num_prefix_tokens=prefix)

    def ref(pe):  # timm's resample_abs_pos_embed: float32 F.interpolate, cast back
        img = pe[:, prefix:].float().reshape(1, 4, 4, d).permute(0, 3, 1, 2)
        kw = dict(antialias=antialias, align_corners=False) if mode != "nearest" else {}
        out = torch.nn.functional.interpolate(img, size=(3, 5), mode=mode, **kw)
        return torch.cat([pe[:, :prefix], out.permute(0, 2, 3, 1).reshape(1, -1, d).to(pe.dtype)], 1)

    check_transforms(f, ref, (pe,))


def test_resample_position_table_vmap_is_the_batched_composite(no_vmap_fallback):
    """vmap of resample_position_table runs its composite on the batched tensor (ATen's
    batching rules), not one call per sample through functorch's fallback (which printed
    "There is a performance drop": the fixture makes it an error); the bits of a loop."""
    pes = torch.randn(4, 1, 1 + 16, 3)
    for in_dim, mode in ((0, "bicubic"), (2, "bilinear"), (3, "nearest")):
        batched = pes.movedim(0, in_dim)
        out = vmap(lambda p, mode=mode: F.resample_position_table(p, (3, 5), mode=mode), in_dims=in_dim)(batched)
        assert torch.equal(out, torch.stack([F.resample_position_table(p, (3, 5), mode=mode) for p in pes]))
    g = vmap(grad(lambda p: F.resample_position_table(p, (2, 3)).square().sum()))(pes)
    for i in range(4):
        p = pes[i].clone().requires_grad_()
        F.resample_position_table(p, (2, 3)).square().sum().backward()
        torch.testing.assert_close(g[i], p.grad, rtol=1e-6, atol=1e-6)


def test_make_positions_vmap_is_the_batched_composite(no_vmap_fallback):
    """vmap of make_positions: its composite on the batched tokens, not functorch's per-sample
    fallback (the fixture makes that an error); the values of a loop, over either dim."""
    tokens = torch.randint(0, 4, (3, 2, 6))
    for in_dim in (0, 2):
        out = vmap(lambda t: F.make_positions(t, 1, offset=2), in_dims=in_dim)(tokens.movedim(0, in_dim))
        assert torch.equal(out, torch.stack([F.make_positions(t, 1, offset=2) for t in tokens]))


# ---- torch.compile of a transform

def test_compile_vmap_grad_learned_table_fullgraph():
    positions, _ = POSITIONS["positions_2d"]
    table = torch.randn(L, D)
    xs = torch.randn(3, B, S, D)

    def loss(table, x, positions, offset):
        return (F.add_position(x, table, positions=positions, offset=offset) ** 2).sum()

    def ref(table, x, positions, offset):
        return ((x + rows_of(table, positions, offset, True)) ** 2).sum()

    torch._dynamo.reset()
    # The C++ autograd is not part of the compile caches' keys: compile afresh.
    with torch._inductor.config.patch(force_disable_caches=True):
        for pos, offset in ((positions, 0), (None, 2)):
            f = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, 0, None, None))
            compiled = torch.compile(f, fullgraph=True)
            got = compiled(table, xs, pos, offset)
            expected = vmap(grad(ref, argnums=(0, 1)), in_dims=(None, 0, None, None))(table, xs, pos, offset)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_vmap_over_no_sample(randomness):
    """vmap over a batch of size 0 (forward, vmap(grad), with and without dropout): outputs
    with a leading 0 of the per-sample shapes, and no random number drawn (the rules stacked
    an empty list: "stack expects a non-empty TensorList")."""
    xs = torch.empty(0, B, S, D, dtype=F64)
    table = torch.randn(L, D, dtype=F64)
    state = torch.get_rng_state()
    for p in (0.0, P):
        out = vmap(lambda x, p=p: F.add_position(x, table, p=p), randomness=randomness)(xs)
        assert out.shape == (0, B, S, D) and out.dtype == F64
        g = vmap(grad(lambda x, p=p: F.add_position(x, table, p=p).sum()), randomness=randomness)(xs)
        assert g.shape == (0, B, S, D)
    assert torch.equal(torch.get_rng_state(), state)
