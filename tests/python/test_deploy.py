"""Deploying posenc models (issue 22): torch.export + AOTInductor, TorchScript trace and script.

The C++ side (an app that links posenc::posenc, loads an AOTInductor package and a
TorchScript trace and compares them with Python) is examples/cpp/deploy_model.cpp, run by
`make test` through tests/cpp/run_example.sh.
"""

import io
import math
import sys
import warnings
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posenc
from posenc import functional
from conftest import reference_table
from posenc._rope import SCALING_KEYS

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def serialized_text(program) -> str:
    """Every JSON file of torch.export.save's archive, concatenated."""
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        return "\n".join(z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith(".json"))


class RopeOnly(nn.Module):
    def __init__(self, scaling) -> None:
        super().__init__()
        self.rope = posenc.RotaryPositionalEncoding(16, 256, scaling=scaling)

    def forward(self, q, k):
        return self.rope(q, k)


@pytest.mark.parametrize("scaling", [None, YARN, {"rope_type": "linear", "factor": 2.0}])
def test_exported_graph_holds_no_nan(scaling):
    """JSON has no NaN: the scaling list of an exported RoPE call must not hold one (the
    AOTInductor C++ loader rejected the "NaN" strings torch writes instead)."""
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    program = torch.export.export(RopeOnly(scaling).eval(), (q, k))
    text = serialized_text(program)
    assert "posenc.rope" in text
    assert "NaN" not in text and "Infinity" not in text
    nodes = [n for n in program.graph.nodes if n.target is torch.ops.posenc.rope.default]
    assert nodes, program.graph
    for node in nodes:
        values = node.kwargs.get("scaling", node.args[8] if len(node.args) > 8 else [])
        assert all(math.isfinite(v) for v in values), values
        if scaling is None:
            assert list(values) == []  # the canonical "default": no list at all
        else:
            given = {key for key, value in scaling.items() if key in SCALING_KEYS}
            if scaling["rope_type"] == "yarn":
                given.add("original_max_position_embeddings")  # the module's max_len
            assert len(values) == 1 + len(SCALING_KEYS)
            assert values[0] == sum(1 << SCALING_KEYS.index(key) for key in given)  # presence: the mask


def test_presence_travels_in_the_mask_not_in_a_value():
    """The op's scaling list: [bitmask of the keys given, one value per key, ...]; a key not
    given is 0 and its bit is clear. No value means "not given" (issue 34: an explicit
    -sys.float_info.max was read as the in-band marker and silently replaced by the default)."""
    q = torch.randn(2, 6, 3, 32, dtype=torch.float64)
    values = [0.0] * (1 + len(SCALING_KEYS))
    for key, value in (("factor", 4.0), ("original_max_position_embeddings", 16.0)):
        values[0] += 1 << SCALING_KEYS.index(key)
        values[1 + SCALING_KEYS.index(key)] = value
    a, _ = torch.ops.posenc.rope(q, rope_type="yarn", scaling=values)
    c = functional.apply_rope(q, scaling={**YARN, "original_max_position_embeddings": 16})
    assert torch.equal(a, c)
    assert not torch.equal(a, functional.apply_rope(q))  # the scaling did something
    # A value without its bit is refused, not ignored.
    values[1 + SCALING_KEYS.index("beta_fast")] = 8.0
    with pytest.raises(ValueError, match=r"'beta_fast', which the bitmask says was not given, to be 0, got 8"):
        torch.ops.posenc.rope(q, rope_type="yarn", scaling=values)


@pytest.mark.parametrize("value", [-sys.float_info.max, -1e308, -2.0])
def test_every_value_a_user_sets_is_checked_as_a_value(value):
    """The former marker (-DBL_MAX) and its neighbour get the same error as any bad value."""
    q = torch.randn(1, 4, 2, 8)
    for key in ("beta_fast", "beta_slow"):
        with pytest.raises(ValueError, match=rf"expected rope scaling key '{key}' to be a positive number"):
            functional.apply_rope(q, scaling={**YARN, key: value})
    with pytest.raises(ValueError, match=r"expected rope scaling key 'factor' to be a positive"):
        functional.apply_rope(q, scaling={"rope_type": "linear", "factor": value})
    with pytest.raises(ValueError, match=r"expected rope scaling key 'factor' to be a positive"):
        posenc.RotaryPositionalEncoding(8, scaling={"rope_type": "linear", "factor": value})


