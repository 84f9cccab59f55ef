"""Bad input: every case raises an error that names the argument and what was expected."""
import pytest
import torch

import posenc
from posenc.functional import add_position


# The fixed and the learned encodings share their front end (_AddPositionModule) and the
# C++ op, hence their argument checks and messages: every module-level case runs on both.
MODULES = [
    pytest.param(posenc.PositionalEncoding, id="sinusoidal"),
    pytest.param(posenc.LearnedPositionalEncoding, id="learned"),
]


@pytest.fixture(params=MODULES)
def module_cls(request):
    return request.param


@pytest.fixture
def pe(module_cls):
    return module_cls(16, 0.1, 32)


def test_x_not_3d(pe, module_cls):
    with pytest.raises(RuntimeError, match=r"x to be a 3-D tensor .*got a 2-D tensor"):
        pe(torch.randn(5, 16))
    with pytest.raises(RuntimeError, match=r"seq, batch, d_model\) with batch_first=False"):
        module_cls(16, batch_first=False)(torch.randn(2, 3, 4, 16))


def test_last_dim_not_d_model(pe):
    with pytest.raises(RuntimeError, match=r"last dimension of x \(d_model\) to be 16.*\[2, 3, 15\]"):
        pe(torch.randn(2, 3, 15))


def test_sequence_plus_offset_beyond_max_len(pe):
    with pytest.raises(ValueError, match=r"sequence length 33 plus offset 0 exceeds max_len=32"):
        pe(torch.randn(1, 33, 16))
    with pytest.raises(ValueError, match=r"sequence length 10 plus offset 30 exceeds max_len=32"):
        pe(torch.randn(1, 10, 16), offset=30)
    with pytest.raises(ValueError, match=r"offset >= 0, got -1"):
        pe(torch.randn(1, 10, 16), offset=-1)


def test_positions_wrong_dtype_shape_range(pe):
    x = torch.randn(2, 5, 16)
    with pytest.raises(TypeError, match=r"positions to have dtype torch.int64, got Float"):
        pe(x, positions=torch.arange(5.0))
    with pytest.raises(RuntimeError, match=r"positions of shape \(seq,\) = \(5,\) or \(batch, seq\) = \(2, 5\), got shape \[4\]"):
        pe(x, positions=torch.arange(4))
    with pytest.raises(IndexError, match=r"positions in \[0, max_len=32\), found 32"):
        pe(x, positions=torch.tensor([0, 1, 2, 3, 32]))
    with pytest.raises(IndexError, match=r"found -1"):
        pe(x, positions=torch.tensor([0, 1, -1, 3, 4]))
    with pytest.raises(ValueError, match=r"either offset or positions"):
        pe(x, offset=2, positions=torch.arange(5))


@pytest.mark.parametrize("value", [0, 2])
def test_a_tensor_offset_beside_positions_is_refused_on_every_road(pe, value):
    """A tensor offset beside positions: a ValueError in eager mode, under torch.compile and
    torch.export alike (compiled, it reached the op's int offset: a crash inside the backend,
    and eager took tensor(0) that compiled code cannot read; found by an audit)."""
    x, positions, offset = torch.randn(2, 5, 16), torch.arange(5), torch.tensor(value)
    match = r"either offset or positions, not both \(got a tensor offset beside positions"
    with pytest.raises(ValueError, match=match):
        pe(x, offset=offset, positions=positions)
    with pytest.raises(ValueError, match=match):
        posenc.functional.add_position(x, pe.pe, offset=offset, positions=positions)
    compiled = torch.compile(lambda a, o, p: pe(a, offset=o, positions=p), backend="aot_eager")
    with pytest.raises(Exception, match=match):
        compiled(x, offset, positions)

    class Call(torch.nn.Module):
        def forward(self, a, o, p):
            return pe(a, offset=o, positions=p)

    with pytest.raises(Exception, match=match):
        torch.export.export(Call(), (x, offset, positions))


