"""RoPE on random combinations of every option at once, against the float64 references of
rope_reference.py: layout, dtype, convention, head_dim, partial rotary, GQA/MQA or q alone,
positions / offsets / packed sequences, scaling type, and arbitrary strides (a random
storage order, a strided last dimension, a storage offset). Each configuration checks the
out-of-place op, the in-place op on an identical view, and (float32/float64) the gradients
of q and k against autograd through the reference. The focused tests in test_rope.py vary
one option at a time; this sweep looks for the combinations they do not name."""

import random

import pytest
import torch

from conftest import DEVICES, strided_random
from posenc.functional import apply_rope
from rope_reference import F64, reference_inv_freq, reference_rope, thd_positions

TOL = {
    torch.float64: dict(atol=1e-11, rtol=1e-11),
    torch.float32: dict(atol=4e-6, rtol=4e-6),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 40},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


def layout_shape(layout, B, S, H, D):
    return {"bshd": (B, S, H, D), "bhsd": (B, H, S, D), "sbhd": (S, B, H, D), "thd": (B * S, H, D)}[layout]


def same_view(x):
    """A copy of x with the same sizes and strides (for the in-place op)."""
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    y.copy_(x)
    return y


def random_configuration(seed):
    rng = random.Random(seed)
    c = dict(
        layout=rng.choice(["bshd", "bhsd", "sbhd", "thd"]),
        dtype=rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
        interleaved=rng.random() < 0.5,
        D=2 * rng.randint(1, 48),
        Hq=rng.randint(1, 5),
        B=rng.randint(1, 4),
        S=rng.randint(1, 19),
        scaling=rng.choice(SCALINGS),
        base=rng.choice([10000.0, 500000.0, 37.5]),
    )
    c["rotary_dim"] = rng.choice([None, 2 * rng.randint(1, c["D"] // 2)])
    c["Hk"] = rng.choice([0, 1, c["Hq"], rng.randint(1, 4)])  # 0: q alone
    return rng, c


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(64))
def test_random_configuration(device, seed):
    rng, c = random_configuration(seed)
    torch.manual_seed(seed)
    layout, dtype, B, S, D = c["layout"], c["dtype"], c["B"], c["S"], c["D"]
    rotary_dim = c["rotary_dim"] or D
    q = strided_random(rng, layout_shape(layout, B, S, c["Hq"], D), dtype, device)
    k = strided_random(rng, layout_shape(layout, B, S, c["Hk"], D), dtype, device) if c["Hk"] else None

    kwargs = {}
    if layout == "thd":
        # B sequences (some possibly empty) covering the B * S tokens.
        cuts = sorted(rng.randint(0, B * S) for _ in range(B - 1))
        cu = torch.tensor([0] + cuts + [B * S], dtype=rng.choice([torch.int32, torch.int64]))
        offsets = rng.choice([None, "int", "tensor"])
        if offsets == "int":
            kwargs["offset"] = rng.randint(0, 3000)
            pos = thd_positions(cu) + kwargs["offset"]
        elif offsets == "tensor":
            per_seq = torch.randint(0, 3000, (B,))
            kwargs["offset"] = per_seq.to(device)
            pos = thd_positions(cu, per_seq)
        else:
            pos = thd_positions(cu)
        kwargs["cu_seqlens"] = cu.to(device)
    else:
        kind = rng.choice(["none", "seq", "batch_seq"])
        if kind == "none":
            pos = torch.arange(S).expand(B, S)
        else:
            p = torch.randint(0, 5000, (S,) if kind == "seq" else (B, S))
            kwargs["positions"] = p.to(device)
            pos = p.expand(B, S)
        offsets = rng.choice([None, "int", "tensor"])
        if offsets == "int":
            kwargs["offset"] = rng.randint(0, 3000)
            pos = pos + kwargs["offset"]
        elif offsets == "tensor":
            per_row = torch.randint(0, 3000, (B,))
            kwargs["offset"] = per_row.to(device)
            pos = pos + per_row[:, None]
    common = dict(base=c["base"], interleaved=c["interleaved"], rotary_dim=c["rotary_dim"],
                  scaling=c["scaling"], layout=layout, **kwargs)

    longest = int(pos.max()) + 1 if pos.numel() else 0
    inv, attn = reference_inv_freq(rotary_dim, c["base"], c["scaling"], seq_len=longest)

    def reference(x):
        return reference_rope(x.cpu().to(F64), layout, pos, inv, rotary_dim, c["interleaved"], attn)

    out = apply_rope(q, k, **common)
    oq, ok = out if k is not None else (out, None)
    assert oq.dtype == dtype and oq.shape == q.shape
    torch.testing.assert_close(oq.cpu().to(F64), reference(q), **TOL[dtype])
    if k is not None:
        torch.testing.assert_close(ok.cpu().to(F64), reference(k), **TOL[dtype])
    if dtype in (torch.float16, torch.bfloat16):
        # Rotated in float32 and rounded once: the bits of the float32 call's output rounded.
        want = apply_rope(q.float(), k.float() if k is not None else None, **common)
        wq, wk = want if k is not None else (want, None)
        assert torch.equal(oq, wq.to(dtype))
        if k is not None:
            assert torch.equal(ok, wk.to(dtype))

    # In place, on views with the same strides: the same numbers, in their own storage.
    qi = same_view(q)
    ki = same_view(k) if k is not None else None
    apply_rope(qi, ki, inplace=True, **common)
    torch.testing.assert_close(qi, oq, atol=0, rtol=0)
    if k is not None:
        torch.testing.assert_close(ki, ok, atol=0, rtol=0)

    if dtype in (torch.float32, torch.float64):
        # Backward: the gradients of a random projection of the outputs.
        qg = q.detach().requires_grad_()
        kg = k.detach().requires_grad_() if k is not None else None
        gq = torch.randn(q.shape, dtype=F64)
        out = apply_rope(qg, kg, **common)
        oq2, ok2 = out if k is not None else (out, None)
        loss = (oq2 * gq.to(dtype=dtype, device=device)).sum()
        qr = q.detach().cpu().to(F64).requires_grad_()
        ref_loss = (reference_rope(qr, layout, pos, inv, rotary_dim, c["interleaved"], attn) * gq).sum()
        if k is not None:
            gk = torch.randn(k.shape, dtype=F64)
            loss = loss + (ok2 * gk.to(dtype=dtype, device=device)).sum()
            kr = k.detach().cpu().to(F64).requires_grad_()
            ref_loss = ref_loss + (reference_rope(kr, layout, pos, inv, rotary_dim, c["interleaved"], attn) * gk).sum()
        loss.backward()
        ref_loss.backward()
        tol = TOL[dtype] if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(qg.grad.cpu().to(F64), qr.grad, **tol)
        assert qg.grad.shape == q.shape
        if k is not None:
            torch.testing.assert_close(kg.grad.cpu().to(F64), kr.grad, **tol)