def test_a_nan_scaling_value_is_an_error_not_a_missing_key():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"expected rope scaling key 'factor' to be finite, got nan"):
        functional.apply_rope(q, scaling={"rope_type": "linear", "factor": math.nan})
    with pytest.raises(ValueError, match=r"expected rope scaling key 'factor' to be finite, got inf"):
        functional.apply_rope(q, scaling={"rope_type": "linear", "factor": math.inf})


def test_rope_cos_sin_tables_compile_and_export():
    """rope_cos_sin's frequencies are constants of the graph (op rope_frequencies has no
    tensor input and returns a float, so it cannot be in one): fullgraph compile and export."""
    def f(q, positions):
        cos, sin = functional.rope_cos_sin(positions, 8, scaling={"rope_type": "linear", "factor": 2.0})
        return functional.apply_rope_cos_sin(q, None, cos, sin, layout="bshd")

    q, positions = torch.randn(2, 5, 3, 8), torch.randint(0, 50, (2, 5))
    want = f(q, positions)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, positions), want, rtol=0, atol=0)

    class M(nn.Module):
        def forward(self, q, positions):
            return f(q, positions)

    program = torch.export.export(M(), (q, positions))
    assert not [n for n in program.graph.nodes if "rope_frequencies" in str(n.target)]
    torch.testing.assert_close(program.module()(q, positions), want, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("scaling", [
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
    {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0], "factor": 4.0,
     "original_max_position_embeddings": 8},
], ids=["dynamic", "longrope"])
def test_rope_cos_sin_of_length_scaled_types_under_compile(scaling, dynamic):
    """"dynamic" and "longrope" scale by the call's longest position (a host read): compiled,
    the tables are made outside the graph. The second call with another length (or any
    call with dynamic=True) used to crash (a traced length fed to the constant frequencies)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda p: functional.rope_cos_sin(p, 4, scaling=scaling), dynamic=dynamic)
    for n in (6, 10, 20, 33):  # below and beyond the original 8
        positions = torch.arange(n).expand(2, n)
        for got, want in zip(compiled(positions), functional.rope_cos_sin(positions, 4, scaling=scaling)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [None, True])
def test_rope_cos_sin_number_arguments_that_change_under_compile(dynamic):
    """A dim, rotary_dim, base or scaling value passed to a compiled function and changed
    between calls (or any, with dynamic=True) becomes a symbol, which the host-side
    frequencies cannot take: an internal dynamo error ("SymNodeVariable() is not a
    constant"). Now specialised: a recompile per value, the eager tables."""
    calls = {
        "dim": (lambda p, v: functional.rope_cos_sin(p, v), (8, 12, 16)),
        "rotary_dim": (lambda p, v: functional.rope_cos_sin(p, 16, rotary_dim=v), (8, 12, 4)),
        "base": (lambda p, v: functional.rope_cos_sin(p, 8, base=v), (10000.0, 500.0, 77.5)),
        "factor": (lambda p, v: functional.rope_cos_sin(p, 8, scaling={"rope_type": "linear", "factor": v}),
                   (2.0, 3.0, 4.0)),
    }
    positions = torch.arange(7)
    for name, (fn, values) in calls.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        for v in values:
            for got, want in zip(compiled(positions, v), fn(positions, v)):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_rope_cos_sin_under_jit_trace():
    """Traced, the frequencies are constants of the trace (the op that computes them returns a
    float, which the tracer cannot record: the first trace of a configuration failed with
    "unsupported output type: float"); "dynamic" / "longrope" tables, whose scale is read
    from the positions' values, are refused (the trace fixed them at the traced positions:
    1.03 off at positions 0..29 after a trace at 0..3)."""
    fn = lambda p: functional.rope_cos_sin(p, 8, base=1234.5)  # noqa: E731  (a configuration not cached yet)
    with warnings.catch_warnings():  # the frequencies are constants of the trace, without a TracerWarning
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(fn, (torch.arange(4),))
    for got, want in zip(traced(torch.arange(30)), fn(torch.arange(30))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    with pytest.raises(RuntimeError, match=r"rope_cos_sin: 'dynamic' tables .* torch.jit.trace would fix"):
        torch.jit.trace(lambda p: functional.rope_cos_sin(p, 8, scaling=dyn), (torch.arange(4),))


class EveryOp(nn.Module):
    """Every inference op of posenc with every argument kind: strings, float and int lists,
    optional tensors (given and None), a SymInt offset from a dynamic size, per-row offsets."""

    def __init__(self) -> None:
        super().__init__()
        d = 32
        self.fixed = posenc.PositionalEncoding(d, 0.0, 128)
        self.learned = posenc.LearnedPositionalEncoding(d, 0.0, 128)
        self.rope = posenc.RotaryPositionalEncoding(8, 100, scaling=YARN)  # below the tables' 128
        self.mrope = posenc.RotaryPositionalEncoding(8, 128, sections=[1, 1, 2], sections_mode="mrope")
        self.time = posenc.Timesteps(d, flip_sin_to_cos=True, downscale_freq_shift=0.0)

    def forward(self, x, positions, offsets, t, tokens):
        batch, seq, _ = x.shape
        y = self.fixed(x, positions=positions) + self.learned(x, offset=seq // 2)
        q = y.view(batch, seq, 4, 8)
        k = y[..., :16].reshape(batch, seq, 2, 8)
        q1, k1 = self.rope(q, k, positions=positions)
        q2, k2 = self.mrope(q1, k1, positions=torch.stack([positions, positions // 2, positions % 3]))
        q3 = functional.apply_rope(q2, offset=offsets, interleaved=True, rotary_dim=4, layout="bshd")
        cos, sin = functional.rope_cos_sin(positions, 8, scaling={"rope_type": "linear", "factor": 2.0})
        q4, k4 = functional.apply_rope_cos_sin(q3, k2, cos, sin, layout="bshd")
        table = functional.sinusoidal_table(positions[0], 32)
        grid = functional.sinusoidal_2d_table(2, 4, 32, num_prefix_tokens=0)
        resampled = functional.resample_position_table(grid.unsqueeze(0), (4, 2), old_grid=(2, 4),
                                                       num_prefix_tokens=0)
        emb = self.time(t)
        made = functional.make_positions(tokens, 1)
        return q4, k4, table, resampled, emb, made


def every_op_inputs(batch, seq):
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    x = torch.randn(batch, seq, 32, generator=g)
    positions = torch.randint(0, 64, (batch, seq), generator=g)
    offsets = torch.randint(0, 32, (batch,), generator=g)
    t = torch.rand(batch, generator=g) * 1000
    tokens = torch.randint(0, 5, (batch, seq), generator=g)
    return x, positions, offsets, t, tokens


@pytest.mark.skipif(sys.platform != "linux", reason="AOTInductor's CPU compile is tested on Linux")
def test_aoti_package_runs_every_op(tmp_path, capfd):
    model = EveryOp().eval()
    example = every_op_inputs(2, 6)
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=64)
    dims = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}, {0: batch}, {0: batch, 1: seq})
    program = torch.export.export(model, example, dynamic_shapes=dims)
    assert "NaN" not in serialized_text(program)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "every_op.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    for b, s in ((2, 6), (3, 11), (1, 40)):  # other sizes than the example: dynamic shapes
        inputs = every_op_inputs(b, s)
        want = model(*inputs)
        got = loaded(*inputs)
        assert len(got) == len(want) == 6
        for g, w in zip(got[:5], want[:5]):  # the kernels are the ones eager runs
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[5], want[5])
    # A position beyond the rotary module's max_len (within the tables'): the eager module's
    # IndexError, the package's RuntimeError (it used to rotate there, unchecked).
    bad = every_op_inputs(2, 6)
    bad[1][1, 4] = 110
    with pytest.raises(IndexError, match="max_len=100"):
        model(*bad)
    capfd.readouterr()
    with pytest.raises(RuntimeError):
        loaded(*bad)
    assert "RotaryPositionalEncoding: expected positions in [0, max_len=100)" in capfd.readouterr().err  # its C++ log


@pytest.mark.cuda
def test_export_aoti_package_runs_every_op_cuda(tmp_path):
    """The CUDA half: a package compiled for CUDA (scripts/gpu_check.sh's export step)."""
    model = EveryOp().eval().cuda()
    example = tuple(t.cuda() for t in every_op_inputs(2, 6))
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=64)
    dims = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}, {0: batch}, {0: batch, 1: seq})
    program = torch.export.export(model, example, dynamic_shapes=dims)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "every_op_cuda.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    for b, s in ((2, 6), (3, 11)):
        inputs = tuple(t.cuda() for t in every_op_inputs(b, s))
        want, got = model(*inputs), loaded(*inputs)
        for g, w in zip(got[:5], want[:5]):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[5], want[5])


