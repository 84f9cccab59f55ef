"""The KV-cache ops deployed (issues 25, 39): torch.export of a decode step whose KV caches are
mutated inputs, and the AOTInductor package of it (one small compile), against eager; the
same for rope_shift_kv's context shift. (Left out of the sanitizer run: scripts/sanitize.sh.)"""

import sys

import pytest
import torch
from torch import nn

import posenc  # noqa: F401
from posenc.functional import rope_append_kv, rope_shift_kv


class DecodeStep(nn.Module):
    """One decode step of a layer: rotate q and k, append k and v to the caches (Hugging
    Face's static-cache layout), attend over the cache."""

    def forward(self, q, k, v, k_cache, v_cache, lengths):
        q = rope_append_kv(q, k, v, k_cache, v_cache, offset=lengths, layout="bhsd")
        scores = torch.einsum("bhsd,bhtd->bhst", q, k_cache.repeat_interleave(2, 1))
        return scores.softmax(-1).matmul(v_cache.repeat_interleave(2, 1))


class DecodeStepFp8(DecodeStep):
    """The same step, also writing its k and v into FP8 caches (issue 39: float8 caches with
    per-tensor scales, one a float, one a tensor input)."""

    def forward(self, q, k, v, k_cache, v_cache, lengths, k_cache8, v_cache8, v_scale):
        rope_append_kv(q, k, v, k_cache8, v_cache8, offset=lengths, layout="bhsd", k_scale=0.5, v_scale=v_scale)
        return super().forward(q, k, v, k_cache, v_cache, lengths)


class DecodeStepQkNorm(nn.Module):
    """A Qwen3 decode step: q_norm / k_norm (parameters of the module), RoPE and the cache
    write in one op (issue 39: QK-norm straight into the cache)."""

    def __init__(self, head_dim=16):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.q_norm = nn.Parameter(torch.rand(head_dim, generator=g) + 0.5)
        self.k_norm = nn.Parameter(torch.rand(head_dim, generator=g) + 0.5)

    def forward(self, q, k, v, k_cache, v_cache, lengths):
        return rope_append_kv(q, k, v, k_cache, v_cache, offset=lengths, layout="bhsd", q_weight=self.q_norm,
                              k_weight=self.k_norm, eps=1e-6)


def inputs_fp8(seed):
    g = torch.Generator().manual_seed(seed + 100)
    shape = inputs(seed)[3].shape
    k_cache8 = torch.randint(0, 100, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    v_cache8 = torch.randint(0, 100, shape, dtype=torch.uint8, generator=g).view(torch.float8_e5m2)
    return (*inputs(seed), k_cache8, v_cache8, torch.tensor([0.25 + seed]))


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, KV, D, L = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, h, 1, D, generator=g) for h in (H, KV, KV))
    k_cache, v_cache = torch.randn(B, KV, L, D, generator=g), torch.randn(B, KV, L, D, generator=g)
    lengths = torch.randint(0, L, (B,), generator=g)
    return q, k, v, k_cache, v_cache, lengths


def test_export_keeps_the_cache_writes():
    args = inputs(0)
    program = torch.export.export(DecodeStep(), tuple(a.clone() for a in args))
    assert [n.target for n in program.graph.nodes if "posenc" in str(n.target)] == [
        torch.ops.posenc.rope_append_kv.default]
    # Functionalized (the inference IR AOTInductor compiles), the writes are the caches'.
    functional = program.run_decompositions({})
    assert set(functional.graph_signature.user_inputs_to_mutate.values()) == {"k_cache", "v_cache"}
    want_args, got_args = [a.clone() for a in args], [a.clone() for a in args]
    want = DecodeStep()(*want_args)
    got = program.module()(*got_args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_args[3:5], want_args[3:5]):
        assert torch.equal(g, w)


def test_export_writes_fp8_caches():
    args = inputs_fp8(0)
    program = torch.export.export(DecodeStepFp8(), tuple(a.clone() for a in args))
    functional = program.run_decompositions({})
    assert set(functional.graph_signature.user_inputs_to_mutate.values()) == {
        "k_cache", "v_cache", "k_cache8", "v_cache8"}
    want_args, got_args = [a.clone() for a in args], [a.clone() for a in args]
    torch.testing.assert_close(program.module()(*got_args), DecodeStepFp8()(*want_args), rtol=0, atol=0)
    for g, w in zip(got_args[6:8], want_args[6:8]):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_export_qk_norm_into_the_cache():
    """Exported as deployed (parameters frozen: no autograd in the op), the same bits."""
    args = inputs(1)
    model = DecodeStepQkNorm().requires_grad_(False)
    program = torch.export.export(model, tuple(a.clone() for a in args))
    functional = program.run_decompositions({})
    assert set(functional.graph_signature.user_inputs_to_mutate.values()) == {"k_cache", "v_cache"}
    want_args, got_args = [a.clone() for a in args], [a.clone() for a in args]
    assert torch.equal(program.module()(*got_args), model(*want_args))
    for g, w in zip(got_args[3:5], want_args[3:5]):
        assert torch.equal(g, w)
    assert not torch.equal(want_args[3], args[3])  # the step wrote its rows


@pytest.mark.skipif(sys.platform != "linux", reason="AOTInductor's CPU compile is tested on Linux")
def test_aoti_package_writes_the_caches(tmp_path):
    """One package of the step that writes float32 and FP8 caches (one compile for both)."""
    program = torch.export.export(DecodeStepFp8(), inputs_fp8(0))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "decode.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    for seed in (1, 2):
        args = inputs_fp8(seed)
        want_args, got_args = [a.clone() for a in args], [a.clone() for a in args]
        want = DecodeStepFp8()(*want_args)
        got = loaded(*got_args)
        got = got[0] if isinstance(got, (list, tuple)) else got
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got_args[3], args[3])  # the package wrote the caller's cache
        torch.testing.assert_close(got_args[3], want_args[3], rtol=0, atol=0)
        torch.testing.assert_close(got_args[4], want_args[4], rtol=0, atol=0)
        for i in (6, 7):  # the FP8 caches, bit for bit (the tensor scale is an input: seed-dependent)
            assert not torch.equal(got_args[i].view(torch.uint8), args[i].view(torch.uint8))
            assert torch.equal(got_args[i].view(torch.uint8), want_args[i].view(torch.uint8))


def test_export_and_aoti_package_shift_the_cache(tmp_path):
    """A context shift exported (the cache a mutated input of the program) and packaged with
    AOTInductor: the same bits as eager."""
    class Shift(torch.nn.Module):
        def forward(self, k_cache, old, new, rows):
            rope_shift_kv(k_cache, old, new, rows=rows, layout="bhsd",
                          scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
            return k_cache[:, :, :2].sum()

    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 12, 16, generator=g)
    rows = torch.arange(6, 12)
    old, new = rows.clone(), rows - 4
    program = torch.export.export(Shift(), (cache.clone(), old, new, rows))
    functional = program.run_decompositions({})
    assert set(functional.graph_signature.user_inputs_to_mutate.values()) == {"k_cache"}
    want, got = cache.clone(), cache.clone()
    Shift()(want, old, new, rows)
    program.module()(got, old, new, rows)
    assert torch.equal(got, want) and not torch.equal(want, cache)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "shift.pt2"))
    packaged = cache.clone()
    torch._inductor.aoti_load_package(path)(packaged, old, new, rows)
    assert torch.equal(packaged, want)
