"""The modules' one road (issue 35): a module's forward calls the function users call
(posenc.functional), which calls torch.ops.posenc; everything nn.Module.__call__ does
happens (hooks, profiler events, jit scopes), and what torch's tools see is what ran
(issue 34: the profiler's memory view and module events). Values against the float64
formulas."""
import dataclasses
import json
import pickle

import pytest
import torch

import posenc
from posenc import functional
from posenc._rope import _CONFIG_DEFAULTS
from conftest import reference_table
from rope_reference import default_inv_freq, reference_rope

OP = torch.ops.posenc.add_position
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("shape,offset", [((1, 1, 512), 100), ((3, 7, 10), 0), ((2, 5, 33), 91), ((0, 4, 6), 3)])
def test_eval_values(dtype, batch_first, shape, offset):
    gen = torch.Generator().manual_seed(hash((str(dtype), batch_first, shape)) % 2**31)
    b, s, d = shape
    x = torch.randn(b, s, d, generator=gen, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    m = posenc.LearnedPositionalEncoding(d, 0.1, max_len=128, batch_first=batch_first).to(dtype).eval()
    table = m.pe.detach()
    xd = x.to(dtype)
    out = m(xd, offset)
    rows = table[0, offset:offset + s].double()
    expected = xd.double() + (rows.unsqueeze(0) if batch_first else rows.unsqueeze(1))
    assert out.dtype == dtype and out.shape == xd.shape
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL[dtype])  # one rounding of the sum
    assert torch.equal(out, OP(xd, table, None, offset, batch_first, 0.0))


def test_sinusoidal_module_against_the_formula():
    torch.manual_seed(0)
    pe = posenc.PositionalEncoding(24, 0.1, max_len=300).eval()
    x = torch.randn(2, 5, 24, dtype=torch.float64).float()
    out = pe(x, offset=250)
    expected = x.double() + reference_table(torch.arange(250, 255), 24)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-6)


def test_dropout_bits_match_torch_ops():
    """Same generator state, same mask: the module calls the same op (its Philox offset)."""
    m = posenc.LearnedPositionalEncoding(16, 0.3, max_len=64)  # training mode, as built
    x = torch.randn(3, 9, 16)
    torch.manual_seed(123)
    got = m(x, 5)
    torch.manual_seed(123)
    boxed = OP(x, m.pe.detach(), None, 5, True, 0.3)
    assert torch.equal(got, boxed)
    kept = got != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(got[kept], ((x + m.pe.detach()[:, 5:14]) / 0.7)[kept])


def counting(monkeypatch):
    """Records the offset of each call of posenc.functional.add_position (the function the
    modules' forward calls) and forwards it."""
    calls = []
    original = functional.add_position

    def record(*args, **kwargs):
        calls.append(kwargs.get("offset"))
        return original(*args, **kwargs)

    monkeypatch.setattr(functional, "add_position", record)
    return calls


def test_learned_module_trains_through_the_function(monkeypatch):
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
    with pytest.raises(ValueError, match="plus offset 7 exceeds max_len=10"):
        posenc.PositionalEncoding(8, 0.0, max_len=10).eval()(x, offset=7)
    with pytest.raises(TypeError, match="expected offset to be an int, got True"):
        posenc.PositionalEncoding(8, 0.0, max_len=10)(x, offset=True)


# ---- Everything nn.Module.__call__ does happens: the modules have no __call__ of their own.

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
    assert calls == [0 if "positions" in call else offset]  # every form through the one function
    assert "__call__" not in type(m).__dict__ and "__call__" not in posenc._add_position._AddPositionModule.__dict__


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
    assert calls == [2]
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


def test_jit_trace_records_the_op_in_the_module_scope():
    x = torch.randn(1, 4, 8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = posenc.PositionalEncoding(8, 0.0, 16).eval()

        def forward(self, x):
            return self.pos(x, 2)

    traced = torch.jit.trace(Net().eval(), x)
    nodes = [n for n in traced.inlined_graph.nodes() if n.kind() == "posenc::add_position"]
    assert len(nodes) == 1 and "pos" in nodes[0].scopeName()
    x2 = torch.randn(1, 4, 8)
    torch.testing.assert_close(traced(x2).double(), expected_eval(x2, 2), rtol=0, atol=1e-6)


# ---- The RoPE module: the same road (apply_rope, then the op).

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
    rope = posenc.RotaryPositionalEncoding(64, 128, base=base, rotary_dim=rotary_dim, interleaved=interleaved,
                                           layout=layout)
    out = rope(q, k, offset=17)
    out_q, out_k = out if with_k else (out, None)
    boxed_q, boxed_k = torch.ops.posenc.rope(q, k, offset=17, base=base, rotary_dim=rotary_dim,
                                             interleaved=interleaved, layout=layout)
    assert torch.equal(out_q, boxed_q)
    pos = torch.arange(17, 20).expand(2, 3)
    inv = default_inv_freq(rotary_dim, base)
    atol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out_q.double(), reference_rope(q, layout, pos, inv, rotary_dim, interleaved),
                               rtol=0, atol=atol)
    if with_k:
        assert torch.equal(out_k, boxed_k)
        torch.testing.assert_close(out_k.double(), reference_rope(k, layout, pos, inv, rotary_dim, interleaved),
                                   rtol=0, atol=atol)


