"""PositionalEncoding in eval mode: the numbers, layouts, dtypes, views and state_dict."""
import io
from typing import Tuple

import pytest
import torch

import posenc
from conftest import DEVICES, DTYPES, ClassicPositionalEncoding, reference_add, reference_table
from dropout_reference import dropout_scale
from posenc.functional import sinusoidal_table


def make(d=16, max_len=64, p=0.1, **kw):
    return posenc.PositionalEncoding(d, p, max_len, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 1, 16), (1, 64, 16), (7, 13, 16)])
def test_eval_forward_equals_reference(device, dtype, batch_first, shape):
    pe = make(batch_first=batch_first).to(device).eval()
    x = torch.randn(shape, device=device).to(dtype)
    got = pe(x)
    assert got.dtype == dtype and got.shape == x.shape and got.device == x.device
    assert torch.equal(got, reference_add(x, pe.pe, batch_first=batch_first))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [1, 3, 8, 17, 24, 100])
def test_odd_and_unaligned_widths(device, d):
    pe = make(d=d, max_len=40).to(device).eval()
    x = torch.randn(3, 11, d, device=device)
    assert torch.equal(pe(x), reference_add(x, pe.pe))
    torch.testing.assert_close(pe.pe[0].double().cpu(), reference_table(torch.arange(40), d),
                               atol=2.0**-24, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_classic_class(device):
    ours = posenc.PositionalEncoding(64, 0.1).to(device).eval()
    classic = ClassicPositionalEncoding(64, 0.1).to(device).eval()
    x = torch.randn(4, 300, 64, device=device)
    # Same layout and formula; only the classic float32 table rounding differs.
    torch.testing.assert_close(ours(x), classic(x), atol=5e-4, rtol=0)
    # With the classic table loaded, the outputs are identical.
    ours.load_state_dict(classic.state_dict(), strict=True)
    assert torch.equal(ours(x), classic(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_offset_and_positions(device, batch_first):
    pe = make(batch_first=batch_first).to(device).eval()
    x = torch.randn(3, 6, 16, device=device)
    B, S = (3, 6) if batch_first else (6, 3)
    assert torch.equal(pe(x, offset=10), reference_add(x, pe.pe, offset=10, batch_first=batch_first))
    assert torch.equal(pe(x, offset=64 - S), reference_add(x, pe.pe, offset=64 - S, batch_first=batch_first))
    pos1 = torch.randint(0, 64, (S,), device=device)
    assert torch.equal(pe(x, positions=pos1), reference_add(x, pe.pe, pos1, batch_first=batch_first))
    pos2 = torch.randint(0, 64, (B, S), device=device)
    assert torch.equal(pe(x, positions=pos2), reference_add(x, pe.pe, pos2, batch_first=batch_first))


@pytest.mark.parametrize("device", DEVICES)
def test_incremental_decoding_matches_full_sequence(device):
    pe = make().to(device).eval()
    x = torch.randn(2, 20, 16, device=device)
    full = pe(x)
    steps = torch.cat([pe(x[:, t : t + 1], offset=t) for t in range(20)], dim=1)
    assert torch.equal(full, steps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_non_contiguous_and_offset_views(device, dtype):
    pe = make(d=24, p=0.4).to(device).eval()
    big = torch.randn(4, 30, 48, device=device).to(dtype)
    views = {
        "strided": big[:, ::3, ::2],                                    # (4, 10, 24)
        "transposed": big[:, :24, :10].transpose(1, 2),                 # (4, 10, 24)
        "offset": big.flatten()[1 : 1 + 4 * 10 * 24].view(4, 10, 24),   # misaligned start
        "expanded": big[:1, :10, :24].expand(4, 10, 24),
    }
    for name, x in views.items():
        assert torch.equal(pe(x), reference_add(x, pe.pe)), name
    # Training mode with dropout: the mask depends on the logical element index only, so a
    # view and its contiguous copy draw the same mask from the same seed; survivors are
    # exactly (x + pe) * 1/(1-p), summed in float32 (float64) and rounded once.
    pe.train()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = dropout_scale(0.4, acc)
    for name, x in views.items():
        torch.manual_seed(7)
        y = pe(x)
        torch.manual_seed(7)
        y_contiguous = pe(x.contiguous())
        assert torch.equal(y, y_contiguous), name
        kept = y != 0
        assert 0.2 < 1 - kept.double().mean().item() < 0.6, name  # 960 elements, p = 0.4
        want = (reference_add(x, pe.pe, rounded=False) * scale).to(dtype)
        assert torch.equal(y[kept], want[kept]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5, 16), (3, 0, 16), (0, 0, 16)])
def test_empty_batch_or_sequence(device, shape):
    pe = make().to(device)
    x = torch.randn(shape, device=device, requires_grad=True)
    for mode in (pe.eval, pe.train):
        mode()
        y = pe(x)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape


def test_edited_table_is_honoured():
    pe = make().eval()
    with torch.no_grad():
        pe.pe.mul_(-2.0).add_(0.25)
    x = torch.randn(2, 9, 16)
    assert torch.equal(pe(x), x + pe.pe[:, :9])


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_max_len_follows_a_replaced_table(cls):
    m = cls(8, 0.0, max_len=16)
    assert m.max_len == 16 and "max_len=16" in repr(m)
    longer = torch.randn(1, 32, 8)
    if cls is posenc.LearnedPositionalEncoding:
        m.pe = torch.nn.Parameter(longer)
    else:
        m.pe = longer
    assert m.max_len == 32 and "max_len=32" in repr(m)  # was 16 while forward read 32 rows
    x = torch.randn(2, 20, 8)
    torch.testing.assert_close(m(x), x + longer[:, :20])
    scripted = torch.jit.script(m)
    torch.testing.assert_close(scripted(x), x + longer[:, :20])


def test_half_module_and_double_input():
    pe = make().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert torch.equal(pe(x), x + pe.pe[:, :5].double())
    half = make().half().eval()
    assert half.pe.dtype == torch.float16
    xh = torch.randn(2, 5, 16).half()
    assert torch.equal(half(xh), reference_add(xh, half.pe))


def test_state_dict_round_trips_with_classic_class():
    ours = make(d=32, max_len=100)
    assert list(ours.state_dict().keys()) == ["pe"]
    assert ours.state_dict()["pe"].shape == (1, 100, 32)
    assert ours.state_dict()["pe"].dtype == torch.float32
    assert dict(ours.named_buffers()).keys() == {"pe"}
    assert list(ours.parameters()) == []
    classic = ClassicPositionalEncoding(32, 0.1, 100)
    # classic -> ours
    ours.load_state_dict(classic.state_dict(), strict=True)
    assert torch.equal(ours.pe, classic.pe)
    # ours -> classic, through a file
    with torch.no_grad():
        ours.pe.add_(1.0)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    classic.load_state_dict(torch.load(buf), strict=True)
    assert torch.equal(classic.pe, ours.pe)


def test_same_positional_arguments_as_classic():
    pe = posenc.PositionalEncoding(8, 0.3, 50)
    assert pe.dropout.p == 0.3 and pe.pe.shape == (1, 50, 8)
    assert posenc.PositionalEncoding(8, 0.0).pe.shape == (1, 5000, 8)
    pe.dropout.p = 0.0  # settable like the classic nn.Dropout child
    pe.train()
    x = torch.randn(2, 3, 8)
    assert torch.equal(pe(x), x + pe.pe[:, :3])


def _double_output(module: torch.nn.Module, args: Tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return out * 2.0


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
@pytest.mark.parametrize("scripted", [False, True])
def test_replaced_or_hooked_dropout_child_is_called(cls, scripted):
    # The classic class calls its dropout child on x + pe: a user who replaces it (nn.Identity
    # to switch dropout off, another dropout) or hooks it gets that child's output, in the
    # training mode a user is in after construction (the child used to be read for .p only:
    # AttributeError for nn.Identity, an AlphaDropout silently ran as plain dropout).
    torch.manual_seed(0)
    module = cls(8, 0.5, 16)
    x = torch.randn(2, 5, 8)
    added = x + module.pe[:, :5].detach()
    module.dropout = torch.nn.Identity()
    run = torch.jit.script(module) if scripted else module
    assert torch.equal(run(x), added)
    module.dropout = torch.nn.AlphaDropout(0.5)
    run = torch.jit.script(module) if scripted else module
    torch.manual_seed(1)
    got = run(x)
    torch.manual_seed(1)
    assert torch.equal(got, torch.nn.functional.alpha_dropout(added, 0.5, True))
    if scripted:  # a hooked nn.Dropout child runs with its (scriptable) hooks, as in eager mode
        module.dropout = torch.nn.Dropout(0.0)
        module.dropout.register_forward_hook(_double_output)
        torch.testing.assert_close(torch.jit.script(module)(x), 2 * added, rtol=0, atol=0)
        return
    module.dropout = torch.nn.Dropout(0.5)
    seen = []
    handle = module.dropout.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    torch.manual_seed(2)
    got = module(x)
    torch.manual_seed(2)
    assert len(seen) == 1 and torch.equal(seen[0][0], added) and torch.equal(got, seen[0][1])
    assert torch.equal(got, torch.nn.functional.dropout(added, 0.5, True))
    handle.remove()
    got = module(x)  # unhooked: fused again, the same distribution (zeros or 2x)
    assert len(seen) == 1 and torch.equal(got == 0, got != 2 * added) and bool((got == 0).any())


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
@pytest.mark.parametrize("scripted", [False, True])
def test_the_dropout_childs_own_mode_decides(cls, scripted):
    """As nn.Dropout in the classic class: module.train(); module.dropout.eval() switches
    dropout off, module.eval(); module.dropout.train() keeps it on (MC dropout). The fused
    dropout read the parent's mode: both inverted."""
    module = cls(8, 0.5, 16)
    x = torch.randn(2, 5, 8)
    added = x + module.pe[:, :5].detach()
    module.train()
    module.dropout.eval()
    run = torch.jit.script(module) if scripted else module
    assert torch.equal(run(x), added)
    module.eval()
    module.dropout.train()
    run = torch.jit.script(module) if scripted else module
    got = run(x)
    assert bool((got == 0).any()) and torch.equal(got == 0, got != 2 * added)


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_backward_hooks_of_the_dropout_child_run(cls):
    """A full backward hook (or backward pre-hook) on the dropout child, or a global one, runs
    as in the classic class: the child is then called, not fused (its hooks never ran and the
    gradient they change came back unchanged)."""
    module = cls(8, 0.0, 16)
    x = torch.randn(2, 5, 8, requires_grad=True)
    handle = module.dropout.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 10,))
    module(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 10.0))
    handle.remove()
    x.grad = None
    handle = module.dropout.register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 3,))
    module(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    handle.remove()
    x.grad = None
    seen = []
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda mod, gin, gout: seen.append(type(mod)))
    try:
        module(x).sum().backward()
    finally:
        handle.remove()
    assert torch.nn.Dropout in seen and torch.equal(x.grad, torch.ones_like(x))