class AddBoth(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.fixed = posenc.PositionalEncoding(12, dropout, 50)
        self.learned = posenc.LearnedPositionalEncoding(12, dropout, 50)

    def forward(self, x):
        return self.learned(self.fixed(x), 3)


def test_jit_script_compiles_the_add_position_modules(tmp_path):
    torch.manual_seed(0)
    for module in (posenc.PositionalEncoding(12, 0.1, 50), posenc.LearnedPositionalEncoding(12, 0.1, 50)):
        keys = dict(module.state_dict())
        scripted = torch.jit.script(module).eval()
        module.eval()
        x = torch.randn(3, 7, 12)
        pos = torch.randint(0, 50, (3, 7))
        want = x + module.pe[:, :7]
        torch.testing.assert_close(scripted(x), want, rtol=0, atol=0)
        torch.testing.assert_close(scripted(x, 5), x + module.pe[:, 5:12], rtol=0, atol=0)
        torch.testing.assert_close(scripted(x, 0, pos), x + module.pe[0, pos], rtol=0, atol=0)
        assert scripted.state_dict().keys() == keys.keys()
        path = tmp_path / "m.pt"
        scripted.save(str(path))
        reloaded = torch.jit.load(str(path))
        torch.testing.assert_close(reloaded(x), want, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match=r"expected positions in \[0, max_len=50\)"):
            reloaded(x, 0, pos + 50)


def test_jit_script_keeps_dropout_and_gradients():
    torch.manual_seed(0)
    model = AddBoth(dropout=0.5)
    scripted = torch.jit.script(model)
    # Scripted from a model in training mode: it stays in training mode, every submodule too.
    assert scripted.training and all(m.training for m in scripted.modules())
    x = torch.randn(4, 9, 12, requires_grad=True)
    y = scripted(x)
    kept = y != 0
    assert 0.3 < kept.float().mean().item() < 0.7  # p = 0.5 in training
    y.sum().backward()
    # d/dx: 1/(1-p)^2 = 4 where both dropouts kept the element, else 0.
    assert scripted.learned.pe.grad is not None and scripted.learned.pe.grad.abs().sum() > 0
    assert set(x.grad.unique().tolist()) == {0.0, 4.0}
    scripted.eval()
    torch.testing.assert_close(scripted(x), x + model.fixed.pe[:, :9] + model.learned.pe[:, 3:12])


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_jit_script_of_an_eval_module_computes_what_the_eager_one_does(cls):
    """Issue 34: the scripted twin of an eval-mode module came out in training mode (half of
    its output zeroed). Scripted as the user has it, no .eval() after scripting."""
    torch.manual_seed(0)
    module = cls(16, 0.5, 32).eval()
    scripted = torch.jit.script(module)
    assert scripted.training is False
    x = torch.randn(3, 7, 16)
    want = x + module.pe.detach()[:, :7]
    torch.testing.assert_close(scripted(x), want, rtol=0, atol=0)
    torch.testing.assert_close(module(x), want, rtol=0, atol=0)


def test_jit_script_of_a_parent_leaves_the_python_model_as_it_was():
    """Issue 34: torch.jit.script put the twin from __prepare_scriptable__ into the Python
    parent, whose eval-mode child then dropped half its output."""
    torch.manual_seed(0)
    model = AddBoth(dropout=0.5).eval()
    children = {name: type(child) for name, child in model.named_children()}
    x = torch.randn(2, 9, 12)
    want = x + model.fixed.pe[:, :9] + model.learned.pe.detach()[:, 3:12]
    scripted = torch.jit.script(model)
    assert {name: type(child) for name, child in model.named_children()} == children
    assert not model.training and not model.fixed.training and not model.learned.training
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)  # the Python model, after scripting
    torch.testing.assert_close(scripted(x), want, rtol=0, atol=0)
    assert scripted.training is False and scripted.fixed.training is False


