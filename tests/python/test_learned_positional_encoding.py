"""LearnedPositionalEncoding and the vision/fairseq helpers, against references written out here."""
import contextlib
import functools
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posenc
from posenc.functional import make_positions, resample_position_table, sinusoidal_2d_table
from conftest import DEVICES, DTYPES, reference_add
from dropout_reference import dropout_scale, expected_masked, keep_mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_forward_equals_reference(device, dtype, batch_first):
    m = posenc.LearnedPositionalEncoding(24, 0.1, 40, batch_first=batch_first).to(device).eval()
    x = torch.randn(3, 9, 24, device=device).to(dtype)
    with torch.no_grad():
        assert torch.equal(m(x), reference_add(x, m.pe, batch_first=batch_first))
        assert torch.equal(m(x, offset=7), reference_add(x, m.pe, offset=7, batch_first=batch_first))


def test_parameter_init_and_state_dict():
    torch.manual_seed(0)
    m = posenc.LearnedPositionalEncoding(64, 0.1, 500, init_std=0.02)
    assert isinstance(m.pe, torch.nn.Parameter) and m.pe.shape == (1, 500, 64)
    assert list(m.state_dict()) == ["pe"] and [n for n, _ in m.named_parameters()] == ["pe"]
    assert m.pe.abs().max().item() <= 0.04 + 1e-7  # truncated at 2 std
    assert abs(m.pe.std().item() - 0.02 * 0.8796) < 1e-3  # std of a normal truncated at +-2 sigma


def test_bert_style_embedding_reference_and_load_table():
    # BERT: embeddings = x + position_embeddings(arange(S)) with an nn.Embedding table.
    emb = torch.nn.Embedding(30, 16)
    m = posenc.LearnedPositionalEncoding(16, 0.0, 30).eval()
    m.load_table(emb.weight)
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        assert torch.equal(m(x), x + emb(torch.arange(11)))
        pos = torch.randint(0, 30, (2, 11))
        assert torch.equal(m(x, positions=pos), x + emb(pos))
    with pytest.raises(ValueError, match=r"expected a table of shape \(30, 16\) or \(1, 30, 16\), got \(31, 16\)"):
        m.load_table(torch.randn(31, 16))
    with pytest.raises(TypeError, match="load_table: expected table to be a Tensor, got list"):
        m.load_table([[1.0] * 16] * 30)


def test_a_replaced_table_is_the_one_load_table_and_repr_describe():
    """max_len and the width follow pe (forward does): load_table's message named the
    constructor's d_model after pe was replaced by a wider one."""
    m = posenc.LearnedPositionalEncoding(8, 0.0, 16)
    m.pe = torch.nn.Parameter(torch.randn(1, 20, 12))
    assert m.max_len == 20 and "d_model=12, max_len=20" in repr(m)
    assert m(torch.randn(1, 3, 12)).shape == (1, 3, 12)
    with pytest.raises(ValueError, match=r"expected a table of shape \(20, 12\) or \(1, 20, 12\), got \(3, 3\)"):
        m.load_table(torch.randn(3, 3))