@pytest.mark.cuda
def test_positions_on_another_device_and_cuda_range(module_cls):
    pe = module_cls(16, 0.1, 32).cuda()
    x = torch.randn(2, 5, 16, device="cuda")
    with pytest.raises(RuntimeError, match=r"positions on x's device cuda:0, got positions on cpu"):
        pe(x, positions=torch.arange(5))
    with pytest.raises(IndexError, match=r"positions in \[0, max_len=32\)"):
        pe(x, positions=torch.tensor([0, 1, 2, 3, 99], device="cuda"))
    # Unchecked on the host, the kernel's device-side assert stops the call instead
    # (test_cuda_device_asserts.py, in a process of its own).
    # A 2-D (max_len, d) table put in place of pe: the host check reads its max_len (it read
    # pe.shape[1], d: a false IndexError for valid positions >= d).
    with torch.no_grad():
        pe.pe = torch.nn.Parameter(torch.randn(40, 16, device="cuda")) if module_cls is posenc.LearnedPositionalEncoding \
            else torch.randn(40, 16, device="cuda")
    out = pe.eval()(x, positions=torch.arange(30, 35, device="cuda"))
    torch.testing.assert_close(out, x + pe.pe[30:35])


def test_integer_x(pe):
    with pytest.raises(TypeError, match=r"x to have a floating-point dtype .*got Long"):
        pe(torch.ones(2, 3, 16, dtype=torch.long))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), 10**400])  # an int past float's range: a value, not a type
def test_dropout_outside_unit_interval(module_cls, p):
    with pytest.raises(ValueError, match=r"dropout to be a probability in \[0, 1\]"):
        module_cls(16, p)
    with pytest.raises(ValueError, match=r"dropout probability p in \[0, 1\]"):
        add_position(torch.randn(1, 2, 4), torch.randn(5, 4), p=p)


@pytest.mark.parametrize("kw, error", [({"d_model": 0}, ValueError), ({"d_model": -4}, ValueError),
                                        ({"max_len": 0}, ValueError), ({"d_model": 2.5}, TypeError),
                                        ({"max_len": "8"}, TypeError), ({"d_model": True}, TypeError)])
def test_d_model_and_max_len_positive(module_cls, kw, error):
    """A value <= 0 is a ValueError, another type a TypeError (torch's convention: nn.Linear(2.5, 3))."""
    args = {"d_model": 8, "dropout": 0.1, "max_len": 10, **kw}
    name = next(iter(kw))
    with pytest.raises(error, match=rf"{module_cls.__name__}: expected {name} to be a positive integer, got {kw[name]!r}"):
        module_cls(**args)
    # The same check through the positional arguments (d_model, dropout, max_len).
    with pytest.raises(error, match=rf"expected {name} to be a positive integer, got {kw[name]!r}"):
        module_cls(args["d_model"], args["dropout"], args["max_len"])


@pytest.mark.parametrize("p", ["0.1", None, True, torch.tensor(0.1)])
def test_dropout_of_another_type(module_cls, p):
    with pytest.raises(TypeError, match=rf"{module_cls.__name__}: expected dropout to be a probability in \[0, 1\]"):
        module_cls(16, p)


def test_table_shape_and_device_mismatch():
    with pytest.raises(RuntimeError, match=r"table to have shape \(max_len, d_model\) or \(1, max_len, d_model\)"):
        add_position(torch.randn(1, 2, 4), torch.randn(2, 5, 4))


@pytest.mark.cuda
def test_x_on_cuda_and_module_on_cpu(module_cls):
    pe = module_cls(16, 0.1, 32)
    with pytest.raises(RuntimeError, match=r"x and the position table on the same device, got x on cuda:0 and the table on cpu"):
        pe(torch.randn(2, 3, 16, device="cuda"))


def test_x_and_table_on_different_devices_meta(module_cls):
    # Device mismatch without a GPU: the meta device stands in for a second device.
    pe = module_cls(16, 0.1, 32)
    with pytest.raises(RuntimeError, match=r"same device, got x on meta and the table on cpu"):
        pe(torch.randn(2, 3, 16, device="meta"))


def test_positions_on_another_device_meta(module_cls):
    pe = module_cls(16, 0.1, 32)
    with pytest.raises(RuntimeError, match=r"positions on x's device cpu, got positions on meta"):
        pe(torch.randn(2, 5, 16), positions=torch.arange(5, device="meta"))