def test_jit_script_in_training_mode_draws_the_eager_masks():
    """Train mode, scripted as built: the same op, so the same generator state gives the same
    dropout mask as the eager model."""
    module = posenc.LearnedPositionalEncoding(12, 0.3, 40)
    scripted = torch.jit.script(module)
    assert scripted.training is True
    x = torch.randn(2, 6, 12)
    torch.manual_seed(5)
    eager = module(x, 4)
    torch.manual_seed(5)
    got = scripted(x, 4)
    assert torch.equal(got, eager)
    assert 0 < (got == 0).float().mean() < 1


def test_jit_script_of_rope_says_what_to_use_instead():
    with pytest.raises(RuntimeError, match=r"cannot be compiled by torch.jit.script.*torch.jit.trace.*torch.export"):
        torch.jit.script(posenc.RotaryPositionalEncoding(16))


class TraceMe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fixed = posenc.PositionalEncoding(16, 0.0, 64)
        self.rope = posenc.RotaryPositionalEncoding(8, 64, scaling=YARN)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.fixed(x).view(b, s, 2, 8)
        q, k = self.rope(q, q[:, :, :1])
        return F.silu(q).sum(-1) + k.sum(-1)


def test_jit_trace_runs_at_other_lengths():
    model = TraceMe().eval()
    traced = torch.jit.trace(model, torch.randn(2, 5, 16))
    for shape in ((2, 5, 16), (3, 17, 16), (1, 1, 16)):
        x = torch.randn(shape)
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