def test_vit_pos_embed_loads_directly():
    pos_embed = torch.randn(1, 65, 48)  # CIFAR-10 ViT: 64 patches + class token
    m = posenc.LearnedPositionalEncoding(48, 0.1, max_len=65)
    m.load_state_dict({"pe": pos_embed}, strict=True)
    assert torch.equal(m.pe.detach(), pos_embed)
    with pytest.raises(RuntimeError, match="size mismatch"):
        m.load_state_dict({"pe": torch.randn(1, 64, 48)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("positions", [None, "1d_repeated", "2d"])
def test_gradcheck_x_and_pe(device, positions):
    m = posenc.LearnedPositionalEncoding(5, 0.3, 10).double().to(device).train()
    x = torch.randn(3, 4, 5, dtype=torch.float64, device=device, requires_grad=True)
    pos = {"1d_repeated": torch.tensor([2, 2, 9, 2], device=device),
           "2d": torch.randint(0, 10, (3, 4), device=device), None: None}[positions]

    def fn(a, table):
        torch.manual_seed(5)
        return posenc.functional.add_position(a, table, positions=pos, p=0.3)

    assert torch.autograd.gradcheck(fn, (x, m.pe))


@pytest.mark.parametrize("device", DEVICES)
def test_table_gradient_is_batch_sum_and_bitwise_deterministic(device):
    m = posenc.LearnedPositionalEncoding(32, 0.0, 64).to(device)
    x = torch.randn(8, 50, 32, device=device, requires_grad=True)
    pos = torch.randint(0, 64, (8, 50), device=device)
    g = torch.randn(8, 50, 32, device=device)
    grads = []
    for _ in range(3):
        m.pe.grad = None
        m(x, positions=pos).backward(g)
        grads.append(m.pe.grad.clone())
    assert all(torch.equal(grads[0], other) for other in grads[1:])
    want = torch.zeros(64, 32, dtype=torch.float64, device=device).index_add_(
        0, pos.reshape(-1), g.reshape(-1, 32).double())
    torch.testing.assert_close(grads[0][0].double(), want, atol=1e-5, rtol=1e-5)


def make_pos(kind, B, S, L, device, low=0):
    """None, (S,), (1, S) or (batch, S) positions drawn in [low, L) on the CPU, moved to device."""
    if kind is None:
        return None
    shape = {"1d": (S,), "shared": (1, S), "2d": (B, S)}[kind]
    return torch.randint(low, L, shape).to(device)


def rows_used(pos, offset, B, S):
    """The table row read at each (b, s), as a CPU (B, S) tensor."""
    if pos is None:
        return (torch.arange(S) + offset).expand(B, S)
    return pos.cpu().expand(B, S)


def table_grad_reference(grad_rows, idx, L):
    """float64 table gradient: row idx[b, s] receives grad_rows[b, s], summed (index_add)."""
    d = grad_rows.shape[-1]
    return torch.zeros(L, d, dtype=torch.float64).index_add_(
        0, idx.reshape(-1), grad_rows.detach().cpu().double().reshape(-1, d))


def dropout_masked_grad(y, g, p):
    """The x gradient of dropout(x + pe) from the forward's zeros: g * 1/(1-p) where kept."""
    scale = dropout_scale(p)
    kept = y.detach() != 0
    return torch.where(kept, g * scale, torch.zeros_like(g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("positions", [None, "1d", "shared", "2d"])  # three CUDA code paths ((1, S) takes (S,)'s)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_deterministic_mode_does_not_complain(device, positions, p):
    torch.manual_seed(0)
    B, S, d, L = 4, 10, 16, 32
    m = posenc.LearnedPositionalEncoding(d, p, L).to(device).train()
    x = torch.randn(B, S, d, device=device, requires_grad=True)
    pos = make_pos(positions, B, S, 6, device)  # few rows: many repeats
    offset = 5 if pos is None else 0
    g = torch.randn(B, S, d, device=device)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        y = m(x, offset=offset, positions=pos)
        y.backward(g)
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(prev)
    masked = dropout_masked_grad(y, g, p)
    if p > 0:
        frac = 1 - (y.detach() != 0).double().mean().item()
        assert 0.05 < frac < 0.4, frac  # dropout did happen (B*S*d = 640 draws at p = 0.2)
    assert torch.equal(x.grad, masked)
    want = table_grad_reference(masked, rows_used(pos, offset, B, S), L)
    assert m.pe.grad.shape == (1, L, d) and m.pe.grad.dtype == torch.float32
    torch.testing.assert_close(m.pe.grad[0].cpu().double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("positions", [None, "1d", "shared", "2d"])
def test_table_gradient_with_dropout_is_bitwise_repeatable(device, positions):
    """Same seed, same inputs: bitwise the same table gradient (no racing float atomics),
    with heavily repeated positions so that many terms land in each row."""
    torch.manual_seed(1)
    B, S, d, L = 16, 256, 64, 300
    m = posenc.LearnedPositionalEncoding(d, 0.3, L).to(device).train()
    x = torch.randn(B, S, d, device=device, requires_grad=True)
    pos = make_pos(positions, B, S, 8, device)
    offset = 17 if pos is None else 0
    g = torch.randn(B, S, d, device=device)
    runs = []
    for _ in range(3):
        m.pe.grad = None
        x.grad = None
        torch.manual_seed(21)
        y = m(x, offset=offset, positions=pos)
        y.backward(g)
        runs.append((y.detach(), x.grad.clone(), m.pe.grad.clone()))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    y, gx, gt = runs[0]
    masked = dropout_masked_grad(y, g, 0.3)
    assert torch.equal(gx, masked)
    want = table_grad_reference(masked, rows_used(pos, offset, B, S), L)
    torch.testing.assert_close(gt[0].cpu().double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("positions", [None, "1d", "shared", "2d"])
def test_mixed_precision_accumulates_table_gradient_in_float32(device, dtype, positions):
    """x in half precision, float32 table: the table gradient is float32 and summed in
    float32 (a half-precision sum of ~100 terms would be off by ~1e-2)."""
    torch.manual_seed(2)
    B, S, d, L = 64, 8, 16, 8
    m = posenc.LearnedPositionalEncoding(d, 0.0, L).to(device)
    x = torch.randn(B, S, d, device=device).to(dtype).requires_grad_(True)
    pos = make_pos(positions, B, S, 4, device)
    y = m(x, positions=pos)
    assert y.dtype == dtype
    g = torch.randn(B, S, d, device=device).to(dtype)
    y.backward(g)
    assert m.pe.grad.dtype == torch.float32 and x.grad.dtype == dtype
    assert torch.equal(x.grad, g)
    want = table_grad_reference(g, rows_used(pos, 0, B, S), L)
    torch.testing.assert_close(m.pe.grad[0].cpu().double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("positions", [None, "1d", "2d"])
def test_compile_fullgraph_forward_and_backward_equal_eager(device, positions):
    torch._dynamo.reset()
    torch.manual_seed(3)
    m = posenc.LearnedPositionalEncoding(16, 0.25, 32).to(device).train()
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(3, 12, 16, device=device)
    pos = make_pos(positions, 3, 12, 32, device)
    offset = 5 if pos is None else 0
    outs = []
    for module in (m, compiled):
        m.pe.grad = None
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(11)
        y = module(xi, offset=offset, positions=pos)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, m.pe.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # ...and eager itself is right: d/dx sum(y^2) = 2 y * mask-scale.
    y, gx, gt = outs[0]
    masked = dropout_masked_grad(y, 2 * y, 0.25)
    torch.testing.assert_close(gx, masked)
    want = table_grad_reference(masked, rows_used(pos, offset, 3, 12), 32)
    torch.testing.assert_close(gt[0].cpu().double(), want, atol=1e-5, rtol=1e-5)


def test_make_positions_matches_fairseq_formula():
    tokens = torch.tensor([[5, 6, 7, 1, 1], [1, 1, 8, 9, 4], [3, 1, 4, 1, 5]])
    mask = tokens.ne(1).int()
    want = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + 1
    assert torch.equal(make_positions(tokens, 1), want)
    with pytest.raises(TypeError, match="integer tokens of shape"):
        make_positions(torch.rand(2, 3), 1)


def test_make_positions_padding_idx_outside_the_tokens_dtype():
    """padding_idx is compared in int64: ne() converted it into the tokens' dtype, which
    wrapped (300 as uint8 is 44, 200 as int8 is -56), so tokens of that value were taken for
    padding."""
    want = torch.tensor([[301, 302, 303]])
    assert torch.equal(make_positions(torch.tensor([[44, 5, 44]], dtype=torch.uint8), 300), want)
    assert torch.equal(make_positions(torch.tensor([[-56, 5]], dtype=torch.int8), 200), torch.tensor([[201, 202]]))
    big = 2**32 + 1
    assert torch.equal(make_positions(torch.tensor([[1, 5]], dtype=torch.int32), big),
                       torch.tensor([[big + 1, big + 2]]))


def test_add_position_refuses_a_float_or_bool_tensor_offset():
    """The op's SymInt offset took a 0-d float tensor truncated (3.7 as 3) and True as 1."""
    x, table = torch.zeros(1, 2, 4), torch.arange(32.0).reshape(8, 4)
    for offset in (torch.tensor(3.7), torch.tensor(3.2, dtype=torch.bfloat16), torch.tensor(True),
                   torch.tensor([3.9])):
        with pytest.raises(TypeError, match="expected offset to be an int"):
            posenc.functional.add_position(x, table, offset=offset)
        with pytest.raises(TypeError, match="expected offset to be an int"):
            posenc.PositionalEncoding(4, 0.0, 8)(x, offset=offset)
    assert torch.equal(posenc.functional.add_position(x, table, offset=torch.tensor(3)), table[3:5].unsqueeze(0))


@pytest.mark.parametrize("padding_idx, offset", [(1, 0), (1, 7), (0, 3), (-100, 12)])
def test_make_positions_offset_is_transformers_past_key_values_length(padding_idx, offset):
    """transformers' create_position_ids_from_input_ids(input_ids, padding_idx,
    past_key_values_length), written out here: the offset numbers the non-padding tokens on
    from the cache's length; padding stays at padding_idx (adding the offset to the result
    would move it). Against the real one when transformers is installed."""
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 4, (3, 9), generator=g)
    tokens[tokens == 2] = padding_idx
    mask = tokens.ne(padding_idx).int()
    want = ((torch.cumsum(mask, dim=1).type_as(mask) + offset) * mask).long() + padding_idx
    got = make_positions(tokens, padding_idx, offset=offset)
    assert torch.equal(got, want) and got.dtype == torch.int64
    assert bool((got[tokens == padding_idx] == padding_idx).all())
    roberta = pytest.importorskip("transformers.models.roberta.modeling_roberta")
    hf = roberta.RobertaEmbeddings.create_position_ids_from_input_ids(tokens, padding_idx, offset)
    assert torch.equal(got, hf)


def mae_2d_sincos(embed_dim, grid_h, grid_w, cls_token=False, base=10000.0):
    """MAE's get_2d_sincos_pos_embed, written out in numpy from its formulas (base 10000 there)."""
    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / base**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    grid = np.meshgrid(np.arange(grid_w, dtype=np.float32), np.arange(grid_h, dtype=np.float32))
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_h, grid_w])
    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)
    return emb


@pytest.mark.parametrize("h,w,dim,prefix", [(4, 4, 16, 1), (3, 5, 8, 0), (14, 14, 768, 1)])
def test_sinusoidal_2d_table_matches_mae(h, w, dim, prefix):
    got = sinusoidal_2d_table(h, w, dim, num_prefix_tokens=prefix, dtype=torch.float64)
    want = torch.from_numpy(mae_2d_sincos(dim, h, w, cls_token=bool(prefix)))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="multiple of 4"):
        sinusoidal_2d_table(4, 4, 10)


@pytest.mark.parametrize("h,w,dim,prefix", [(4, 4, 16, 1), (3, 5, 8, 0), (7, 2, 24, 1)])
def test_sinusoidal_2d_table_is_transformers_vit_mae_with_its_halves_swapped(h, w, dim, prefix):
    """transformers 5's ViT-MAE table (build_2d_sinusoidal_position_embedding, when installed)
    lays the row coordinate out first, MAE's original the column (docs/guide/sinusoidal.md
    says so): posenc's table with the two halves of its columns swapped, bit for bit."""
    vit_mae = pytest.importorskip("transformers.models.vit_mae.modeling_vit_mae")
    if not hasattr(vit_mae, "build_2d_sinusoidal_position_embedding"):
        pytest.skip("this transformers has no build_2d_sinusoidal_position_embedding")
    want = vit_mae.build_2d_sinusoidal_position_embedding(h, w, dim, cls_token=bool(prefix), dtype=torch.float64)
    got = sinusoidal_2d_table(h, w, dim, num_prefix_tokens=prefix, dtype=torch.float64)
    assert not torch.equal(got, want)  # the layouts differ ...
    assert torch.equal(torch.cat([got[:, dim // 2:], got[:, :dim // 2]], 1), want)  # ... by the halves' order


@pytest.mark.parametrize("model, prefix", [("vit", 1), ("deit", 2)])
def test_resample_is_transformers_interpolate_pos_encoding_without_antialias(model, prefix):
    """transformers' ViT / DeiT interpolate_pos_encoding resample by size, bicubic, without
    antialias (timm's default has it): resample_position_table(..., antialias=False) gives its
    bits, as docs/guide/learned.md says; the default differs (by up to ~0.9 on N(0, 1) rows)."""
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = {"vit": ("ViTConfig", "ViTModel"), "deit": ("DeiTConfig", "DeiTModel")}[model]
    config = getattr(transformers, config_cls)(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32)
    embeddings = getattr(transformers, model_cls)(config, add_pooling_layer=False).embeddings
    torch.manual_seed(3)
    with torch.no_grad():
        embeddings.position_embeddings.normal_()
    table = embeddings.position_embeddings.detach()
    for h, w in ((48, 48), (64, 40), (24, 24), (16, 40)):
        want = embeddings.interpolate_pos_encoding(torch.zeros(1, prefix + (h // 8) * (w // 8), 16), h, w).detach()
        got = resample_position_table(table, (h // 8, w // 8), num_prefix_tokens=prefix, antialias=False)
        assert torch.equal(got, want), (h, w)
    assert not torch.equal(resample_position_table(table, (6, 6), num_prefix_tokens=prefix),
                           embeddings.interpolate_pos_encoding(torch.zeros(1, prefix + 36, 16), 48, 48).detach())


@pytest.mark.parametrize("padding_idx", [1, -7])
def test_padding_idx_is_nn_embeddings(padding_idx):
    """padding_idx as nn.Embedding's (fairseq, RoBERTa, XLM-R): the row starts at zero and
    gets no gradient, over accumulated calls, eager, scripted and compiled; forward adds it as
    it is. Without it the row got the padding tokens' gradient (a fine-tune drifted)."""
    torch.manual_seed(10)
    d, max_len = 8, 7
    m = posenc.LearnedPositionalEncoding(d, 0.0, max_len=max_len, padding_idx=padding_idx)
    row = padding_idx % max_len
    assert m.padding_idx == row and f"padding_idx={row}" in repr(m) and list(m.state_dict()) == ["pe"]
    assert torch.equal(m.pe[0, row].detach(), torch.zeros(d))
    assert m.pe[0].detach().abs().sum(1).count_nonzero() == max_len - 1
    tokens = torch.tensor([[5, 6, 7, 1, 1], [1, 1, 8, 9, 4]])
    pos = make_positions(tokens, 1) if row == 1 else torch.tensor([[0, 1, 2, 6, 6], [6, 3, 4, 5, 2]])
    with torch.no_grad():
        m.pe[0, row] = 0.5  # a loaded or edited row is added as it is
    embedding = torch.nn.Embedding(max_len, d, padding_idx=row)
    with torch.no_grad():
        embedding.weight.copy_(m.pe[0])
    for call in (m, torch.jit.script(m), torch.compile(m, backend="aot_eager", fullgraph=True)):
        m.pe.grad, embedding.weight.grad = None, None
        for _ in range(2):  # accumulated
            x, g = torch.randn(2, 5, d), torch.randn(2, 5, d)
            y = call(x, positions=pos)
            assert torch.equal(y, x + m.pe[0, pos].detach())
            y.backward(g)
            (x + embedding(pos)).backward(g)
        assert torch.equal(m.pe.grad[0, row], torch.zeros(d))
        torch.testing.assert_close(m.pe.grad[0], embedding.weight.grad, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.equal(m(x, positions=pos), x + m.pe[0, pos])
    for bad, error in ((7, ValueError), (-8, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="LearnedPositionalEncoding: expected padding_idx"):
            posenc.LearnedPositionalEncoding(d, 0.0, max_len=max_len, padding_idx=bad)
    assert posenc.LearnedPositionalEncoding(d, 0.0, max_len=max_len).padding_idx is None


def test_padding_idx_drops_the_rows_tangent_in_every_forward_mode():
    """The padding row's forward-mode tangent is dropped with its gradient whatever way the
    table is differentiated, so jacfwd and jacrev agree: it was dropped for a dual of a
    trainable table and kept under torch.func.jvp (whose table does not require grad)."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, jacfwd, jacrev, jvp

    torch.manual_seed(11)
    m = posenc.LearnedPositionalEncoding(4, 0.0, max_len=6, padding_idx=2).double()
    pos, x = torch.tensor([1, 2, 3]), torch.randn(1, 3, 4, dtype=torch.double)
    table, tangent = m.pe.detach().clone(), torch.randn_like(m.pe)

    def f(pe):
        return functional_call(m, {"pe": pe}, (x,), {"positions": pos})

    want = tangent[0, pos].clone().unsqueeze(0)
    want[:, 1] = 0  # position 2 is the padding row
    out, got = jvp(f, (table,), (tangent,))
    assert torch.equal(out, x + table[0, pos]) and torch.equal(got, want)
    for primal in (table, table.clone().requires_grad_()):  # a plain table and a trainable one
        with fwAD.dual_level():
            dual = fwAD.make_dual(primal, tangent)
            assert torch.equal(fwAD.unpack_dual(f(dual)).tangent, want)
    assert torch.equal(jacfwd(f)(table), jacrev(f)(table))
    assert torch.equal(jacrev(f)(table)[0, 1, :, 0, 2], torch.zeros(4, 4))
    # Compiled too (the shortcut for an untracked table kept the row's tangent there).
    compiled = torch.compile(lambda t, u: jvp(f, (t,), (u,))[1], backend="eager")
    assert torch.equal(compiled(table, tangent), want)


@pytest.mark.parametrize("train", [False, True])
def test_jit_trace_of_a_padding_idx_module_passes_its_check_and_freezes_the_row(train):
    """torch.jit.trace with its default check (which runs the module again under no_grad): a
    module with padding_idx traced its freeze in one run and not in the other, a
    TracingCheckError (found by an audit). The trace computes the module's numbers, and no
    gradient reaches the padding row."""
    torch.manual_seed(0)
    m = posenc.LearnedPositionalEncoding(16, 0.0, max_len=64, padding_idx=0).train(train)
    x = torch.randn(2, 10, 16)
    traced = torch.jit.trace(m, (x,))
    assert torch.equal(traced(x), m(x))
    traced(x).square().sum().backward()
    assert torch.equal(m.pe.grad[0, 0], torch.zeros(16)) and m.pe.grad[0, 1:10].abs().min() > 0


def timm_resample(posemb, new_size, old_size=None, num_prefix_tokens=1, interpolation="bicubic", antialias=True):
    """timm's resample_abs_pos_embed, written out from its documented behaviour."""
    if old_size is None:
        hw = int(math.sqrt(posemb.shape[1] - num_prefix_tokens))
        old_size = (hw, hw)
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim, dtype = posemb.shape[-1], posemb.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_size, mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, grid], dim=1)


@pytest.mark.parametrize("old,new,prefix,mode", [((8, 8), (12, 12), 1, "bicubic"), ((8, 8), (4, 6), 1, "bilinear"),
                                                 ((7, 5), (3, 9), 4, "bicubic"), ((6, 6), (9, 9), 0, "bicubic")])
def test_resample_position_table_matches_timm(old, new, prefix, mode):
    pe = torch.randn(1, prefix + old[0] * old[1], 32)
    got = resample_position_table(pe, new, old_grid=old if old[0] != old[1] else None,
                                  num_prefix_tokens=prefix, mode=mode)
    want = timm_resample(pe, new, old, prefix, mode)
    assert got.shape == (1, prefix + new[0] * new[1], 32)
    assert torch.equal(got, want)
    assert torch.equal(got[:, :prefix], pe[:, :prefix])


@pytest.mark.parametrize("old,new,prefix,mode,antialias,dtype", [
    ((8, 8), (12, 12), 1, "bicubic", True, torch.float32),
    ((16, 16), (5, 7), 1, "bilinear", True, torch.float32),  # downsampling: antialias matters
    ((16, 16), (5, 7), 1, "bicubic", False, torch.bfloat16),
    ((7, 5), (3, 9), 4, "bicubic", True, torch.float64),
    ((6, 6), (9, 9), 0, "bilinear", False, torch.float16),
    ((5, 5), (7, 3), 8, "nearest", False, torch.float32),
    ((6, 6), (6, 6), 1, "bicubic", True, torch.float32),  # equal grids: timm returns the table itself
])
def test_resample_position_table_matches_real_timm(old, new, prefix, mode, antialias, dtype):
    """The real timm resample_abs_pos_embed (timm when installed: ViTs' dynamic_img_size and
    checkpoint loading call it) gives the same bits, prefix rows included, in every dtype."""
    pos_embed = pytest.importorskip("timm.layers.pos_embed")
    pe = torch.randn(1, prefix + old[0] * old[1], 24, dtype=torch.float64).to(dtype)
    square = old[0] == old[1]
    want = pos_embed.resample_abs_pos_embed(pe, list(new), None if square else list(old), num_prefix_tokens=prefix,
                                            interpolation=mode, antialias=antialias)
    got = resample_position_table(pe, new, old_grid=None if square else old, num_prefix_tokens=prefix, mode=mode,
                                  antialias=antialias)
    assert got.dtype == dtype and got.shape == (1, prefix + new[0] * new[1], 24)
    assert torch.equal(got, want)
    assert got.data_ptr() != pe.data_ptr()  # posenc's result never aliases pe (timm's may)


def test_resample_rejects_mismatched_grid():
    with pytest.raises(ValueError, match=r"old_grid \(4, 5\) has 20 cells but the table has 16 patch rows"):
        resample_position_table(torch.randn(1, 17, 8), (6, 6), old_grid=(4, 5))
    with pytest.raises(ValueError, match="not a square grid"):
        resample_position_table(torch.randn(1, 19, 8), (6, 6))
    with pytest.raises(ValueError, match=r"pe of shape \(1, tokens, dim\)"):
        resample_position_table(torch.randn(17, 8), (6, 6))


def test_bad_input_learned():
    m = posenc.LearnedPositionalEncoding(8, 0.1, 16)
    with pytest.raises(IndexError, match=r"found -3"):
        m(torch.randn(2, 3, 8), positions=torch.tensor([0, -3, 1]))
    with pytest.raises(ValueError, match="init_std"):
        posenc.LearnedPositionalEncoding(8, 0.1, 16, init_std=-1.0)
    with pytest.raises(RuntimeError, match=r"table to have shape"):
        posenc.functional.add_position(torch.randn(2, 3, 8), torch.randn(2, 16, 8))


class TinyClassifier(torch.nn.Module):
    def __init__(self, encoding, vocab=6, d=32, seq=12):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.encoding = encoding
        self.layer = torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(d, 2)

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.encoding is not None:
            x = self.encoding(x)
        return self.head(self.layer(x).mean(dim=1))


def marker_batch(n, seq=12, gen=None):
    """Fillers 2..5 with markers 0 and 1 at two random places; label: does 0 come first?"""
    tokens = torch.randint(2, 6, (n, seq), generator=gen)
    order = torch.rand(n, seq, generator=gen).argsort(dim=1)[:, :2]
    tokens.scatter_(1, order[:, :1], 0)
    tokens.scatter_(1, order[:, 1:], 1)
    return tokens, (order[:, 0] < order[:, 1]).long()


def train_accuracy(encoding, steps=250):
    torch.manual_seed(0)
    model = TinyClassifier(encoding)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens, labels = marker_batch(64, gen=gen)
        loss = F.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    tokens, labels = marker_batch(2000, gen=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return (model(tokens).argmax(-1) == labels).double().mean().item()


def test_training_learns_order_only_with_the_encoding():
    with_pe = train_accuracy(posenc.LearnedPositionalEncoding(32, 0.1, 12))
    without = train_accuracy(None)
    assert with_pe > 0.9, with_pe
    assert abs(without - 0.5) < 0.06, without


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("positions", [None, "1d", "2d"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("d", [20, 32, 64, 13])  # 32, 64: the CUDA kernel's 16-byte vector path
def test_fused_backward_op_against_reference(device, batch_first, positions, p, d):
    B, S, L = 3, 7, 12
    grad = torch.randn((B, S, d) if batch_first else (S, B, d), device=device)
    rng = torch.tensor([987654321, 64], device=device)
    pos = {None: None, "1d": torch.randint(0, L, (S,), device=device),
           "2d": torch.randint(0, L, (B, S), device=device)}[positions]
    offset = 0 if pos is not None else 4
    op = torch.ops.posenc.add_position_backward_with_table
    gx, gt = op(grad, rng, pos, offset, batch_first, p, L, True)
    # The mask from the independent Philox (dropout_reference), not from posenc's own op.
    masked = expected_masked(grad.cpu(), keep_mask(987654321, 64, grad.shape, p), p).to(device) if p > 0 else grad
    assert torch.equal(gx, masked)
    rows = (masked if batch_first else masked.transpose(0, 1)).double()
    idx = (torch.arange(S, device=device) + offset).expand(B, S) if pos is None else pos.expand(B, S)
    want = torch.zeros(L, d, dtype=torch.float64, device=device).index_add_(0, idx.reshape(-1), rows.reshape(-1, d))
    assert gt.dtype == torch.float32 and gt.shape == (L, d)
    torch.testing.assert_close(gt.double(), want, atol=1e-5, rtol=1e-5)
    gx2, gt2 = op(grad, rng, pos, offset, batch_first, p, L, False)
    assert gx2.numel() == 0 and torch.equal(gt2, gt)
    torch.library.opcheck(op.default, (grad, rng, pos, offset, batch_first, p, L, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("positions", [None, "1d"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("misaligned", [False, True])
def test_fused_backward_op_vector_widths_and_alignment(device, dtype, positions, p, misaligned):
    """d % 8 == 0 reaches the CUDA kernel's 16-byte path when the gradient is aligned and its
    scalar path when it starts one element into its storage; both must give the same numbers."""
    B, S, d, L = 5, 9, 32, 16
    n = B * S * d
    base = torch.randn(n + 1, device=device).to(dtype)
    grad = (base[1:] if misaligned else base[:n]).view(B, S, d)
    assert (grad.data_ptr() % 16 != 0) == misaligned
    rng = torch.tensor([123456789, 4], device=device)
    pos = make_pos(positions, B, S, L, device)
    offset = 0 if pos is not None else 6
    op = torch.ops.posenc.add_position_backward_with_table
    gx, gt = op(grad, rng, pos, offset, True, p, L, True)
    masked = expected_masked(grad.cpu(), keep_mask(123456789, 4, grad.shape, p), p).to(device) if p > 0 else grad
    assert gx.dtype == dtype and torch.equal(gx, masked)
    # Reference from the mask alone: kept entries contribute g * 1/(1-p) (float32, unrounded).
    kept = masked != 0
    if p > 0:
        assert 0.15 < 1 - kept.double().mean().item() < 0.45
    scale = dropout_scale(p)
    rows = torch.where(kept, grad.float() * scale, torch.zeros((), device=device))
    want = table_grad_reference(rows, rows_used(pos, offset, B, S), L)
    assert gt.dtype == torch.float32 and gt.shape == (L, d)
    # Terms may be rounded to x's dtype before the float32 sum (composite path) or not: allow
    # exactly the summed rounding error of the terms, plus float32 summation slack.
    rounding = table_grad_reference((masked.double() - rows.double()).abs(), rows_used(pos, offset, B, S), L)
    err = (gt.cpu().double() - want).abs()
    assert (err <= rounding + 1e-5 + 1e-5 * want.abs()).all(), (err - rounding).max()
    gx2, gt2 = op(grad, rng, pos, offset, True, p, L, False)
    assert gx2.numel() == 0 and torch.equal(gt2, gt)


@pytest.mark.parametrize("positions", [None, "1d", "2d", "2d_distinct"])
@pytest.mark.parametrize("state", ["key", "saved_mask"])
def test_fused_backward_is_bitwise_independent_of_thread_count(positions, state):
    """The accumulator blocks depend on the thread count; the sums' order must not. (2d_distinct:
    Hugging Face's expanded position_ids, which take the path without positions.)"""
    grad = torch.randn(16, 300, 96)
    pos = {None: None, "1d": torch.randint(0, 40, (300,)), "2d": torch.randint(0, 40, (16, 300)),
           "2d_distinct": (torch.arange(300) + 50).expand(16, 300)}[positions]
    rng = torch.tensor([5, 6])
    if state == "saved_mask":
        rng = torch.ops.posenc.add_position_forward(grad, torch.randn(400, 96), pos, 0, True, 0.2, True)[1]
    op = torch.ops.posenc.add_position_backward_with_table
    table_len = 400
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(op(grad, rng, pos, 0, True, 0.2, table_len, True))
    finally:
        torch.set_num_threads(threads)
    for gx, gt in results[1:]:
        assert torch.equal(gx, results[0][0]) and torch.equal(gt, results[0][1])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("positions", [None, "1d", "2d"])
@pytest.mark.parametrize("backend", ["kernel", "composite"])
def test_fused_backward_table_dtype_is_the_sum_rounded_once(grad_dtype, table_dtype, positions, backend):
    """table_dtype (autograd passes the table's): the table gradient is the float32 (float64)
    sum the op returns without it, rounded once to table_dtype, bit for bit; rows that receive
    no gradient are zeros (the CPU kernel writes the others straight in grad's dtype). Odd
    sizes, both layouts, offsets at both ends of the table and in between, with and without
    dropout, empty batches."""
    op = torch.ops.posenc.add_position_backward_with_table.default
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    call = op if backend == "kernel" else functools.partial(op.redispatch, keys)
    L = 50
    for B, S, d, offset, batch_first, p in [(3, 37, 40, 5, True, 0.3), (2, 50, 13, 0, False, 0.0),
                                            (4, 9, 72, 41, True, 0.0), (0, 7, 16, 3, True, 0.3),
                                            (5, 1, 8, 49, False, 0.2)]:
        grad = torch.randn((B, S, d) if batch_first else (S, B, d)).to(grad_dtype)
        rng = torch.tensor([1234, 8])
        pos = make_pos(positions, B, S, L, "cpu")
        off = 0 if pos is not None else offset
        for need_x in (True, False):
            gx0, gt0 = call(grad, rng, pos, off, batch_first, p, L, need_x)
            gx, gt = call(grad, rng, pos, off, batch_first, p, L, need_x, table_dtype=table_dtype)
            assert gt.dtype == table_dtype and gt.shape == (L, d)
            assert torch.equal(gx, gx0) and torch.equal(gt, gt0.to(table_dtype)), (B, S, d, off, need_x)
            if pos is None:  # the rows outside offset .. offset + S - 1 get nothing
                assert not gt[:off].any() and not gt[off + S:].any()
        if pos is not None and B > 0:
            # Positions in a window of the table (the CPU kernel sums only the rows between the
            # smallest and the largest position, then converts them into a table zeroed elsewhere).
            for lo, hi in ((17, 29), (0, 3), (L - 4, L - 1), (11, 11)):
                win = torch.randint(lo, hi + 1, pos.shape)
                _, gt0 = call(grad, rng, win, 0, batch_first, p, L, False)
                _, gt = call(grad, rng, win, 0, batch_first, p, L, False, table_dtype=table_dtype)
                assert torch.equal(gt, gt0.to(table_dtype)), (lo, hi)
                assert not gt[:int(win.min())].any() and not gt[int(win.max()) + 1:].any()
    meta = torch.ones(2, 5, 8, device="meta", dtype=grad_dtype)
    _, gt_meta = op(meta, torch.empty(2, dtype=torch.long, device="meta"), None, 1, True, 0.0, 9, True,
                    table_dtype=table_dtype)
    assert gt_meta.dtype == table_dtype and gt_meta.shape == (9, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("saved_mask", [False, True])
def test_fused_backward_2d_positions_sum_in_row_order(dtype, batch_first, p, saved_mask):
    """(B, S) positions: each table row is the float32 sum of the gradient rows that read it,
    added in memory order (the kernel's walk), bit for bit. Rows that all hold the same strictly
    increasing positions (Hugging Face's expanded position_ids) take the kernel's (S,) path,
    which must keep those bits; rows with a duplicate or rows that differ must not take it
    (their sums would be added in another order). The dropout mask regenerated from its key
    or read from the bits the forward saved."""
    torch.manual_seed(11)
    op = torch.ops.posenc.add_position_backward_with_table.default
    B, S, d, L = 4, 23, 40, 64
    ar = torch.arange(S)
    cases = {
        "hf": (ar + 5).expand(B, S),
        "steps of 3": (3 * ar[:20]).expand(B, 20),
        "one token": torch.full((B, 1), 9),
        "one row": (ar + 2).unsqueeze(0),
        "duplicate": torch.cat([ar[:10], ar[9:S - 1]]).expand(B, S),
        "one row differs": torch.stack([ar + 1, ar + 1, ar, ar + 1]),
        "descending": (S - 1 - ar).expand(B, S),
        "random": torch.randint(0, L, (B, S)),
    }
    for name, pos in cases.items():
        b, s = pos.shape
        grad = torch.randn((b, s, d) if batch_first else (s, b, d)).to(dtype)
        rng = torch.tensor([4321, 12])
        keep = keep_mask(4321, 12, grad.shape, p) if p > 0 else torch.ones(grad.shape, dtype=torch.bool)
        if saved_mask and p > 0:  # the bits the forward saved (of dropout(grad + 0): kept where nonzero)
            out, rng = torch.ops.posenc.add_position_forward(grad, torch.zeros(L, d, dtype=dtype), pos, 0,
                                                             batch_first, p, True)
            keep = out != 0
            assert (grad != 0).all() and 0.15 < 1 - keep.double().mean().item() < 0.45
        gx, gt = op(grad, rng, pos, 0, batch_first, p, L, True)
        gt16 = op(grad, rng, pos, 0, batch_first, p, L, False, table_dtype=torch.bfloat16)[1]
        terms = torch.where(keep, grad.float() * dropout_scale(p), torch.zeros(()))
        want = torch.zeros(L, d)
        flat_pos = (pos if batch_first else pos.t()).reshape(-1)
        for r, row in enumerate(terms.reshape(-1, d)):  # memory order, float32 adds
            want[flat_pos[r]] += row
        assert torch.equal(gt, want), name
        assert torch.equal(gt16, want.to(torch.bfloat16)), name
        assert torch.equal(gx, terms.to(dtype)), name


def test_fused_backward_table_dtype_checks_and_opcheck():
    op = torch.ops.posenc.add_position_backward_with_table.default
    grad, rng = torch.randn(2, 6, 24, dtype=torch.bfloat16), torch.tensor([3, 4])
    for bad in (torch.int64, torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=r"table_dtype to be float32, float64, float16 or bfloat16, got"):
            op(grad, rng, None, 0, True, 0.1, 8, True, table_dtype=bad)
    for pos in (None, torch.randint(0, 8, (6,)), torch.randint(0, 8, (2, 6))):
        for table_dtype in (torch.bfloat16, torch.float32, torch.float16):
            torch.library.opcheck(op, (grad, rng, pos, 2 if pos is None else 0, True, 0.1, 8, True),
                                  {"table_dtype": table_dtype})


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("positions", [None, "1d", "2d"])
@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("need_x", [True, False])
def test_composite_backward_matches_the_cpu_kernel(batch_first, positions, p, need_x):
    """The composite implementation serves backends without a fused kernel (CUDA today);
    run it on the CPU through the dispatcher and compare with the CPU kernel."""
    B, S, d, L = 4, 6, 10, 9
    grad = torch.randn((B, S, d) if batch_first else (S, B, d))
    rng = torch.tensor([42, 7])
    pos = {None: None, "1d": torch.randint(0, L, (S,)), "2d": torch.randint(0, L, (B, S))}[positions]
    args = (grad, rng, pos, 0 if pos is not None else 2, batch_first, p, L, need_x)
    op = torch.ops.posenc.add_position_backward_with_table.default
    composite_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    gx_c, gt_c = op.redispatch(composite_keys, *args)
    gx, gt = op(*args)
    assert gx_c.shape == gx.shape and torch.equal(gx_c, gx)
    assert gt_c.dtype == gt.dtype and gt_c.shape == gt.shape
    torch.testing.assert_close(gt_c, gt, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["1d", "2d"])
def test_composite_backward_drops_out_of_range_positions(positions):
    """Unchecked CUDA positions may lie outside the table (the forward wrote NaN rows for
    them); the table gradient's scatter must neither device-assert nor wrap -1 to the last
    row: those rows add nothing. Run through the dispatcher on the CPU, whose own kernel
    would raise first."""
    B, S, d, L = 3, 5, 6, 8
    grad = torch.randn(B, S, d, dtype=torch.float64)
    pos = torch.tensor([0, -1, 7, 8, 3]) if positions == "1d" else torch.tensor(
        [[0, -1, 7, 8, 3], [12, 2, 2, -5, 7], [1, 1, 8, 0, 6]])
    op = torch.ops.posenc.add_position_backward_with_table.default
    composite_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    _, gt = op.redispatch(composite_keys, grad, torch.tensor([1, 2]), pos, 0, True, 0.0, L, False)
    want = torch.zeros(L, d, dtype=torch.float64)
    full = pos.expand(B, S)
    for b in range(B):
        for s in range(S):
            if 0 <= int(full[b, s]) < L:
                want[int(full[b, s])] += grad[b, s]
    assert gt.shape == (L, d)
    torch.testing.assert_close(gt, want, atol=1e-12, rtol=1e-12)


def test_export_learned_module_with_positions():
    m = posenc.LearnedPositionalEncoding(16, 0.1, 64).eval()
    x = torch.randn(2, 10, 16)
    pos = torch.randint(0, 64, (2, 10))
    ep = torch.export.export(m, (x, 0, pos))
    assert any("posenc.add_position" in str(n.target) for n in ep.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ep.module()(x, 0, pos), m(x, positions=pos))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("positions", [None, "1d", "shared", "2d"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_opcheck_add_position_with_trainable_table(device, positions, p):
    """opcheck with the table requiring grad (the fused table-gradient backward). With p > 0
    the op is tagged nondeterministic_seeded, so opcheck checks schema, fake tensors and the
    autograd registration without comparing masks, as in test_add_position_autograd_and_compile."""
    B, S, d, L = 2, 7, 8, 16
    x = torch.randn(B, S, d, device=device, requires_grad=True)
    table = torch.randn(1, L, d, device=device, requires_grad=True)
    pos = make_pos(positions, B, S, L, device)
    offset = 3 if pos is None else 0
    op = torch.ops.posenc.add_position.default
    torch.library.opcheck(op, (x, table, pos, offset, True, p))
    torch.library.opcheck(op, (x.detach(), table, pos, offset, True, p))  # only the table trains
    seq_first = x.detach().transpose(0, 1).contiguous().requires_grad_(True)
    flat_table = table.detach().squeeze(0).clone().requires_grad_(True)
    torch.library.opcheck(op, (seq_first, flat_table, pos, offset, False, p))
    half = x.detach().to(torch.bfloat16).requires_grad_(True)
    torch.library.opcheck(op, (half, table, pos, offset, True, p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["1d", "2d"])
@pytest.mark.parametrize("bad", [-1, 16, 1000])
def test_out_of_range_positions_raise_index_error_naming_max_len(device, shape, bad):
    """CPU: checked in the kernel; CUDA: checked on the host by the module (check_positions)."""
    m = posenc.LearnedPositionalEncoding(8, 0.1, 16).to(device)
    assert m.check_positions
    x = torch.randn(2, 5, 8, device=device, requires_grad=True)
    pos = torch.tensor([0, 3, bad, 15, 2])
    pos = (pos if shape == "1d" else torch.stack([torch.tensor([1, 1, 1, 1, 1]), pos])).to(device)
    with pytest.raises(IndexError, match=r"max_len=16"):
        m(x, positions=pos)
    with pytest.raises(IndexError, match=r"max_len=16"):
        m.eval()(x, positions=pos)
    # In range, the same call works: the error was about the bad value.
    ok = torch.where(pos == bad, torch.full_like(pos, 15), pos)
    with torch.no_grad():
        torch.testing.assert_close(m(x, positions=ok), reference_add(x, m.pe, positions=ok), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("positions", [None, "2d"])
def test_learned_dropout_zeroed_fraction_and_exact_survivors(device, p, dtype, positions):
    """As test_add_position_dropout's test for PositionalEncoding: survivors are exactly (x + pe[pos]) / (1-p)
    computed in the op's precision (float32, float64 for float64 x) and rounded once."""
    torch.manual_seed(4)
    m = posenc.LearnedPositionalEncoding(64, p, 512).to(device).train()
    with torch.no_grad():
        m.pe.normal_()  # a table of the size of x, so the addition matters
    x = torch.randn(8, 500, 64, device=device).to(dtype)
    pos = make_pos(positions, 8, 500, 512, device)
    offset = 0 if pos is not None else 7
    with torch.no_grad():
        y = m(x, offset=offset, positions=pos)
    assert y.dtype == dtype
    kept = y != 0
    n = y.numel()
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) <= 4 * math.sqrt(p * (1 - p) / n)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    summed = reference_add(x, m.pe.detach(), positions=pos, offset=offset, rounded=False)
    want = (summed * dropout_scale(p, acc)).to(dtype)
    assert torch.equal(y[kept], want[kept])
    # In eval mode nothing is dropped.
    with torch.no_grad():
        assert torch.equal(m.eval()(x, offset=offset, positions=pos),
                           reference_add(x, m.pe.detach(), positions=pos, offset=offset))


@pytest.mark.parametrize("old,new,prefix,mode,antialias,dtype", [
    ((12, 12), (6, 6), 1, "bicubic", False, torch.float32),   # downsampling: antialias matters
    ((8, 8), (5, 7), 1, "bilinear", False, torch.float32),
    ((8, 8), (12, 12), 1, "nearest", False, torch.float32),
    ((7, 5), (3, 9), 2, "nearest", False, torch.float32),
    ((8, 8), (12, 12), 1, "bicubic", True, torch.bfloat16),
    ((12, 12), (7, 5), 1, "bicubic", True, torch.bfloat16),
    ((6, 4), (9, 9), 0, "bilinear", True, torch.bfloat16),
])
def test_resample_position_table_matches_timm_more_modes(old, new, prefix, mode, antialias, dtype):
    torch.manual_seed(5)
    pe = torch.randn(1, prefix + old[0] * old[1], 32).to(dtype)
    got = resample_position_table(pe, new, old_grid=old, num_prefix_tokens=prefix, mode=mode,
                                  antialias=antialias)
    want = timm_resample(pe, new, old, prefix, mode, antialias=antialias)
    assert got.dtype == dtype and got.shape == (1, prefix + new[0] * new[1], 32)
    assert torch.equal(got, want)
    assert torch.equal(got[:, :prefix], pe[:, :prefix])
    if mode == "nearest":
        # antialias does not apply to nearest: the default (True) is ignored, not passed on.
        assert torch.equal(resample_position_table(pe, new, old_grid=old, num_prefix_tokens=prefix,
                                                   mode="nearest"), want)
        # Every output row is one of the input rows.
        rows = pe[0, prefix:]
        assert all((rows == r).all(dim=1).any() for r in got[0, prefix:])
    elif not antialias:
        # The case discriminates: with antialias the downsampled numbers differ.
        assert not torch.equal(got, timm_resample(pe, new, old, prefix, mode, antialias=True))


def test_resample_rejects_unknown_mode():
    with pytest.raises(ValueError, match=r"mode.*'bogus'"):
        resample_position_table(torch.randn(1, 17, 8), (6, 6), mode="bogus")


def test_resample_rejects_an_integer_table():
    # Interpolated in float32 and cast back, an integer table came back truncated (bicubic
    # values 4.7 as 4): a TypeError, as F.interpolate's for an integer input.
    pe = torch.arange(17 * 4).reshape(1, 17, 4)
    with pytest.raises(TypeError, match=r"pe to be a floating-point table, got torch.int64"):
        resample_position_table(pe, (3, 3))
    with pytest.raises(TypeError, match=r"got torch.bool"):
        resample_position_table(pe > 3, (4, 4))


def test_resample_non_square_grid_to_square_grid_of_equal_size_is_resampled():
    """A grid of the same cell count but another shape (8x2 -> 4x4, 16 cells both) is
    interpolated, not returned as is: the result is bicubic antialiased F.interpolate of the
    grid with the class token row kept (timm 1.0.31's resample_abs_pos_embed gives the same
    bits; not compared here). Equal grids (8x2 -> 8x2) are the identity."""
    torch.manual_seed(6)
    pe = torch.randn(1, 1 + 16, 8)
    got = resample_position_table(pe, (4, 4), old_grid=(8, 2))
    assert got.shape == pe.shape
    assert not torch.equal(got, pe)
    grid = pe[:, 1:].reshape(1, 8, 2, 8).permute(0, 3, 1, 2)
    image = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False, antialias=True)
    want = torch.cat([pe[:, :1], image.permute(0, 2, 3, 1).reshape(1, 16, 8)], dim=1)
    assert torch.equal(got, want)
    # Equal grids are the identity.
    assert torch.equal(resample_position_table(pe, (8, 2), old_grid=(8, 2)), pe)


def test_vit_workflow_class_token_then_resample_to_a_finer_grid():
    """CIFAR-10 ViT: class token + 8x8 patches of width 48, then fine-tuning on a 12x12 grid."""
    torch.manual_seed(7)
    m = posenc.LearnedPositionalEncoding(48, 0.0, max_len=65).train()
    with torch.no_grad():
        m.pe.normal_()
    x = torch.randn(4, 65, 48)
    assert torch.equal(m(x), x + m.pe)
    table = resample_position_table(m.pe.detach(), (12, 12), num_prefix_tokens=1)
    assert table.shape == (1, 145, 48)
    assert torch.equal(table, timm_resample(m.pe.detach(), (12, 12), (8, 8), 1))
    assert torch.equal(table[:, 0], m.pe.detach()[:, 0])  # class token row kept
    fine = posenc.LearnedPositionalEncoding(48, 0.1, max_len=145)
    fine.load_state_dict({"pe": table}, strict=True)
    fine.eval()
    x2 = torch.randn(4, 145, 48)
    with torch.no_grad():
        assert torch.equal(fine(x2), x2 + table)
    # The loaded table trains: its gradient is the batch sum.
    fine.dropout.p = 0.0
    fine.train()
    g = torch.randn(4, 145, 48)
    fine(x2).backward(g)
    torch.testing.assert_close(fine.pe.grad.double(), g.double().sum(0, keepdim=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,w,dim,prefix,base", [(4, 4, 16, 2, 100.0), (3, 5, 8, 3, 2.5), (2, 6, 12, 0, 1e6)])
def test_sinusoidal_2d_table_base_and_prefix_rows(h, w, dim, prefix, base):
    got = sinusoidal_2d_table(h, w, dim, base=base, num_prefix_tokens=prefix, dtype=torch.float64)
    assert got.shape == (prefix + h * w, dim)
    assert torch.equal(got[:prefix], torch.zeros(prefix, dim, dtype=torch.float64))
    want = torch.from_numpy(mae_2d_sincos(dim, h, w, base=base))
    torch.testing.assert_close(got[prefix:], want, atol=1e-12, rtol=0)
    # The base matters (unless the table is too small to show it).
    assert not torch.allclose(got[prefix:], torch.from_numpy(mae_2d_sincos(dim, h, w)), atol=1e-6)
    assert sinusoidal_2d_table(h, w, dim, base=base, num_prefix_tokens=prefix).dtype == torch.float32


@pytest.mark.parametrize("kwargs,name", [
    (dict(grid_h=0, grid_w=4, dim=8), "grid_h"), (dict(grid_h=-2, grid_w=4, dim=8), "grid_h"),
    (dict(grid_h=4, grid_w=0, dim=8), "grid_w"), (dict(grid_h=4, grid_w=-1, dim=8), "grid_w"),
    (dict(grid_h=4, grid_w=4, dim=8, num_prefix_tokens=-1), "num_prefix_tokens"),
])
def test_sinusoidal_2d_table_rejects_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sinusoidal_2d_table(**kwargs)


@pytest.mark.parametrize("init_std", [math.inf, -math.inf, math.nan])
def test_init_std_must_be_finite(init_std):
    with pytest.raises(ValueError, match="init_std"):
        posenc.LearnedPositionalEncoding(8, 0.1, 16, init_std=init_std)


def test_init_std_zero_gives_a_zero_table():
    m = posenc.LearnedPositionalEncoding(8, 0.1, 16, init_std=0.0)
    assert torch.equal(m.pe.detach(), torch.zeros(1, 16, 8))


def test_make_positions_feed_the_learned_module_with_padding():
    """fairseq-style learned positions: padding tokens read row padding_idx, the others
    padding_idx + 1, padding_idx + 2, ... (the table needs padding_idx + seq + 1 rows)."""
    torch.manual_seed(8)
    padding_idx = 1
    tokens = torch.tensor([[5, 6, 7, 1, 1], [1, 1, 8, 9, 4], [3, 1, 4, 1, 5]])
    pos = make_positions(tokens, padding_idx)
    assert (pos[tokens == padding_idx] == padding_idx).all()
    m = posenc.LearnedPositionalEncoding(8, 0.0, max_len=padding_idx + 5 + 1).train()
    with torch.no_grad():
        m.pe.normal_()
    x = torch.randn(3, 5, 8, requires_grad=True)
    y = m(x, positions=pos)
    want = x.detach().double() + m.pe.detach().double()[0, pos]
    torch.testing.assert_close(y.detach().double(), want, atol=1e-6, rtol=0)
    assert torch.equal(y.detach(), (x + m.pe[0, pos]).detach())
    g = torch.randn(3, 5, 8)
    y.backward(g)
    ref = table_grad_reference(g, pos, padding_idx + 6)
    torch.testing.assert_close(m.pe.grad[0].double(), ref, atol=1e-6, rtol=0)
    assert m.pe.grad[0, padding_idx].abs().sum() > 0  # the padding row got the padding tokens' gradient
    assert torch.equal(m.pe.grad[0, 0], torch.zeros(8))  # row 0 is never used


@pytest.mark.parametrize("call, message", [
    (lambda: sinusoidal_2d_table(2, 2, 8, base=0), "expected base to be a finite number > 1, got 0"),
    (lambda: sinusoidal_2d_table(2, 2, 8, base=1.0), "expected base to be a finite number > 1, got 1.0"),
    (lambda: sinusoidal_2d_table(2, 2, 8, base=float("nan")), "expected base to be a finite number > 1, got nan"),
    (lambda: make_positions(torch.ones(2, 3, dtype=torch.long), 2**63 - 1), r"padding_idx within \+-2\*\*62"),
    (lambda: make_positions(torch.ones(2, 3, dtype=torch.long), 1, offset=-1), r"offset in \[0, 2\*\*62\], got -1"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), (2, 3, 4)), r"new_grid to be \(h, w\) of ints"),
])
def test_helpers_refuse_values_they_would_silently_misuse(call, message):
    """NaN or base <= 1 gave NaN or identical columns, and a huge padding_idx wrapped around
    int64 (floats and bools: test_helpers_refuse_types_they_would_silently_misuse)."""
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("call, message", [
    (lambda: make_positions(torch.ones(2, 3, dtype=torch.long), 1.5), "expected padding_idx to be an int, got 1.5"),
    (lambda: make_positions(torch.ones(2, 3, dtype=torch.long), 1, offset=2.0), "expected offset to be an int, got 2.0"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), (2.7, 3.9)), r"new_grid to be \(h, w\) of ints, got \(2.7, 3.9\)"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), (True, True)), r"new_grid to be \(h, w\) of ints"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), 3, num_prefix_tokens=True), "num_prefix_tokens to be an int, got True"),
])
def test_helpers_refuse_types_they_would_silently_misuse(call, message):
    """Floats were truncated and bools taken as 1: a TypeError, as torch gives for an argument
    of the wrong type."""
    with pytest.raises(TypeError, match=message):
        call()


def test_helper_types_and_accepted_forms():
    with pytest.raises(TypeError, match="expected dtype to be float16, bfloat16, float32 or float64, got torch.int64"):
        sinusoidal_2d_table(2, 2, 8, dtype=torch.int64)  # as sinusoidal_table: TypeError
    for dtype in (torch.float8_e4m3fn, torch.complex64, "float32"):  # float8 was accepted (sinusoidal_table refuses it)
        with pytest.raises(TypeError, match="sinusoidal_2d_table: expected dtype to be float16, bfloat16, float32 or"):
            sinusoidal_2d_table(2, 2, 8, dtype=dtype)
    with pytest.raises(TypeError, match="expected dtype to be float16, bfloat16, float32 or float64, got torch.float8"):
        torch.ops.posenc.sinusoidal_2d_table(2, 2, 8, dtype=torch.float8_e5m2)
    pe = torch.randn(1, 17, 8)
    # Two-element tensors and arrays are grids; numpy and 0-d tensor numbers are numbers.
    assert resample_position_table(pe, torch.tensor([2, 3])).shape == (1, 7, 8)
    assert resample_position_table(pe, np.array([3, 2])).shape == (1, 7, 8)
    from posenc.functional import timestep_embedding
    t = torch.arange(3.0)
    torch.testing.assert_close(timestep_embedding(t, 8, scale=np.float32(2.0)), timestep_embedding(t, 8, scale=2.0))
    torch.testing.assert_close(timestep_embedding(t, 8, max_period=torch.tensor(100.0)),
                               timestep_embedding(t, 8, max_period=100.0))


def test_module_offset_must_not_be_a_bool():
    for cls in (posenc.PositionalEncoding, posenc.LearnedPositionalEncoding):
        with pytest.raises(TypeError, match="expected offset to be an int, got True"):
            cls(8, 0.1, 10)(torch.randn(1, 2, 8), offset=True)


def test_load_table_of_a_meta_module_takes_a_meta_table():
    """Deferred init: a module built on the meta device loads a meta table (a no-op copy); a
    meta table into a real module is refused, as is a complex one (load_table's checks)."""
    with torch.device("meta"):
        module = posenc.LearnedPositionalEncoding(4, 0.0, max_len=5)
    module.load_table(torch.empty(5, 4, device="meta"))
    assert module.pe.is_meta
    with pytest.raises(TypeError, match="real table that holds data"):
        posenc.LearnedPositionalEncoding(4, 0.0, max_len=5).load_table(torch.empty(5, 4, device="meta"))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_one_row_of_positions_serves_every_batch_row(batch_first, p):
    """(1, seq) positions (Hugging Face's position_ids of one sequence) as (seq,) ones, as the
    RoPE ops take them: the op refused them. Forward, the saved-mask backward and the table
    gradient equal the (seq,) call's, on the CPU kernels and through the ATen fallback."""
    from aten_fallback_mode import ThroughTheFallback

    torch.manual_seed(12)
    table = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn((3, 5, 8) if batch_first else (5, 3, 8), dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([4, 0, 8, 4, 2])
    g = torch.randn_like(x)

    def run(positions, fallback=False):
        torch.manual_seed(3)
        mode = ThroughTheFallback() if fallback else contextlib.nullcontext()
        with mode:
            y = posenc.functional.add_position(x, table, positions=positions, batch_first=batch_first, p=p)
            gx, gt = torch.autograd.grad(y, (x, table), g)
        return y, gx, gt

    want = run(pos)
    for fallback in (False, True):
        got = run(pos[None], fallback)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    m = posenc.LearnedPositionalEncoding(8, 0.0, max_len=9, batch_first=batch_first).double()
    assert torch.equal(m(x, positions=pos[None]), m(x, positions=pos))
    with pytest.raises(RuntimeError, match=r"\(1, seq\) serves every row"):
        posenc.functional.add_position(x, table, positions=pos[None].expand(2, 5), batch_first=batch_first)


def test_padding_idx_set_after_construction_is_read_as_the_constructor_reads_it():
    """padding_idx = -1 after construction froze no row (the constructor turns it into
    max_len - 1, as nn.Embedding); out of range was accepted (found by an audit)."""
    lpe = posenc.LearnedPositionalEncoding(3, 0.0, max_len=20)
    lpe.padding_idx = -1
    assert lpe.padding_idx == 19
    lpe(torch.randn(2, 20, 3)).sum().backward()
    assert torch.equal(lpe.pe.grad[0, 19], torch.zeros(3)) and lpe.pe.grad[0, 18].abs().sum() > 0
    for bad, error in ((25, ValueError), (-21, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="expected padding_idx"):
            lpe.padding_idx = bad
    lpe.padding_idx = None
    assert lpe.padding_idx is None


def test_load_table_into_a_parametrized_or_hooked_table():
    """A parametrized pe is computed from its original: load_table's copy went to the computed
    copy and was lost (3.4 off, no error; an audit). It is set through the parametrization's
    right_inverse, as `module.pe = table` is; a pe computed by a hook is refused."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, x):
            return 2 * x

        def right_inverse(self, x):
            return x / 2

    table = torch.randn(20, 3)
    lpe = posenc.LearnedPositionalEncoding(3, 0.0, max_len=20)
    parametrize.register_parametrization(lpe, "pe", Double())
    original = lpe.parametrizations.pe.original
    lpe.load_table(table.double())  # cast to pe's dtype, as the plain copy casts
    assert torch.equal(lpe.pe[0], table)
    assert lpe.parametrizations.pe.original is original and original.dtype == torch.float32
    assert torch.equal(original[0], table / 2)
    hooked = posenc.LearnedPositionalEncoding(3, 0.0, max_len=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm's deprecation
        torch.nn.utils.weight_norm(hooked, "pe", dim=1)
    with pytest.raises(RuntimeError, match="load_table: pe is computed from other parameters here"):
        hooked.load_table(table)