def test_backward_rejects_bad_rng():
    with pytest.raises(RuntimeError, match=r"rng to be the int64 \(seed, offset\) pair"):
        torch.ops.posenc.add_position_backward(torch.randn(2, 3), torch.zeros(3, dtype=torch.long), 0.5)


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63 - 2, 2**62])
def test_huge_offset_is_refused_not_wrapped(module_cls, offset):
    """offset + seq would wrap around int64 and pass a naive range check (then read
    before the table, or corrupt the heap in backward)."""
    pe = module_cls(8, 0.0, 10)
    with pytest.raises(ValueError, match=rf"sequence length 2 plus offset {offset} exceeds max_len=10"):
        pe(torch.randn(1, 2, 8), offset=offset)
    with pytest.raises(ValueError, match=rf"plus offset {offset} exceeds max_len=4"):
        torch.ops.posenc.add_position_backward_with_table(
            torch.ones(1, 2, 8), torch.empty(0, dtype=torch.long), None, offset, True, 0.0, 4, False)


@pytest.mark.parametrize("p", [-0.5, 1.5, float("inf"), float("nan")])
def test_backward_ops_check_p(p):
    grad, rng = torch.ones(2, 4, 8), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"expected dropout probability p in \[0, 1\], got"):
        torch.ops.posenc.add_position_backward(grad, rng, p)
    with pytest.raises(ValueError, match=r"expected dropout probability p in \[0, 1\], got"):
        torch.ops.posenc.add_position_backward_with_table(grad, rng, None, 0, True, p, 4, True)
    with pytest.raises(ValueError, match=r"expected dropout probability p in \[0, 1\], got"):
        torch.ops.posenc.add_position_backward(grad.to("meta"), rng.to("meta"), p)


def test_backward_table_len_is_checked():
    ops = torch.ops.posenc
    with pytest.raises(ValueError, match=r"table_len 4611686018427387904 times d_model 8 overflows int64"):
        ops.add_position_backward_with_table(torch.ones(1, 2, 8), torch.empty(0, dtype=torch.long), None, 0,
                                             True, 0.0, 2**62, False)
    with pytest.raises(ValueError, match=r"expected table_len >= 0, got -1"):
        ops.add_position_backward_with_table(torch.ones(1, 2, 8, device="meta"),
                                             torch.empty(0, dtype=torch.long, device="meta"), None, 0, True,
                                             0.0, -1, False)


def test_a_meta_tensor_among_real_ones_is_refused():
    """One meta argument sends the call to the Meta kernel: without a check, real inputs
    would get an uninitialised real output back."""
    ops = torch.ops.posenc
    meta_rng = torch.empty(2, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match=r"add_position_backward: got rng on the meta device but grad on cpu"):
        ops.add_position_backward(torch.ones(8, 16), meta_rng, 0.5)
    with pytest.raises(RuntimeError, match=r"got rng on the meta device but grad on cpu"):
        ops.add_position_backward_with_table(torch.ones(4, 8, 16), meta_rng, None, 0, True, 0.0, 8, True)
    with pytest.raises(RuntimeError, match=r"expected offsets on q.s device cpu, got offsets on meta"):
        ops.rope(torch.ones(2, 3, 1, 4), None, None, torch.zeros(2, dtype=torch.long, device="meta"))
    with pytest.raises(TypeError, match=r"expected integer or floating-point positions, got ComplexFloat"):
        ops.sinusoidal_table(torch.zeros(3, device="meta", dtype=torch.complex64), 4, 10000.0)
    # The Meta kernel runs the real kernels' checks when sizes are concrete.
    with pytest.raises(TypeError, match=r"expected grad to have a floating-point dtype .* got Bool"):
        ops.add_position_backward_with_table(torch.empty(5, 6, 1, dtype=torch.bool, device="meta"), meta_rng,
                                             None, 0, True, 0.5, 8, False)
    with pytest.raises(ValueError, match=r"plus offset 4611686018427387904 exceeds max_len=8"):
        ops.add_position_backward_with_table(torch.ones(5, 6, 1, device="meta"), meta_rng, None, 2**62, True,
                                             0.5, 8, False)
    # All-meta calls still infer shapes.
    gx, gt = ops.add_position_backward_with_table(torch.ones(4, 8, 16, device="meta"), meta_rng, None, 0,
                                                  True, 0.5, 8, True)
    assert gx.shape == (4, 8, 16) and gt.shape == (8, 16) and gx.is_meta


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), (True, TypeError), ("x", TypeError),
                                        (None, TypeError)])