class DecodeStep(nn.Module):
    """A decode step whose offset is the KV cache's length, read from a shape: an int in
    eager mode, a 0-dim tensor under torch.jit.trace (PositionalEncoding baked its trace-time
    value into the graph; RoPE read it as per-row offsets and the trace failed)."""

    def __init__(self):
        super().__init__()
        self.pe = posenc.PositionalEncoding(16, 0.0, max_len=64, batch_first=True)
        self.learned = posenc.LearnedPositionalEncoding(16, 0.0, max_len=64, batch_first=True)
        self.rope = posenc.RotaryPositionalEncoding(8, 64)
        self.qk = posenc.QKNormRotary(8)

    def forward(self, x, q, cache):
        past = cache.shape[1]
        k = q[:, :, :1]
        return (self.pe(x, past), self.learned(x, past), self.rope(q, k, offset=past),
                self.qk(q, k, offset=past), functional.add_position(x, self.pe.pe, offset=past))


def test_jit_trace_reads_a_decode_offset_from_a_shape(tmp_path):
    model = DecodeStep()  # dropout 0: its training mode changes nothing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own warnings (deprecation, tensor checks)
        traced = torch.jit.trace(model, (torch.randn(2, 1, 16), torch.randn(2, 1, 2, 8), torch.randn(2, 3, 16)))
    torch.jit.save(traced, str(tmp_path / "decode.pt"))
    loaded = torch.jit.load(str(tmp_path / "decode.pt"))
    for past, seq in ((3, 1), (10, 1), (40, 5), (0, 2)):
        args = (torch.randn(2, seq, 16), torch.randn(2, seq, 2, 8), torch.randn(2, past, 16))
        want = model(*args)
        for module in (traced, loaded):
            got = module(*args)
            for g, w in zip(flatten(got), flatten(want), strict=True):
                assert torch.equal(g, w), (past, seq)
    # A float offset fed to the traced graph is refused (a cast in the graph truncated it).
    pe = posenc.PositionalEncoding(16, 0.0, max_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced_pe = torch.jit.trace(lambda x, o: pe(x, o), (torch.randn(2, 3, 16), torch.tensor(2)))
    assert torch.equal(traced_pe(torch.ones(2, 3, 16), torch.tensor(5, dtype=torch.int32)), pe(torch.ones(2, 3, 16), 5))
    with pytest.raises(RuntimeError, match="posenc: expected positions to have dtype torch.int64, got Float"):
        traced_pe(torch.ones(2, 3, 16), torch.tensor(2.7))
    # A length-scaled seq_len from shapes cannot be traced (it would be a constant): the
    # message says what to do instead.
    rope = posenc.RotaryPositionalEncoding(8, 64, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                           "original_max_position_embeddings": 8})
    with pytest.raises(TypeError, match="leave seq_len None and the op reads the call's longest position"):
        torch.jit.trace(lambda q, c: rope(q, offset=3, seq_len=c.shape[1] + q.shape[1]),
                        (torch.randn(2, 1, 2, 8), torch.randn(2, 3, 16)))


