"""The ATen fallback (csrc/ops/common/aten_fallback.h): every op composed of ATen ops, for devices
without a posenc kernel (CUDA in a build without the CUDA kernels, MPS, XPU, ...).

On CPU tensors the tests reach it through the dispatcher: aten_fallback_mode.ThroughTheFallback
redispatches every posenc op to its CompositeExplicitAutograd kernel (the C++ autograd
kernels call the ops below autograd, so the gradients take the fallback too) and counts the
calls, so each comparison also asserts that the fallback ran. The same script runs twice in
one process, with the CPU kernels and through the fallback, and the results are compared:
the fallback adds in the kernels' accumulation dtype and draws the kernels' Philox mask from
the same CPU generator, so add_position and its dropout agree bit for bit; table gradients
(summed in another order), the sinusoidal table and the RoPE angles (the device's sin and
cos instead of posenc's polynomials) agree to the dtype's rounding.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aten_fallback_mode import ThroughTheFallback

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
import posenc

F = posenc.functional
out = {}
g = torch.Generator().manual_seed(99)

def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

def grads(outputs, inputs):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    seeds = tuple(rand(*o.shape, dtype=o.dtype) for o in outputs)
    return torch.autograd.grad(outputs, inputs, seeds)

def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None

for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    n = str(dtype)
    for d, batch_first in ((48, True), (37, False)):
        shape = (3, 10, d) if batch_first else (10, 3, d)
        table = rand(16, d).requires_grad_()
        for kind, kw in (("offset", dict(offset=5)),
                         ("pos_s", dict(positions=torch.randint(0, 16, (10,), generator=g))),
                         ("pos_bs", dict(positions=torch.randint(0, 16, (3, 10), generator=g)))):
            for p in (0.0, 0.25, 1.0):
                x = rand(*shape, dtype=dtype).requires_grad_()
                torch.manual_seed(11)
                y = F.add_position(x, table, p=p, batch_first=batch_first, **kw)
                out[("add_position", n, d, kind, p)] = (y.detach(), *grads(y, (x, table)))
                # x alone (the dropout-only backward op), then create_graph.
                torch.manual_seed(12)
                y = F.add_position(x, table.detach(), p=p, batch_first=batch_first, **kw)
                (gx,) = grads(y, (x,))
                out[("add_position_x", n, d, kind, p)] = (y.detach(), gx)
        # The raw backward ops with a (seed, offset) key: the mask regenerated.
        grad = rand(*shape, dtype=dtype)
        rng = torch.tensor([0x0F1E_2D3C_4B5A_6978, 44])
        out[("dropout_backward", n, d)] = torch.ops.posenc.add_position_backward(grad, rng, 0.4)
        out[("backward_with_table", n, d)] = torch.ops.posenc.add_position_backward_with_table(
            grad, rng, None, 2, batch_first, 0.4, 13, True)
    # sinusoidal_table: integer and float positions, and its gradient.
    pos = (torch.rand(5, 7, generator=g, dtype=torch.float64) * 3000).requires_grad_()
    t = F.sinusoidal_table(pos, 33, dtype=dtype)
    out[("sinusoidal_table", n)] = (t.detach(), *grads(t, (pos,)))
    out[("sinusoidal_table_int", n)] = F.sinusoidal_table(torch.arange(0, 5000, 7), 64, dtype=dtype)
    # RoPE: every position source, scaling with an attention factor, partial rotary,
    # layouts, forward and backward, in place.
    for head_dim, interleaved in ((32, False), (32, True), (20, False)):
        q = rand(2, 9, 4, head_dim, dtype=dtype)
        k = rand(2, 9, 2, head_dim, dtype=dtype)
        cases = {
            "offset": dict(offset=7),
            "positions_bs": dict(positions=torch.randint(0, 5000, (2, 9), generator=g)),
            "offsets": dict(offset=torch.tensor([3, 1000])),
            "partial": dict(rotary_dim=head_dim // 2, positions=torch.arange(9).flip(0)),
            "yarn": dict(scaling={"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 64}),
            "dynamic": dict(scaling={"rope_type": "dynamic", "factor": 2.0,
                                     "original_max_position_embeddings": 4}),
            "sections": dict(sections=[head_dim // 8, head_dim // 8, head_dim // 2 - 2 * (head_dim // 8)],
                             positions=torch.randint(0, 50, (3, 2, 9), generator=g)),
        }
        for case, kw in cases.items():
            qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
            qo, ko = F.apply_rope(qa, ka, interleaved=interleaved, **kw)
            out[("rope", n, head_dim, interleaved, case)] = (qo.detach(), ko.detach(),
                                                             *grads((qo, ko), (qa, ka)))
        qt = rand(12, 4, head_dim, dtype=dtype)
        cu = torch.tensor([0, 5, 5, 12])  # an empty sequence in the middle
        out[("rope_thd", n, head_dim, interleaved)] = F.apply_rope(
            qt, layout="thd", cu_seqlens=cu, offset=torch.tensor([2, 0, 9]), interleaved=interleaved)
        q2 = q.clone()
        F.apply_rope(q2, positions=torch.arange(9) * 3, inplace=True, interleaved=interleaved)
        out[("rope_", n, head_dim, interleaved)] = q2
        cos, sin = F.rope_cos_sin(torch.randint(0, 4000, (2, 9), generator=g), head_dim,
                                  rotary_dim=head_dim // 2 * 2 - (4 if head_dim == 20 else 0))
        cos, sin = cos.requires_grad_(), sin.requires_grad_()
        for layout in ("bhsd", "bshd"):
            qa = (q.transpose(1, 2) if layout == "bhsd" else q).clone().requires_grad_()
            ka = (k.transpose(1, 2) if layout == "bhsd" else k).clone().requires_grad_()
            qo, ko = F.apply_rope_cos_sin(qa, ka, cos, sin, layout=layout, interleaved=interleaved)
            out[("cos_sin", n, head_dim, interleaved, layout)] = (
                qo.detach(), ko.detach(), *grads((qo, ko), (qa, ka, cos, sin)))
# The same checks and messages.
x = torch.zeros(2, 4, 8)
table = torch.zeros(10, 8)
out["errors"] = [
    error_of(lambda: F.add_position(x, table, positions=torch.tensor([0, 1, 2, 10]))),
    error_of(lambda: F.add_position(x, table, offset=7)),
    error_of(lambda: F.add_position(x, table, p=1.5)),
    error_of(lambda: torch.ops.posenc.add_position_backward(x, torch.tensor([1]), 0.5)),
    error_of(lambda: F.sinusoidal_table(torch.arange(3), 0)),
    error_of(lambda: F.apply_rope(torch.zeros(1, 2, 2, 7))),
    error_of(lambda: F.apply_rope(torch.zeros(1, 2, 2, 8), positions=torch.tensor([0, 2**60]))),
    error_of(lambda: F.apply_rope(torch.zeros(4, 2, 8), layout="thd", cu_seqlens=torch.tensor([0, 3]))),
    error_of(lambda: F.apply_rope_cos_sin(torch.zeros(1, 2, 3, 8), None, torch.zeros(4, 6),
                                          torch.zeros(4, 6))),
]
"""


