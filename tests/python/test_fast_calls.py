"""posenc._C.add_position, the direct entry the add-position modules' decode call uses
outside torch.compile (csrc/python/fast_calls.cpp, issue 28): the same operator as
torch.ops.posenc.add_position with positions=None, reached without torch.ops' boxed argument
parsing. Checked here: it is built and used; values against the float64 formula and bit for
bit against torch.ops (dropout included: same generator state, same mask); gradients; the
op's own errors; and that it declines (NotImplemented, the module then calls torch.ops)
whatever torch.ops hands to __torch_function__, while dispatch modes still see the op."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
from posenc import _library, modules
from conftest import reference_table
from rope_reference import default_inv_freq, reference_rope

FAST = _library.FAST_CALLS
OP = torch.ops.posenc.add_position
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def test_built_beside_the_library_and_used_by_the_modules():
    # make build and the wheel both build it (CMake finds this interpreter's headers): a
    # missing module would only cost speed, so its absence fails here instead.
    assert FAST is not None, f"no posenc._C beside {_library.LIBRARY_PATH}"
    assert modules._ADD_POSITION_FAST is FAST.add_position


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("shape,offset", [((1, 1, 512), 100), ((3, 7, 10), 0), ((2, 5, 33), 91), ((0, 4, 6), 3)])
def test_eval_values(dtype, batch_first, shape, offset):
    gen = torch.Generator().manual_seed(hash((str(dtype), batch_first, shape)) % 2**31)
    b, s, d = shape
    x = torch.randn(b, s, d, generator=gen, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    table = torch.randn(1, 128, d, generator=gen, dtype=torch.float64)
    xd, td = x.to(dtype), table.to(dtype)
    out = FAST.add_position(xd, td, offset, batch_first, 0.0)
    rows = table[0, offset:offset + s]
    expected = xd.double() + (rows.unsqueeze(0) if batch_first else rows.unsqueeze(1)).to(dtype).double()
    assert out.dtype == dtype and out.shape == xd.shape
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL[dtype])  # one rounding of the sum
    assert torch.equal(out, OP(xd, td, None, offset, batch_first, 0.0))


def test_sinusoidal_module_against_the_formula():
    torch.manual_seed(0)
    pe = posenc.PositionalEncoding(24, 0.1, max_len=300).eval()
    x = torch.randn(2, 5, 24, dtype=torch.float64).float()
    out = pe(x, offset=250)
    expected = x.double() + reference_table(torch.arange(250, 255), 24)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-6)


def test_dropout_bits_match_torch_ops():
    """Same generator state, same mask: the entry calls the same op (its Philox offset)."""
    x = torch.randn(3, 9, 16)
    table = torch.randn(1, 64, 16)
    torch.manual_seed(123)
    fast = FAST.add_position(x, table, 5, True, 0.3)
    torch.manual_seed(123)
    boxed = OP(x, table, None, 5, True, 0.3)
    assert torch.equal(fast, boxed)
    kept = fast != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(fast[kept], ((x + table[:, 5:14]) / 0.7)[kept])


def test_gradients_flow_as_through_torch_ops():
    torch.manual_seed(1)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    table = torch.nn.Parameter(torch.randn(1, 20, 8, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda a, t: FAST.add_position(a, t, 3, True, 0.0), (x, table))
    out = FAST.add_position(x, table, 3, True, 0.0)
    grad = torch.randn_like(out)
    gx, gt = torch.autograd.grad(out, (x, table), grad)
    torch.testing.assert_close(gx, grad)
    expected_gt = torch.zeros_like(table)
    expected_gt[0, 3:9] = grad.sum(0)
    torch.testing.assert_close(gt, expected_gt)


def counting(monkeypatch, name="add_position"):
    """Replaces the modules' posenc._C entry `name` by one that records each call's
    arguments after the tensors; returns the record."""
    calls = []
    entry = getattr(FAST, name)

    def record(*args):
        calls.append(args[2] if name == "add_position" else args[2:])
        return entry(*args)

    monkeypatch.setattr(modules, f"_{name.upper()}_FAST", record)
    return calls


def test_learned_module_trains_through_the_entry(monkeypatch):
    calls = counting(monkeypatch)
    torch.manual_seed(2)
    m = posenc.LearnedPositionalEncoding(8, 0.0, max_len=16)
    x = torch.randn(2, 3, 8)
    m(x, offset=4).square().sum().backward()
    assert calls == [4]
    expected = torch.zeros(1, 16, 8)
    expected[0, 4:7] = 2 * (x + m.pe.detach()[:, 4:7]).sum(0)
    torch.testing.assert_close(m.pe.grad, expected)


def test_the_op_errors_come_through():
    x = torch.randn(1, 4, 8)
    table = torch.randn(1, 10, 8)
    for args in [(x, table, 7, True, 0.0), (x, table, -1, True, 0.0), (x, torch.randn(1, 10, 6), 0, True, 0.0),
                 (x.int(), table.int(), 0, True, 0.0), (x, table, 0, True, 1.5)]:
        with pytest.raises(Exception) as fast:
            FAST.add_position(*args)
        with pytest.raises(Exception) as boxed:
            OP(args[0], args[1], None, *args[2:])
        assert type(fast.value) is type(boxed.value)
        assert str(fast.value).splitlines()[0] == str(boxed.value).splitlines()[0]
    with pytest.raises(ValueError, match="plus offset 7 exceeds max_len=10"):
        posenc.PositionalEncoding(8, 0.0, max_len=10).eval()(x, offset=7)
    with pytest.raises(TypeError, match="expected 5 arguments"):
        FAST.add_position(x, table, 0)
    with pytest.raises(ValueError, match=r"expected offset to fit in a 64-bit integer, got 1180591620717411303424"):
        FAST.add_position(x, table, 2**70, True, 0.0)


class Subclass(torch.Tensor):
    pass


class RecordFunctions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class RecordDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_declines_what_torch_ops_hands_to_torch_function():
    x = torch.randn(1, 2, 4)
    table = torch.randn(1, 8, 4)
    assert FAST.add_position(x.as_subclass(Subclass), table, 0, True, 0.0) is NotImplemented
    assert FAST.add_position(x, table.as_subclass(Subclass), 0, True, 0.0) is NotImplemented
    assert FAST.add_position(x, table, 0, True, 0) is NotImplemented  # int p: the op's parsing decides
    assert FAST.add_position(x, table, 0, 1, 0.0) is NotImplemented
    assert FAST.add_position(x, table, True, True, 0.0) is NotImplemented  # bool offset
    assert FAST.add_position(x, table, 0.0, True, 0.0) is NotImplemented
    with RecordFunctions() as mode:
        assert FAST.add_position(x, table, 0, True, 0.0) is NotImplemented
        out = posenc.PositionalEncoding(4, 0.0, max_len=8).eval()(x, offset=1)
    assert OP.default in mode.seen
    torch.testing.assert_close(out.double(), x.double() + reference_table(torch.arange(1, 3), 4), rtol=0, atol=1e-6)
    # A subclass input through the module: torch.ops' path, the subclass's result type.
    sub = posenc.PositionalEncoding(4, 0.0, max_len=8).eval()(x.as_subclass(Subclass), offset=1)
    assert type(sub) is Subclass


def test_dispatch_modes_see_what_torch_ops_shows_them():
    x = torch.randn(1, 2, 4)
    table = torch.randn(1, 8, 4, requires_grad=True)
    with RecordDispatch() as fast:
        out = FAST.add_position(x, table, 2, True, 0.0)
    with RecordDispatch() as boxed:
        OP(x, table, None, 2, True, 0.0)
    # Below autograd the mode sees the forward op that the autograd kernel calls.
    assert fast.seen == boxed.seen == [torch.ops.posenc.add_position_forward.default]
    assert torch.equal(out, x + table[:, 2:4])
    assert out.grad_fn is not None



# ---- The modules' __call__ shortcut: taken only when nn.Module.__call__ would go straight
# to forward; otherwise everything nn.Module.__call__ does still happens.

def expected_eval(x, offset, d=8):
    return x.double() + reference_table(torch.arange(offset, offset + x.shape[1]), d)


@pytest.mark.parametrize("call", ["m(x)", "m(x, 3)", "m(x, offset=3)", "m(x=x)", "m(x, 3, None)",
                                  "m(x, positions=torch.arange(3, 8))"])
def test_every_call_form_gives_the_formula(call, monkeypatch):
    calls = counting(monkeypatch)
    m = posenc.PositionalEncoding(8, 0.1, max_len=16).eval()
    x = torch.randn(2, 5, 8)
    out = eval(call, {"m": m, "x": x, "torch": torch})
    offset = 0 if call == "m(x)" or call == "m(x=x)" else 3
    torch.testing.assert_close(out.double(), expected_eval(x, offset), rtol=0, atol=1e-6)
    # The plain forms reach posenc._C (from __call__, or from forward's decode branch).
    assert calls == ([] if "positions" in call else [offset])


def test_hooks_run_and_see_the_call_as_made(monkeypatch):
    calls = counting(monkeypatch)
    m = posenc.PositionalEncoding(8, 0.0, max_len=16).eval()
    x = torch.randn(2, 5, 8)
    seen = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(("pre", len(args), dict(kwargs))),
                                    with_kwargs=True),
        m.register_forward_hook(lambda mod, args, out: seen.append(("post", out.shape))),
    ]
    out = m(x, offset=2)
    assert seen == [("pre", 1, {"offset": 2}), ("post", torch.Size([2, 5, 8]))]
    torch.testing.assert_close(out.double(), expected_eval(x, 2), rtol=0, atol=1e-6)
    assert calls == [2]  # forward's own call of posenc._C, after the pre-hook
    for h in handles:
        h.remove()
    seen.clear()
    m(x, offset=2)
    assert seen == [] and calls == [2, 2]


@pytest.mark.parametrize("kind", ["forward_pre", "forward", "full_backward_pre", "full_backward"])
def test_global_hooks_run(kind):
    register = getattr(torch.nn.modules.module, f"register_module_{kind}_hook")
    seen = []
    if kind == "forward_pre":
        handle = register(lambda mod, args: seen.append(type(mod).__name__))
    elif kind == "forward":
        handle = register(lambda mod, args, out: seen.append(type(mod).__name__))
    elif kind == "full_backward_pre":
        handle = register(lambda mod, grad_out: seen.append(type(mod).__name__))
    else:
        handle = register(lambda mod, grad_in, grad_out: seen.append(type(mod).__name__))
    try:
        m = posenc.LearnedPositionalEncoding(8, 0.0, max_len=16)
        x = torch.randn(2, 5, 8, requires_grad=True)
        m(x, 1).sum().backward()
    finally:
        handle.remove()
    assert "LearnedPositionalEncoding" in seen
    expected = torch.zeros(1, 16, 8)
    expected[0, 1:6] = 2.0
    torch.testing.assert_close(m.pe.grad, expected)


def test_overridden_or_patched_forward_runs(monkeypatch):
    class Doubled(posenc.PositionalEncoding):
        def forward(self, x, offset=0, positions=None):
            return 2 * super().forward(x, offset, positions)

    x = torch.randn(1, 4, 8)
    base = expected_eval(x, 1)
    torch.testing.assert_close(Doubled(8, 0.0, 16).eval()(x, 1).double(), 2 * base, rtol=0, atol=1e-6)
    m = posenc.PositionalEncoding(8, 0.0, 16).eval()
    m.forward = lambda x, offset=0: torch.zeros_like(x)  # on the instance
    assert torch.equal(m(x, 1), torch.zeros_like(x))
    original = posenc.PositionalEncoding.forward
    monkeypatch.setattr(posenc.PositionalEncoding, "forward",  # on the class, as patchers do
                        lambda self, x, offset=0, positions=None: 3 * original(self, x, offset, positions))
    torch.testing.assert_close(posenc.PositionalEncoding(8, 0.0, 16).eval()(x, 1).double(), 3 * base,
                               rtol=0, atol=1e-6)


def test_compiled_call_impl_is_honoured():
    """module.compile() installs _compiled_call_impl, which nn.Module.__call__ calls instead
    of forward: the shortcut must not skip it."""
    m = posenc.PositionalEncoding(8, 0.0, 16).eval()
    sentinel = torch.full((1,), 7.0)
    m._compiled_call_impl = lambda *args, **kwargs: sentinel
    assert m(torch.randn(1, 2, 8), 1) is sentinel


def test_jit_trace_records_the_op_in_the_module_scope():
    x = torch.randn(1, 4, 8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = posenc.PositionalEncoding(8, 0.0, 16).eval()

        def forward(self, x):
            return self.pos(x, 2)

    assert FAST.add_position(x, torch.randn(1, 16, 8), 0, True, 0.0) is not NotImplemented
    traced = torch.jit.trace(Net().eval(), x)
    nodes = [n for n in traced.inlined_graph.nodes() if n.kind() == "posenc::add_position"]
    assert len(nodes) == 1 and "pos" in nodes[0].scopeName()
    x2 = torch.randn(1, 4, 8)
    torch.testing.assert_close(traced(x2).double(), expected_eval(x2, 2), rtol=0, atol=1e-6)


def test_declines_while_jit_tracing():
    table = torch.randn(1, 16, 8)
    results = []

    def fn(x):
        results.append(FAST.add_position(x, table, 0, True, 0.0))
        return x + 1

    torch.jit.trace(fn, torch.randn(1, 4, 8), check_trace=False)
    assert results == [NotImplemented]
    assert FAST.add_position(torch.randn(1, 4, 8), table, 0, True, 0.0) is not NotImplemented


# ---- posenc._C.rope: the RoPE modules' decode call (positions offset .. offset + seq - 1,
# no scaling or sections), every other argument at the schema's default.

ROPE_CASES = [  # layout, interleaved, rotary_dim, base, with k
    ("bshd", False, 64, 10000.0, True), ("bhsd", True, 64, 500000.0, True), ("sbhd", False, 32, 10000.0, False),
    ("bshd", True, 24, 1e6, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout,interleaved,rotary_dim,base,with_k", ROPE_CASES)
def test_rope_values(dtype, layout, interleaved, rotary_dim, base, with_k):
    torch.manual_seed(len(layout) + rotary_dim)
    # batch 2, seq 3, 4 q heads and 2 k heads, head_dim 64, in the layout's order
    q_shape = {"bshd": (2, 3, 4, 64), "bhsd": (2, 4, 3, 64), "sbhd": (3, 2, 4, 64)}[layout]
    k_shape = {"bshd": (2, 3, 2, 64), "bhsd": (2, 2, 3, 64), "sbhd": (3, 2, 2, 64)}[layout]
    q = torch.randn(q_shape, dtype=torch.float64).to(dtype)
    k = torch.randn(k_shape, dtype=torch.float64).to(dtype) if with_k else None
    out_q, out_k = FAST.rope(q, k, 17, base, rotary_dim, interleaved, layout)
    boxed_q, boxed_k = torch.ops.posenc.rope(q, k, offset=17, base=base, rotary_dim=rotary_dim,
                                             interleaved=interleaved, layout=layout)
    assert torch.equal(out_q, boxed_q) and torch.equal(out_k, boxed_k)
    pos = torch.arange(17, 20).expand(2, 3)
    inv = default_inv_freq(rotary_dim, base)
    atol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out_q.double(), reference_rope(q, layout, pos, inv, rotary_dim, interleaved),
                               rtol=0, atol=atol)
    if with_k:
        torch.testing.assert_close(out_k.double(), reference_rope(k, layout, pos, inv, rotary_dim, interleaved),
                                   rtol=0, atol=atol)
    else:
        assert out_k.numel() == 0


def test_rope_module_takes_it_and_gives_the_formula(monkeypatch):
    calls = counting(monkeypatch, "rope")
    rope = posenc.RotaryPositionalEncoding(64, base=500000.0, rotary_dim=32, interleaved=True, layout="bhsd")
    q, k = torch.randn(1, 8, 1, 64, dtype=torch.float64), torch.randn(1, 2, 1, 64, dtype=torch.float64)
    out_q, out_k = rope(q, k, offset=100)
    only_q = rope(q, offset=101)
    assert calls == [(100, 500000.0, 32, True, "bhsd"), (101, 500000.0, 32, True, "bhsd")]
    inv = default_inv_freq(32, 500000.0)
    torch.testing.assert_close(out_q, reference_rope(q, "bhsd", torch.tensor([[100]]), inv, 32, True))
    torch.testing.assert_close(out_k, reference_rope(k, "bhsd", torch.tensor([[100]]), inv, 32, True))
    torch.testing.assert_close(only_q, reference_rope(q, "bhsd", torch.tensor([[101]]), inv, 32, True))


def test_rope_gradients():
    torch.manual_seed(3)
    q = torch.randn(1, 3, 2, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: FAST.rope(a, b, 5, 10000.0, 16, False, "bshd"), (q, k))
    out = FAST.rope(q, k, 5, 10000.0, 16, False, "bshd")
    grads = torch.autograd.grad(out[0].sum() + 2 * out[1].sum(), (q, k))
    boxed = torch.ops.posenc.rope(q, k, offset=5)
    expected = torch.autograd.grad(boxed[0].sum() + 2 * boxed[1].sum(), (q, k))
    assert torch.equal(grads[0], expected[0]) and torch.equal(grads[1], expected[1])


def test_rope_errors_and_declines():
    q = torch.randn(1, 2, 4, 16)
    for args, kwargs in [((q, None, 0, 10000.0, 16, False, "bsdh"), dict(layout="bsdh")),
                         ((q, None, 0, 10000.0, 18, False, "bshd"), dict(rotary_dim=18)),
                         ((q.int(), None, 0, 10000.0, 16, False, "bshd"), dict()),
                         ((q, q[..., :8], 0, 10000.0, 16, False, "bshd"), dict())]:
        with pytest.raises(Exception) as fast:
            FAST.rope(*args)
        with pytest.raises(Exception) as boxed:
            torch.ops.posenc.rope(args[0], args[1], offset=0, **kwargs)
        assert type(fast.value) is type(boxed.value)
        assert str(fast.value).splitlines()[0] == str(boxed.value).splitlines()[0]
    with pytest.raises(TypeError, match="expected 7 arguments"):
        FAST.rope(q, None, 0)
    with pytest.raises(ValueError, match="expected rotary_dim to fit in a 64-bit integer"):
        FAST.rope(q, None, 0, 10000.0, 2**64, False, "bshd")
    assert FAST.rope(q.as_subclass(Subclass), None, 0, 10000.0, 16, False, "bshd") is NotImplemented
    assert FAST.rope(q, q.as_subclass(Subclass), 0, 10000.0, 16, False, "bshd") is NotImplemented
    assert FAST.rope(q, None, 0, 10000, 16, False, "bshd") is NotImplemented  # int base
    assert FAST.rope(q, None, 0, 10000.0, 16, 0, "bshd") is NotImplemented
    with RecordFunctions():
        assert FAST.rope(q, None, 0, 10000.0, 16, False, "bshd") is NotImplemented
    with RecordDispatch() as fast_mode:
        FAST.rope(q, None, 0, 10000.0, 16, False, "bshd")
    with RecordDispatch() as boxed_mode:
        torch.ops.posenc.rope(q, None, offset=0)
    assert fast_mode.seen == boxed_mode.seen and fast_mode.seen


def test_compile_fullgraph_of_a_model_that_holds_the_modules():
    """Dynamo traces the modules' __call__ (a user-defined __call__ on an nn.Module):
    under compilation the shortcut and posenc._C are skipped, so the graph has the ops and
    no break."""
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = posenc.PositionalEncoding(16, 0.0, 64)
            self.learned = posenc.LearnedPositionalEncoding(16, 0.0, 64)
            self.rope = posenc.RotaryPositionalEncoding(8)

        def forward(self, x, offset: int):
            h = self.learned(self.pos(x, offset), offset=offset)
            q = h.view(h.shape[0], h.shape[1], 2, 8)
            return self.rope(q, offset=offset)

    model = Block().eval()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(compiled(x, 3), model(x, 3), rtol=0, atol=0)
    h = (x.double() + reference_table(torch.arange(3, 8), 16)) + model.learned.pe.detach()[0, 3:8].double()
    expected = reference_rope(h.view(2, 5, 2, 8), "bshd", torch.arange(3, 8).expand(2, 5), default_inv_freq(8, 10000.0),
                              8, False)
    torch.testing.assert_close(compiled(x, 3).double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_a_parametrized_table_is_read_through_its_parametrization(cls):
    """nn.utils.parametrize turns pe into a property (it leaves _parameters/_buffers): the
    module must read the parametrized value, not fail on the dicts or use a stale table."""

    class Doubled(torch.nn.Module):
        def forward(self, table):
            return 2 * table

    m = cls(8, 0.0, max_len=16).eval()
    table = m.pe.detach().clone()
    torch.nn.utils.parametrize.register_parametrization(m, "pe", Doubled())
    x = torch.randn(2, 3, 8)
    for out in (m(x, 4), m(x, offset=4), m.forward(x, 4)):
        torch.testing.assert_close(out, x + 2 * table[:, 4:7])