def test_tracing_refuses_sizes_that_the_graph_would_freeze():
    """A size from a shape (a 0-dim tensor under torch.jit.trace) passed where posenc's helpers
    take an int: the trace held the call's value as a constant, with no TracerWarning, and the
    traced model was silently wrong at other sizes (make_positions' offset from a cache length:
    0.063 off; grid_positions and sinusoidal_2d_table from an image's shape: 5.7 and 1.5 off).
    Refused by name; ints trace as the constants they are."""
    P = posenc.functional
    tokens = torch.tensor([[5, 6], [7, 1]])
    calls = {
        "make_positions: expected offset": lambda c: P.make_positions(tokens, 1, offset=c.shape[1]),
        "grid_positions: expected grid": lambda c: P.grid_positions(c.shape[0], c.shape[1]),
        "sinusoidal_2d_table: expected grid_h": lambda c: P.sinusoidal_2d_table(c.shape[0], c.shape[1], 8),
        "timestep_embedding: expected dim": lambda c: P.timestep_embedding(torch.arange(3.0), c.shape[1] + 5),
        "sinusoidal_table: expected d_model": lambda c: P.sinusoidal_table(torch.arange(3), c.shape[1]),
        "resample_position_table: expected new_grid": lambda c: P.resample_position_table(
            torch.randn(1, 4, 8), (c.shape[0], c.shape[0])),
        "rope_frequencies: expected seq_len": lambda c: P.rope_frequencies(
            8, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2},
            seq_len=c.shape[1])[0],
    }
    for message, call in calls.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with pytest.raises(TypeError, match=f"{message} to be an int, got a tensor under torch.jit.trace"):
                torch.jit.trace(call, (torch.zeros(2, 3),))
    # Untraced, the helpers take tensors of one element as before.
    assert torch.equal(P.make_positions(tokens, 1, offset=torch.tensor(3)), P.make_positions(tokens, 1, offset=3))