def test_reset_parameters_after_to_empty():
    """Built on the meta device and moved with to_empty (FSDP's meta initialisation), the
    tables and weights are uninitialised memory: reset_parameters (on every module that has
    it, as FSDP's param_init_fn calls it) makes them a fresh module's again. PositionalEncoding
    and QKNormRotary had none, so forward read the garbage (3e22)."""
    torch.manual_seed(0)  # the learned tables' std ratio below (128 values each)
    fresh = [posenc.PositionalEncoding(8, 0.0, 16), posenc.QKNormRotary(8, num_heads=2, num_kv_heads=1),
             posenc.QKNormRotary(8, num_heads=2, num_kv_heads=1, weight_offset=1.0),
             posenc.RotaryPositionalEncoding(8, 16), posenc.LearnedPositionalEncoding(8, 0.0, 16)]
    with torch.device("meta"):
        metas = [posenc.PositionalEncoding(8, 0.0, 16), posenc.QKNormRotary(8, num_heads=2, num_kv_heads=1),
                 posenc.QKNormRotary(8, num_heads=2, num_kv_heads=1, weight_offset=1.0),
                 posenc.RotaryPositionalEncoding(8, 16), posenc.LearnedPositionalEncoding(8, 0.0, 16)]
    for want, module in zip(fresh, metas, strict=True):
        module.to_empty(device="cpu")
        with torch.no_grad():  # what to_empty left, made visible: NaN wherever it is not reset
            for t in list(module.buffers()) + list(module.parameters()):
                if t.is_floating_point():
                    t.fill_(float("nan"))
        for m in module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        wanted = list(want.named_buffers()) + list(want.named_parameters())
        got = list(module.named_buffers()) + list(module.named_parameters())
        assert [n for n, _ in wanted] == [n for n, _ in got], type(want).__name__
        for (name, a), (_, b) in zip(wanted, got, strict=True):
            if isinstance(want, posenc.LearnedPositionalEncoding) and name == "pe":  # a random init
                assert b.shape == a.shape and torch.isfinite(b).all(), name
                assert 0.8 < b.std().item() / a.std().item() < 1.25 and not torch.equal(a, b)
            else:
                assert torch.equal(a, b), (type(want).__name__, name)
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 1, 8)
    assert torch.equal(metas[0](torch.zeros(1, 5, 8)), fresh[0](torch.zeros(1, 5, 8)))
    for i in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(metas[i](q, k), fresh[i](q, k)))