def test_rope_module_gives_the_formula():
    rope = posenc.RotaryPositionalEncoding(64, base=500000.0, rotary_dim=32, interleaved=True, layout="bhsd")
    q, k = torch.randn(1, 8, 1, 64, dtype=torch.float64), torch.randn(1, 2, 1, 64, dtype=torch.float64)
    out_q, out_k = rope(q, k, offset=100)
    only_q = rope(q, offset=101)
    inv = default_inv_freq(32, 500000.0)
    torch.testing.assert_close(out_q, reference_rope(q, "bhsd", torch.tensor([[100]]), inv, 32, True))
    torch.testing.assert_close(out_k, reference_rope(k, "bhsd", torch.tensor([[100]]), inv, 32, True))
    torch.testing.assert_close(only_q, reference_rope(q, "bhsd", torch.tensor([[101]]), inv, 32, True))


def test_rope_gradients():
    torch.manual_seed(3)
    q = torch.randn(1, 3, 2, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 16, dtype=torch.float64, requires_grad=True)
    rope = posenc.RotaryPositionalEncoding(16)
    assert torch.autograd.gradcheck(lambda a, b: rope(a, b, offset=5), (q, k))
    out = rope(q, k, offset=5)
    grads = torch.autograd.grad(out[0].sum() + 2 * out[1].sum(), (q, k))
    boxed = torch.ops.posenc.rope(q, k, offset=5)
    expected = torch.autograd.grad(boxed[0].sum() + 2 * boxed[1].sum(), (q, k))
    assert torch.equal(grads[0], expected[0]) and torch.equal(grads[1], expected[1])


def test_compile_fullgraph_of_a_model_that_holds_the_modules():
    """Dynamo traces the modules' forward, the functions and the ops: no break."""
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


# ---- What torch's tools see (issue 34, item 6).

def test_the_profiler_sees_every_byte_of_a_large_output():
    """A 32 MiB output came from a private block cache the profiler never saw (0 bytes for
    posenc::rope): now every byte is allocated inside the op, where the profiler counts it."""
    q = torch.randn(4, 1024, 16, 128)  # 32 MiB
    k = torch.randn(4, 1024, 4, 128)
    for _ in range(2):  # a second call: the first call's freed outputs were there to be reused
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out_q, out_k = torch.ops.posenc.rope(q, k, offset=3)
        (rope,) = [e for e in prof.key_averages() if e.key == "posenc::rope"]
        assert rope.cpu_memory_usage == out_q.nbytes + out_k.nbytes
        del out_q, out_k


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_module_traces_show_the_module(cls, tmp_path):
    """The profiler's Python tracer records nn.Module calls (with_stack): the add-position
    modules' former __call__ shortcut bypassed nn.Module.__call__, so no event named them."""
    m = cls(8, 0.1, max_len=16).eval()
    x = torch.randn(2, 5, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                with_modules=True) as prof:
        m(x, 3)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert f"nn.Module: {cls.__name__}_0" in names, sorted(n for n in names if n and "Module" in n)
    assert "posenc::add_position" in names


# ---- Parse once (issue 35): a RoPE configuration is parsed into one immutable RopeConfig,
# which the modules build in __init__ and pass on.