class TracedEverywhere(DecodeStep):
    """DecodeStep and every other front end a traced model calls, offsets from shapes."""

    def forward(self, x, q, cache):
        past = cache.shape[1]
        k = q[:, :, :1]
        cos, sin = functional.rope_cos_sin(torch.arange(q.shape[1]) + past, 8)
        return (*super().forward(x, q, cache), self.rope(q, k),
                functional.apply_rope(q, k, config=self.rope.rope_config),
                functional.apply_rope(q, k, offset=past, scaling={"rope_type": "yarn", "factor": 2.0,
                                                                  "original_max_position_embeddings": 16,
                                                                  "partial_rotary_factor": 0.5}),
                functional.apply_rope_cos_sin(q, k, cos, sin, layout="bshd"))


def test_jit_trace_of_every_front_end_has_no_tracer_warning():
    # The front ends' checks read sizes and numel() as ints (a check holds for the example, as
    # any Python branch of a trace): traced sizes compared in Python gave a dozen
    # TracerWarnings ("might cause the trace to be incorrect") that buried a real one.
    model = TracedEverywhere()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's own
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, (torch.randn(2, 3, 16), torch.randn(2, 3, 2, 8), torch.randn(2, 4, 16)),
                                 check_trace=False)
    # Sizes that feed an op stay traced: the graph takes other batches, lengths and offsets.
    for batch, seq, past in ((2, 3, 4), (3, 1, 9), (1, 5, 0)):
        args = (torch.randn(batch, seq, 16), torch.randn(batch, seq, 2, 8), torch.randn(batch, past, 16))
        for got, want in zip(flatten(traced(*args)), flatten(model(*args)), strict=True):
            assert torch.equal(got, want), (batch, seq, past)

def test_a_zero_dim_offset_tensor_is_every_sequences_offset():
    q, k = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 1, 8)
    for layout, qq, kk in (("bshd", q, k), ("bhsd", q.transpose(1, 2), k.transpose(1, 2))):
        got = functional.apply_rope(qq, kk, offset=torch.tensor(7), layout=layout)
        want = functional.apply_rope(qq, kk, offset=7, layout=layout)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    packed, cu = torch.randn(9, 2, 8), torch.tensor([0, 4, 9])
    got = functional.apply_rope(packed, offset=torch.tensor(5), layout="thd", cu_seqlens=cu)
    assert torch.equal(got, functional.apply_rope(packed, offset=torch.tensor([5, 5]), layout="thd", cu_seqlens=cu))
    # The modules' range check reads it as the int it stands for.
    rope = posenc.RotaryPositionalEncoding(8, 16)
    assert all(torch.equal(g, w) for g, w in zip(rope(q, k, offset=torch.tensor(5)), rope(q, k, offset=5)))
    with pytest.raises(IndexError, match=r"positions in \[0, max_len=16\), found 103"):
        rope(q, k, offset=torch.tensor(100))
    # A traced size as rope_frequencies' seq_len would make its frequencies constants: refused.
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    with pytest.raises(TypeError, match="rope_frequencies: expected seq_len to be an int, got a tensor under "
                                        "torch.jit.trace"):
        torch.jit.trace(lambda x: functional.rope_frequencies(16, scaling=dynamic, seq_len=x.shape[0])[0],
                        (torch.randn(4),))
    with torch.device("meta"):  # float64 on the CPU, as documented, whatever the default device
        assert functional.rope_frequencies(16)[0].device.type == "cpu"


def test_jit_script_reads_a_later_padding_idx_as_the_constructor_does():
    """padding_idx set on a scripted LearnedPositionalEncoding (no __setattr__ there): -1 is the
    last row, frozen, as in the eager module (the scripted one froze no row); out of range is
    refused by a call that freezes the row (it was taken: no row frozen)."""
    eager = posenc.LearnedPositionalEncoding(4, 0.0, 10, padding_idx=2)
    scripted = torch.jit.script(eager)
    x = torch.randn(1, 10, 4)
    for m in (eager, scripted):
        m.padding_idx = -1
        m(x).sum().backward()
        grad = dict(m.named_parameters())["pe"].grad
        assert torch.count_nonzero(grad[0, -1]) == 0 and torch.count_nonzero(grad[0, :-1]) == 9 * 4
    scripted.padding_idx = 50
    with pytest.raises(Exception, match=r"expected padding_idx in \[-max_len, max_len\) = \[-10, 10\), got 50"):
        scripted(x)