@pytest.mark.parametrize("d", [16, 7])
@pytest.mark.parametrize("base", [500.0, 2.5, 1e6, 10000.0])
def test_base_argument_builds_the_buffer(d, base):
    max_len = 300
    pe = posenc.PositionalEncoding(d, 0.1, max_len, base=base)
    assert pe.base == base and pe.pe.shape == (1, max_len, d) and pe.pe.dtype == torch.float32
    # The buffer is the functional table with that base ...
    assert torch.equal(pe.pe[0], sinusoidal_table(torch.arange(max_len), d, base=base))
    # ... which is the float64 formula with that base, rounded once to float32.
    exact = reference_table(torch.arange(max_len), d, base=base)
    assert (pe.pe[0].double() - exact).abs().max().item() <= 2.0**-25 + 1e-12
    if base != 10000.0:  # the base is really used: the default-base table is far from it
        assert (reference_table(torch.arange(max_len), d) - exact).abs().max().item() > 0.1
    # The forward adds rows of that buffer, and the module says which base it has.
    x = torch.randn(2, 9, d)
    assert torch.equal(pe.eval()(x, offset=5), reference_add(x, pe.pe, offset=5))
    assert f"base={base}" in repr(pe)


def test_pe_follows_the_default_dtype_as_the_classic_modules_buffer():
    """Under torch.set_default_dtype(torch.float64) the classic module's pe is float64; posenc's
    was always float32, so a float64 checkpoint was rounded on load and saved back rounded.
    Now pe is made in the default dtype: the float64 table, libm's values."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m = posenc.PositionalEncoding(12, 0.1, max_len=40)
        learned = posenc.LearnedPositionalEncoding(12, 0.1, max_len=40)
    finally:
        torch.set_default_dtype(before)
    assert m.pe.dtype == learned.pe.dtype == torch.float64
    # float64 to the rounding of angles up to 39 rad (seen: 3.3e-15): not a float32 table.
    want = reference_table(torch.arange(40), 12)
    torch.testing.assert_close(m.pe[0], want, rtol=0, atol=1e-13)
    checkpoint = {"pe": want[None] * (1 + 2**-40)}  # not a float32 value
    m.load_state_dict(checkpoint)
    assert torch.equal(m.state_dict()["pe"], checkpoint["pe"])
    assert posenc.PositionalEncoding(12, 0.1, max_len=40).pe.dtype == torch.float32  # the default again


def test_reset_builds_the_table_on_the_cpu_under_another_default_device():
    """reset_parameters builds the table on the CPU (libm's bits) whatever the default device:
    its positions followed torch.set_default_device, so a CPU pe reset under a meta default
    device raised (no data to copy), and under a CUDA one the table would be CUDA's sin/cos."""
    m = posenc.PositionalEncoding(16, 0.1, max_len=32)
    want = m.pe.clone()
    m.pe.zero_()
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        m.reset_parameters()
    finally:
        torch.set_default_device(before)
    assert torch.equal(m.pe, want)


def test_device_and_dtype_factory_arguments():
    """torch's factory arguments, as nn.Embedding takes them: ``pe`` made in that dtype (the
    table rounded once to it, not through the default dtype) and on that device (meta:
    shapes only, then to_empty and reset_parameters)."""
    want64 = sinusoidal_table(torch.arange(32), 16, dtype=torch.float64)
    pe = posenc.PositionalEncoding(16, 0.0, 32, dtype=torch.float64)
    assert pe.pe.dtype == torch.float64 and torch.equal(pe.pe[0], want64)
    half = posenc.PositionalEncoding(16, 0.0, 32, dtype=torch.bfloat16)
    assert torch.equal(half.pe[0], sinusoidal_table(torch.arange(32), 16, dtype=torch.bfloat16))
    meta = posenc.PositionalEncoding(16, 0.0, 32, device="meta", dtype=torch.float64)
    assert meta.pe.is_meta and meta.pe.dtype == torch.float64
    meta.to_empty(device="cpu").reset_parameters()
    assert torch.equal(meta.pe[0], want64)

    learned = posenc.LearnedPositionalEncoding(16, 0.0, 32, padding_idx=3, dtype=torch.float64)
    assert learned.pe.dtype == torch.float64 and learned.pe.requires_grad
    assert torch.equal(learned.pe[0, 3], torch.zeros(16, dtype=torch.float64)) and learned.pe[0, 4].abs().sum() > 0
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert torch.equal(learned(x), x + learned.pe[:, :5])
    meta_learned = posenc.LearnedPositionalEncoding(16, 0.0, 32, device="meta")
    assert meta_learned.pe.is_meta and meta_learned.pe.dtype == torch.get_default_dtype()

    for cls in (posenc.PositionalEncoding, posenc.LearnedPositionalEncoding):
        for bad in (torch.int64, torch.float8_e4m3fn, "float32"):
            with pytest.raises(TypeError, match=rf"{cls.__name__}: expected dtype to be float16, bfloat16, float32 "
                                                rf"or float64, got {bad!r}"):
                cls(16, 0.0, 32, dtype=bad)


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_a_dropout_child_whose_forward_is_replaced_is_called(cls, monkeypatch):
    """The fused dropout stands in for the child's call only while that call would run
    nn.Dropout.forward as torch wrote it: a forward set on the child, or assigned to
    nn.Dropout, was silently skipped (the fused mask applied instead; found by an audit)."""
    import types

    x = torch.randn(2, 4, 8)
    m = cls(8, 0.5, 16)
    m.dropout.forward = types.MethodType(lambda self, y: y * 3.0, m.dropout)
    assert torch.equal(m(x), (x + m.pe[:, :4]) * 3.0)
    assert torch.equal(torch.compile(m, fullgraph=True, backend="eager")(x), (x + m.pe[:, :4]) * 3.0)
    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda self, y: y * 5.0)
    m = cls(8, 0.5, 16)
    assert torch.equal(m(x), (x + m.pe[:, :4]) * 5.0)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), (x + m.pe[:, :4]) * 5.0)


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_a_forward_set_on_the_dropout_child_after_compiling_is_called(cls):
    """A module compiled while its dropout child ran as written, then the child given another
    forward: the compiled module recompiles and calls it, as torch's own compiled nn.Dropout
    child does (it kept the fused dropout: a lookup in the child's __dict__ is not guarded;
    found by an audit); removing it fuses again, and a fresh child given a forward is called."""
    import types

    x = torch.ones(2, 4, 8)
    m = cls(8, 0.5, 16)
    compiled = torch.compile(m, backend="eager")
    kept = compiled(x) / (x + m.pe[:, :4])
    assert set(kept.unique().tolist()) <= {0.0, 2.0}  # the fused dropout, p = 0.5
    m.dropout.forward = types.MethodType(lambda self, y: y * 5.0, m.dropout)
    torch.testing.assert_close(compiled(x), (x + m.pe[:, :4]) * 5.0)
    del m.dropout.forward
    assert set((compiled(x) / (x + m.pe[:, :4])).unique().tolist()) <= {0.0, 2.0}
    m.dropout = torch.nn.Dropout(0.5)
    m.dropout.forward = types.MethodType(lambda self, y: y * 7.0, m.dropout)
    torch.testing.assert_close(compiled(x), (x + m.pe[:, :4]) * 7.0)