def run(through_fallback: bool) -> dict:
    """The script's results, with the CPU kernels or through the fallback (with the calls
    each op made into its composite)."""
    scope = {}
    if not through_fallback:
        exec(SCRIPT, scope)
        return scope["out"]
    with ThroughTheFallback() as mode:
        exec(SCRIPT, scope)
    return {**scope["out"], "composite_calls": mode.calls}


@pytest.fixture(scope="module")
def results():
    return run(through_fallback=False), run(through_fallback=True)


def test_every_op_ran_its_composite(results):
    _, fallback = results
    calls = fallback["composite_calls"]
    for op in ("add_position_forward", "add_position_backward", "add_position_backward_with_table",
               "sinusoidal_table", "rope", "rope_", "apply_rope_cos_sin"):
        assert calls.get(f"posenc::{op}", 0) > 0, (op, calls)


def flatten(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in flatten(v)]


def tolerance(dtype):
    """(rtol, atol): a few units of the last place of the dtype the op works in (the one of x,
    q or the table values), on values of order 1 to 10."""
    return {"torch.float64": (1e-12, 1e-12), "torch.float32": (2e-6, 2e-6),
            "torch.float16": (2e-3, 2e-3), "torch.bfloat16": (1.6e-2, 1.6e-2)}[dtype]