def test_jit_script_of_timesteps_and_qk_norm_rotary():
    """Timesteps scripts (its scripted branch calls the op the function calls, with the same
    numbers); QKNormRotary cannot (keyword-only arguments) and says what to do instead."""
    t = torch.tensor([0.0, 1.5, 999.0, 37.25])
    import numpy as np

    for args in ((8, True, 0.0), (9, False, 1.0, 2.5, 500), (np.int64(10), np.bool_(True), np.float32(0.5))):
        module = posenc.Timesteps(*args)  # numpy numbers (a config read with numpy) too
        scripted = torch.jit.script(module)
        assert torch.equal(scripted(t), module(t))
    # diffusers' int arguments (scale=1, max_period=10000, a shift of 1): the settings are read at
    # each call, and a float set later is taken by the scripted module as by the eager one (an
    # int attribute refused it: "Could not cast attribute 'scale' to type int").
    module = posenc.Timesteps(8, True, 1)
    scripted = torch.jit.script(module)
    for m in (module, scripted):
        m.scale, m.max_period, m.downscale_freq_shift = 0.5, 500.5, 0.25
    assert torch.equal(scripted(t), module(t)) and torch.equal(
        module(t), posenc.functional.timestep_embedding(t, 8, flip_sin_to_cos=True, downscale_freq_shift=0.25,
                                                        scale=0.5, max_period=500.5))
    with pytest.raises(RuntimeError, match="posenc: QKNormRotary cannot be compiled by torch.jit.script .* "
                                           "torch.jit.trace"):
        torch.jit.script(posenc.QKNormRotary(8))


def flatten(value):
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in flatten(v)]


class TablesInEveryDtype(nn.Module):
    """sinusoidal_table and sinusoidal_2d_table in each floating dtype (issue 34: with torch
    2.11's AOTInductor a ScalarType argument of a custom op came back as a None output)."""

    def forward(self, positions):
        out = []
        for dtype in TABLE_DTYPES:
            out.append(functional.sinusoidal_table(positions, 16, dtype=dtype))
            out.append(functional.sinusoidal_2d_table(2, 3, 16, num_prefix_tokens=1, dtype=dtype))
        return tuple(out)


TABLE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@pytest.mark.skipif(sys.platform != "linux", reason="AOTInductor's CPU compile is tested on Linux")
def test_aoti_package_returns_tables_in_every_dtype(tmp_path):
    model = TablesInEveryDtype()
    positions = torch.arange(5) * 7
    program = torch.export.export(model, (positions,))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "tables.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    got = loaded(positions)
    want = model(positions)
    assert len(got) == len(want) == 2 * len(TABLE_DTYPES)
    exact = reference_table(positions, 16)  # float64, from the formula
    for i, dtype in enumerate(TABLE_DTYPES):
        table, grid = got[2 * i], got[2 * i + 1]
        assert isinstance(table, torch.Tensor) and isinstance(grid, torch.Tensor), (dtype, table, grid)
        assert table.dtype == grid.dtype == dtype
        assert torch.equal(table, want[2 * i])  # posenc's kernel, then one cast
        tol = {torch.float64: 1e-12, torch.float32: 1e-7, torch.bfloat16: 4e-3, torch.float16: 5e-4}[dtype]
        # sinusoidal_2d_table is made of ATen ops, which Inductor compiles with its own sin/cos.
        torch.testing.assert_close(grid.double(), want[2 * i + 1].double(), rtol=0, atol=tol)
        torch.testing.assert_close(table.double(), exact, rtol=0, atol=tol)  # rounded once