def test_rope_modules_parse_their_configuration_once(monkeypatch):
    scaling = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
               "original_max_position_embeddings": 64}
    rope = posenc.RotaryPositionalEncoding(32, max_len=256, scaling=scaling)
    qkn = posenc.QKNormRotary(32, scaling=scaling, dtype=torch.float64)
    q, k = torch.randn(2, 5, 4, 32, dtype=torch.float64), torch.randn(2, 5, 2, 32, dtype=torch.float64)
    want = rope(q, k, offset=7)
    want_qkn = qkn(q, k, offset=7)

    def no_parsing(*args, **kwargs):
        raise AssertionError("parsed again at call time")

    from posenc import _rope
    monkeypatch.setattr(_rope, "resolve_config_keys", no_parsing)
    monkeypatch.setattr(_rope, "scaling_arguments", no_parsing)
    got = rope(q, k, offset=7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got_qkn = qkn(q, k, offset=7)
    assert torch.equal(got_qkn[0], want_qkn[0])
    monkeypatch.undo()
    # The same numbers as the keywords, parsed per call by the function.
    keywords = functional.apply_rope(q, k, offset=7, scaling=scaling)
    assert torch.equal(want[0], keywords[0]) and torch.equal(want[1], keywords[1])
    c = rope.rope_config
    assert (c.base, c.rotary_dim, c.rope_type) == (500000.0, 16, "yarn")
    assert (rope.base, rope.rotary_dim, rope.layout) == (500000.0, 16, "bshd")


def test_a_parsed_configuration_is_immutable_and_given_once():
    rope = posenc.RotaryPositionalEncoding(16)
    with pytest.raises(AttributeError):
        rope.base = 500.0  # a setting is the parsed configuration's: build a new module
    with pytest.raises(AttributeError):  # dim too (a plain attribute: 8 made the module refuse its 16-wide q)
        rope.dim = 8
    assert rope.dim == 16 and rope(torch.randn(1, 2, 1, 16)).shape == (1, 2, 1, 16)
    qkn = posenc.QKNormRotary(16, norm="hidden", num_heads=2, num_kv_heads=1)
    with pytest.raises(AttributeError):  # QKNormRotary's head_dim too (set to 8, repr said num_heads=4)
        qkn.head_dim = 8
    assert qkn.head_dim == 16 and "head_dim=16, " in repr(qkn) and "num_heads=2, num_kv_heads=1" in repr(qkn)
    with pytest.raises(Exception, match="cannot assign|frozen"):
        rope.rope_config.base = 500.0
    # The configuration itself is set once: reassigned, the module rotated with the new one and
    # kept the old attention factor, rotary width and scaling in its checks and repr.
    yarn = functional.RopeConfig.parse(head_dim=16, scaling={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 8})
    for module in (rope, qkn):
        with pytest.raises(AttributeError, match=f"{type(module).__name__}: rope_config is read-only"):
            module.rope_config = yarn
        assert module.rope_config.rope_type == "default"
    assert rope.attention_scaling == 1.0 and pickle.loads(pickle.dumps(rope)).rope_config == rope.rope_config
    config = functional.RopeConfig.parse(head_dim=16, base=500.0, interleaved=True)
    q = torch.randn(1, 3, 2, 16, dtype=torch.float64)
    assert torch.equal(functional.apply_rope(q, config=config), functional.apply_rope(q, base=500.0, interleaved=True))
    with pytest.raises(ValueError, match="got config and base, interleaved; pass the configuration once"):
        functional.apply_rope(q, config=config, base=500.0, interleaved=True)
    with pytest.raises(TypeError, match="expected config to be a posenc RopeConfig"):
        functional.apply_rope(q, config={"base": 500.0})


@pytest.mark.parametrize("head_dim", [0, 16, 128])
def test_the_default_configuration_is_the_parsed_one(head_dim):
    """A call without RoPE keywords takes the defaults directly (no parsing): the same
    configuration, down to the op's keyword arguments, as every keyword given as None."""
    fast = functional.RopeConfig.parse(head_dim=head_dim)
    parsed = functional.RopeConfig.parse(head_dim=head_dim, **_CONFIG_DEFAULTS)  # every keyword, None
    assert fast == parsed and fast.op_kwargs == parsed.op_kwargs == ()
    assert dataclasses.asdict(fast) == dataclasses.asdict(parsed)
    assert vars(fast) == vars(parsed) and type(fast) is type(parsed)  # the whole state, op_kwargs included


def test_modules_pickled_before_the_parsed_configuration_still_load():
    """The state a RotaryPositionalEncoding / QKNormRotary pickled by the previous posenc
    had (its settings as attributes, or a rope_options dict) loads into a RopeConfig, with
    the same numbers."""
    import pickle

    scaling = {"rope_type": "linear", "factor": 2.0}
    rope = posenc.RotaryPositionalEncoding(16, max_len=64, scaling=scaling, interleaved=True, rotary_dim=8)
    state = dict(rope.__dict__)
    del state["rope_config"], state["_scaling"]
    state["max_len"], state["attention_scaling"] = state.pop("_max_len"), state.pop("_attention_scaling")
    state.update(dim=16, base=10000.0, interleaved=True, rotary_dim=8, layout="bshd", sections=None,
                 sections_mode="axial", scaling=dict(scaling))  # dim: an attribute before 2026-12-07 too
    old = posenc.RotaryPositionalEncoding.__new__(posenc.RotaryPositionalEncoding)
    old.__setstate__(state)
    q = torch.randn(1, 4, 2, 16, dtype=torch.float64)
    assert torch.equal(old(q, offset=3), rope(q, offset=3))
    assert old.rope_config == rope.rope_config
    qkn = posenc.QKNormRotary(16, interleaved=True, dtype=torch.float64)
    state = dict(qkn.__dict__, head_dim=16)  # head_dim: an attribute before 2026-12-07
    del state["rope_config"]
    state["rope_options"] = dict(base=None, interleaved=True, rotary_dim=None, scaling=None, layout="bshd",
                                 sections=None, sections_mode="axial")
    old = posenc.QKNormRotary.__new__(posenc.QKNormRotary)
    old.__setstate__(state)
    assert torch.equal(old(q, q)[0], qkn(q, q)[0])
    assert "head_dim" not in old.__dict__ and old.head_dim == 16
    old = posenc.QKNormRotary.__new__(posenc.QKNormRotary)
    old.__setstate__(dict(qkn.__dict__, head_dim=16))  # the parsed configuration and head_dim
    assert "head_dim" not in old.__dict__ and old.head_dim == 16 and torch.equal(old(q, q)[1], qkn(q, q)[1])
    again = pickle.loads(pickle.dumps(rope))  # today's pickles round-trip
    assert again.rope_config == rope.rope_config and torch.equal(again(q), rope(q))
    state = dict(rope.__dict__, dim=16)  # pickled with dim as an attribute (before 2026-12-07)
    old = posenc.RotaryPositionalEncoding.__new__(posenc.RotaryPositionalEncoding)
    old.__setstate__(state)
    assert "dim" not in old.__dict__ and old.dim == 16 and torch.equal(old(q), rope(q))
    from collections.abc import Mapping

    assert isinstance(rope.scaling, Mapping) and rope.scaling["factor"] == 2.0
    with pytest.raises(TypeError, match="does not support item assignment"):
        rope.scaling["factor"] = 8.0  # a read-only view: the edit cannot be silently dropped
    assert rope.scaling["factor"] == 2.0
    assert rope.sections is None and posenc.RotaryPositionalEncoding(16, sections=[2, 2]).sections == (2, 2)


def test_settings_derived_from_once_are_read_only():
    """max_len and attention_scaling of RotaryPositionalEncoding, base of PositionalEncoding
    were writable attributes that forward ignored (longrope's factor and yarn's baseline
    came from max_len at construction: an edited max_len rotated 0.8-6.7 away from a module
    built with it; an edited base left pe as it was). Assigning one is now an
    AttributeError; old pickles load."""
    rope = posenc.RotaryPositionalEncoding(8, max_len=16, scaling={"rope_type": "yarn", "factor": 4.0})
    pe = posenc.PositionalEncoding(8, 0.1, 16, base=500.0)
    for module, name, value in ((rope, "max_len", 64), (rope, "attention_scaling", 2.0), (pe, "base", 100.0)):
        before = getattr(module, name)
        with pytest.raises(AttributeError, match=name):
            setattr(module, name, value)
        assert getattr(module, name) == before
    state = dict(pe.__dict__)
    state["base"] = state.pop("_base")  # as pickled before
    old = posenc.PositionalEncoding.__new__(posenc.PositionalEncoding)
    old.__setstate__(state)
    assert old.base == 500.0 and "base=500.0" in repr(old)
    again = pickle.loads(pickle.dumps(rope))
    assert (again.max_len, again.attention_scaling) == (16, rope.attention_scaling) and rope.attention_scaling > 1


def test_a_config_belongs_to_its_head_dim_and_is_given_once():
    config = functional.RopeConfig.parse(head_dim=64, scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    assert config.rotary_dim == 32
    with pytest.raises(ValueError, match=r"expected q with head_dim 64 \(the config's\)"):
        functional.apply_rope(torch.randn(1, 2, 1, 128), config=config)
    bhsd = functional.RopeConfig.parse(head_dim=64, layout="bhsd")
    with pytest.raises(ValueError, match="got config and layout"):  # even the default value is a second statement
        functional.apply_rope(torch.randn(1, 2, 1, 64), config=bhsd, layout="bshd")