@pytest.mark.parametrize("dtype,table_dtype,batch_first", [
    (torch.float32, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float16, torch.float32, False),
    (torch.float64, torch.float64, True),
])
def test_a_large_forward_streams_with_the_bits_of_small_calls(dtype, table_dtype, batch_first):
    """A forward that writes 8 MiB or more (kStreamBytes) stores its output with streaming
    stores (add_position/cpu/kernel.cpp): the same bits as the same rows added by calls small
    enough for plain stores, and the float64 reference's values."""
    g = torch.Generator().manual_seed(5)
    batch, seq, d = 16, 512, 512
    shape = (batch, seq, d) if batch_first else (seq, batch, d)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    table = torch.randn(seq + 7, d, generator=g, dtype=torch.float64).to(table_dtype)
    out = posenc.functional.add_position(x, table, offset=7, batch_first=batch_first)
    assert out.numel() * out.element_size() >= 8 << 20
    dim = 0 if batch_first else 1
    parts = [posenc.functional.add_position(part, table, offset=7, batch_first=batch_first)
             for part in x.split(1, dim)]  # 0.5-1 MiB each: plain stores
    assert torch.equal(out, torch.cat(parts, dim))
    rows = table[7:7 + seq].double()
    want = x.double() + (rows.unsqueeze(0) if batch_first else rows.unsqueeze(1))
    torch.testing.assert_close(out.double(), want, rtol=0, atol=want.abs().max().item() * 2.0**-7)