def test_sinusoidal_base_must_be_a_finite_number_above_one(bad, error):
    with pytest.raises(error, match=r"PositionalEncoding: expected base to be a finite number > 1, got"):
        posenc.PositionalEncoding(16, 0.1, 32, base=bad)


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_sinusoidal_base_at_most_one_is_rejected(bad):
    """base <= 1 gives frequencies base**(-2i/d) >= 1 that do not decrease along the
    columns (base 1: every column pair is sin(pos), cos(pos)); RoPE rejects it with
    "expected base > 1"."""
    with pytest.raises(ValueError, match=rf"expected base to be a finite number > 1, got {bad!r}"):
        posenc.PositionalEncoding(16, 0.1, 32, base=bad)


@pytest.mark.parametrize("offset, error, message", [
    (2.0, TypeError, r"expected offset to be an int, got 2\.0"),
    ("2", TypeError, r"expected offset to be an int, got '2'"),
    (2**64, ValueError, r"expected offset to fit in int64, got 18446744073709551616"),
    (-2**63 - 1, ValueError, r"expected offset to fit in int64, got -9223372036854775809"),
    (torch.tensor(2, device="meta"), TypeError, r"expected offset to be an int or a one-element integer tensor"),
    (torch.tensor([1, 2]), TypeError, r"expected offset to be an int or a one-element integer tensor"),
])
def test_offset_of_another_type_names_it(module_cls, offset, error, message):
    """A float, a string, an int past int64 or a meta tensor reached the op's schema parser:
    "Expected a value of type 'int' for argument 'offset' but instead found type 'int'", with
    no value (a fuzz of the Python API). Now the front end names offset and its value."""
    x, table = torch.randn(2, 5, 8), torch.randn(10, 8)
    with pytest.raises(error, match=message):
        add_position(x, table, offset=offset)
    with pytest.raises(error, match=message):
        module_cls(8, 0.0, 10)(x, offset=offset)


def test_offset_as_a_numpy_integer_is_an_int(module_cls):
    import numpy as np
    x = torch.randn(2, 5, 8)
    pe = module_cls(8, 0.0, 10)
    torch.testing.assert_close(pe(x, offset=np.int64(3)), pe(x, offset=3), rtol=0, atol=0)


def test_offset_true_is_refused_under_compile_too():
    """True would count as 1 in the op's SymInt: refused in eager and under torch.compile
    (whose branch leaves other types, numpy integers, to the op)."""
    x, table = torch.randn(1, 2, 8), torch.randn(10, 8)
    with pytest.raises(Exception, match=r"expected offset to be an int, got True"):
        torch.compile(lambda x: add_position(x, table, offset=True), backend="eager")(x)


def test_the_meta_forward_checks_the_offset_against_the_table():
    """A meta dry run (and FakeTensor tracing with concrete sizes) refuses what the CPU kernel
    refuses: a sequence past max_len, a negative offset (the Meta forward ignored the offset,
    where the Meta backward checked it)."""
    for device in ("cpu", "meta"):
        table = torch.zeros(10, 8, device=device)
        with pytest.raises(ValueError, match=r"sequence length 11 plus offset 0 exceeds max_len=10"):
            add_position(torch.zeros(2, 11, 8, device=device), table)
        with pytest.raises(ValueError, match=r"sequence length 6 plus offset 5 exceeds max_len=10"):
            add_position(torch.zeros(2, 6, 8, device=device), table, offset=5)
        with pytest.raises(ValueError, match=r"expected offset >= 0, got -1"):
            torch.ops.posenc.add_position_forward(torch.zeros(2, 3, 8, device=device), table, None, -1, True, 0.0,
                                                  False)
        module = posenc.LearnedPositionalEncoding(8, max_len=10, device=device)
        with pytest.raises(ValueError, match=r"exceeds max_len=10"):
            module(torch.zeros(2, 11, 8, device=device))
        assert add_position(torch.zeros(2, 6, 8, device=device), table, offset=4).shape == (2, 6, 8)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"exceeds max_len=10"):
            add_position(torch.zeros(2, 11, 8), torch.zeros(10, 8))
