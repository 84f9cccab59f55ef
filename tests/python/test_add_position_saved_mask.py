"""The CPU's saved dropout mask (add_position_forward with save_mask=True): its bits are the
forward's keep decisions, and the backward ops read them to the same results, bit for bit,
as regenerating the mask from the (seed, offset) key."""
import pytest
import torch
from torch.library import opcheck

import posenc
from dropout_reference import keep_mask  # Philox written out in NumPy

ops = torch.ops.posenc
P = 0.3


def unpack(mask, d):
    """(A, B, ceil(d / 8)) uint8 -> (A, B, 8 * ceil(d / 8)) bool, bit k of byte j = element 8 j + k."""
    bits = (mask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(*mask.shape[:2], -1).bool()


def forward_both(x, table, positions, batch_first, seed=5):
    torch.manual_seed(seed)
    out_key, rng = ops.add_position_forward(x, table, positions, 0, batch_first, P)
    torch.manual_seed(seed)
    out_mask, mask = ops.add_position_forward(x, table, positions, 0, batch_first, P, True)
    return out_key, rng, out_mask, mask


SHAPES = [(3, 17, 24), (2, 5, 13), (4, 9, 1030), (1, 1, 1), (2, 3, 2056), (5, 7, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("positions", [None, "seq", "batch_seq"])
def test_mask_bits_and_backward_equal_the_regenerated_mask(dtype, shape, batch_first, positions):
    torch.manual_seed(0)
    A, B, d = shape
    batch, seq = (A, B) if batch_first else (B, A)
    x = torch.randn(A, B, d, dtype=dtype)
    table = torch.randn(40, d, dtype=torch.float64).to(dtype)
    pos = None
    if positions == "seq":
        pos = torch.randint(0, 40, (seq,))
    elif positions == "batch_seq":
        pos = torch.randint(0, 3, (batch, seq))  # many repeated rows
    out_key, rng, out_mask, mask = forward_both(x, table, pos, batch_first)
    assert torch.equal(out_key, out_mask)
    assert mask.dtype == torch.uint8 and mask.shape == (A, B, (d + 7) // 8)
    bits = unpack(mask, d)
    seed, offset = rng.tolist()
    assert torch.equal(bits[..., :d], keep_mask(seed, offset, (A, B, d), P))
    assert not bits[..., d:].any()  # padding bits are 0
    kept = bits[..., :d].double().mean().item()
    assert abs(kept - (1 - P)) <= 5 * (P * (1 - P) / x.numel()) ** 0.5  # 5 sigma

    g = torch.randn(A, B, d, dtype=dtype)
    assert torch.equal(ops.add_position_backward(g, rng, P), ops.add_position_backward(g, mask, P))
    for need_x in (True, False):
        a = ops.add_position_backward_with_table(g, rng, pos, 0, batch_first, P, 40, need_x)
        b = ops.add_position_backward_with_table(g, mask, pos, 0, batch_first, P, 40, need_x)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_backward_against_a_float64_reference_on_views():
    """grad_x = grad * bit * scale from the bits alone, on a non-contiguous grad and a mask
    read through an offset view."""
    torch.manual_seed(1)
    x = torch.randn(4, 11, 21, dtype=torch.float64)
    table = torch.randn(30, 21, dtype=torch.float64)
    _, _, _, mask = forward_both(x, table, None, True)
    big = torch.zeros(2 * mask.numel() + 3, dtype=torch.uint8)
    view = big[3:3 + mask.numel()].view(mask.shape)
    view.copy_(mask)
    g = torch.randn(11, 4, 21, dtype=torch.float64).transpose(0, 1)  # non-contiguous
    want = g * unpack(mask, 21)[..., :21].double() * (1.0 / (1.0 - P))
    assert torch.equal(ops.add_position_backward(g, view, P), want)
    gx, gt = ops.add_position_backward_with_table(g, view, None, 2, True, P, 30, True)
    assert torch.equal(gx, want)
    ref_table = torch.zeros(30, 21, dtype=torch.float64)
    ref_table[2:13] = want.sum(0)
    torch.testing.assert_close(gt, ref_table, rtol=1e-12, atol=1e-12)


def test_empty_tensors():
    x = torch.randn(0, 5, 8)
    out, mask = ops.add_position_forward(x, torch.randn(10, 8), None, 0, True, P, True)
    assert out.shape == (0, 5, 8) and mask.shape == (0, 5, 1)
    assert ops.add_position_backward(torch.randn(0, 5, 8), mask, P).shape == (0, 5, 8)
    x = torch.randn(2, 3, 0)
    out, mask = ops.add_position_forward(x, torch.randn(10, 0), None, 0, True, P, True)
    assert mask.shape == (2, 3, 0)
    assert ops.add_position_backward(torch.randn(2, 3, 0), mask, P).shape == (2, 3, 0)


def test_a_mask_of_the_wrong_shape_or_dtype_is_rejected():
    g = torch.randn(2, 3, 20)
    good = torch.zeros(2, 3, 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"rng, the saved dropout mask \(uint8\).*got shape \[2, 3, 2\]"):
        ops.add_position_backward(g, torch.zeros(2, 3, 2, dtype=torch.uint8), P)
    with pytest.raises(RuntimeError, match="saved dropout mask.*got shape"):
        ops.add_position_backward(g.reshape(6, 20), good.reshape(6, 3), P)
    with pytest.raises(RuntimeError, match="saved dropout mask.*got shape"):
        ops.add_position_backward_with_table(g, good[:1], None, 0, True, P, 5, True)
    with pytest.raises(RuntimeError, match=r"int64 \(seed, offset\) pair.*got Int"):
        ops.add_position_backward(g, good.int(), P)


def test_opcheck_with_a_saved_mask():
    x = torch.randn(2, 7, 12)
    table = torch.randn(16, 12)
    opcheck(ops.add_position_forward.default, (x, table, None, 1, True, 0.5, True))
    opcheck(ops.add_position_forward.default, (x.transpose(0, 1), table, torch.randint(0, 16, (7, 2)).t(), 0, False, 0.2, True))
    _, _, _, mask = forward_both(x, table, None, True)
    g = torch.randn(2, 7, 12)
    opcheck(ops.add_position_backward.default, (g, mask, P))
    opcheck(ops.add_position_backward_with_table.default, (g, mask, None, 0, True, P, 16, True))
    opcheck(ops.add_position_backward_with_table.default, (g.bfloat16(), mask, torch.randint(0, 16, (2, 7)), 0, True, P, 16, False))


def test_compiled_training_graph_saves_the_mask():
    """AOTAutograd traces the C++ autograd kernel with fake CPU tensors: the forward graph asks
    for the mask, and the backward graph reads it."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm)

    table = torch.randn(32, 16, requires_grad=True)
    fn = aot_function(lambda x, t: posenc.functional.add_position(x, t, p=0.4).sum(),
                      fw_compiler=keep, bw_compiler=keep)
    x = torch.randn(3, 10, 16, requires_grad=True)
    fn(x, table).backward()
    fw, bw = graphs
    assert "add_position_forward.default" in fw and ", True)" in fw.split("add_position_forward.default")[1].split("\n")[0]
    assert "add_position_backward_with_table.default" in bw
    assert x.grad.shape == x.shape and table.grad.shape == table.shape


@pytest.mark.cuda
def test_cuda_rejects_save_mask_and_a_saved_mask():
    x = torch.randn(2, 3, 8, device="cuda")
    with pytest.raises(ValueError, match="save_mask=True.*CPU-only"):
        ops.add_position_forward(x, torch.randn(4, 8, device="cuda"), None, 0, True, P, True)
    mask = torch.zeros(2, 3, 1, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="saved dropout mask.*CPU-only"):
        ops.add_position_backward(x, mask, P)
    with pytest.raises(RuntimeError, match="saved dropout mask.*CPU-only"):
        ops.add_position_backward_with_table(x, mask, None, 0, True, P, 4, True)