def compare(kernels, fallback, prefix, exact):
    keys = [k for k in kernels if isinstance(k, tuple) and k[0] == prefix]
    assert keys, prefix
    for key in keys:
        got, want = flatten(fallback[key]), flatten(kernels[key])
        assert len(got) == len(want), key
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape, (key, i)
            if exact(key, i):
                assert torch.equal(a, b), (key, i, (a.double() - b.double()).abs().max())
            else:
                rtol, atol = tolerance(key[1])  # table gradients sum x's rounded values
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m, key=key, i=i: f"{key}[{i}]: {m}")


def test_the_fallback_warns_once_naming_why_and_how():
    """In a process of its own (the warning is once per process)."""
    code = ("import torch, posenc, sys\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from aten_fallback_mode import ThroughTheFallback\n"
            "x, table = torch.randn(2, 3, 8), torch.randn(10, 8)\n"
            "posenc.functional.add_position(x, table)\n"
            "with ThroughTheFallback():\n"
            "    for _ in range(3):\n"
            "        posenc.functional.add_position(x, table)\n"
            "        posenc.functional.apply_rope(torch.randn(1, 2, 1, 8))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warnings = [line for line in proc.stderr.splitlines() if "composition of ATen ops" in line]
    assert len(warnings) == 1, proc.stderr
    message = warnings[0]
    assert "posenc: add_position on cpu tensors runs as a composition of ATen ops" in message
    assert "slower" in message and "the call was sent to it" in message


def test_add_position_forward_and_backward(results):
    kernels, fallback = results
    # Output and x's gradient bit for bit (same sums, same mask); the table's gradient is
    # summed in another order.
    compare(kernels, fallback, "add_position", exact=lambda key, i: i < 2)
    compare(kernels, fallback, "add_position_x", exact=lambda key, i: True)
    compare(kernels, fallback, "dropout_backward", exact=lambda key, i: True)
    compare(kernels, fallback, "backward_with_table", exact=lambda key, i: i == 0)
    # The cases are not trivial: dropout zeroed some elements and kept the rest.
    y = fallback[("add_position", "torch.float32", 48, "offset", 0.25)][0]
    assert 0.15 < (y == 0).double().mean() < 0.35


def test_sinusoidal_table_forward_and_backward(results):
    kernels, fallback = results
    compare(kernels, fallback, "sinusoidal_table", exact=lambda key, i: False)
    compare(kernels, fallback, "sinusoidal_table_int", exact=lambda key, i: False)


def test_rope_forward_and_backward(results):
    kernels, fallback = results
    for prefix in ("rope", "rope_thd", "rope_"):
        compare(kernels, fallback, prefix, exact=lambda key, i: False)
    # Packed positions restart per sequence: the first tokens of sequences 0 and 2 (offsets
    # 2 and 9) differ.
    qt = fallback[("rope_thd", "torch.float32", 32, False)]
    assert not torch.isnan(qt).any() and not torch.equal(qt[0], qt[5])


def test_apply_rope_cos_sin_forward_and_backward(results):
    kernels, fallback = results
    # The tables' gradients are sums over heads and batch rows: compared as sums.
    compare(kernels, fallback, "cos_sin", exact=lambda key, i: False)


def test_the_same_checks_and_messages(results):
    kernels, fallback = results
    assert all(kernels["errors"]), kernels["errors"]
    assert fallback["errors"] == kernels["errors"]
