"""The ops that write tensor arguments (rope_, qk_norm_rope_, rope_append_kv(_),
rope_shift_kv_) move the version counters of what they write wherever ATen's in-place ops
move them: at the ADInplaceOrView layer, which runs under torch.no_grad(), under grad mode
and under torch.inference_mode() for normal tensors (autograd does not run there). So a
graph that saved a tensor before one of these writes refuses to backward, as after
``x.mul_(2)``, instead of differentiating the new values silently. An inference tensor
(made under inference mode) written outside it is a RuntimeError before anything is written,
as ATen refuses it."""

import pytest
import torch

import posenc.functional as F

F64 = torch.float64


def rope_(q, k):
    F.apply_rope(q, k, inplace=True)


def qk_norm_rope_(q, k):
    F.qk_norm_rope(q, k, torch.ones(8, dtype=q.dtype), torch.ones(8, dtype=q.dtype), inplace=True)


def append(caches):
    k_cache, v_cache = caches
    q, k, v = (torch.randn(1, 2, 2, 8, dtype=k_cache.dtype) for _ in "qkv")
    F.rope_append_kv(q, k, v, k_cache, v_cache, offset=1)


def append_(caches):
    k_cache, v_cache = caches
    q, k, v = (torch.randn(1, 2, 2, 8, dtype=k_cache.dtype) for _ in "qkv")
    F.rope_append_kv(q, k, v, k_cache, v_cache, offset=1, inplace=True)


def shift(caches):
    F.rope_shift_kv(caches[0], torch.arange(2, 4), torch.arange(0, 2), rows=torch.arange(2, 4))


QK_OPS = {"rope_": rope_, "qk_norm_rope_": qk_norm_rope_}
CACHE_OPS = {"rope_append_kv": append, "rope_append_kv_": append_, "rope_shift_kv_": shift}
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def qk():
    return torch.randn(1, 4, 2, 8, dtype=F64), torch.randn(1, 4, 2, 8, dtype=F64)


def caches():
    return torch.randn(1, 6, 2, 8, dtype=F64), torch.randn(1, 6, 2, 8, dtype=F64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", QK_OPS)
def test_a_graph_that_saved_q_refuses_backward_after_an_in_place_write(name, mode):
    w = torch.randn(8, dtype=F64, requires_grad=True)
    q, k = qk()
    y = (q * w).sum() + (k * w).sum()  # q and k saved for w's gradient
    before = (q._version, k._version)
    with MODES[mode]():
        QK_OPS[name](q, k)
    assert q._version > before[0] and k._version > before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CACHE_OPS)
def test_a_graph_that_saved_a_cache_refuses_backward_after_a_cache_write(name, mode):
    w = torch.randn(8, dtype=F64, requires_grad=True)
    kv = caches()
    y = (kv[0] * w).sum()
    before = kv[0]._version
    with MODES[mode]():
        CACHE_OPS[name](kv)
    assert kv[0]._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("name", QK_OPS)
def test_grad_mode_writes_move_versions_once(name):
    q, k = qk()
    before = (q._version, k._version)
    QK_OPS[name](q, k)  # nothing requires grad: allowed under grad mode
    assert (q._version, k._version) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize("name", list(QK_OPS) + list(CACHE_OPS))
def test_inference_tensors_are_written_inside_inference_mode_only(name):
    with torch.inference_mode():
        tensors = qk() if name in QK_OPS else caches()
        fn = QK_OPS.get(name) or CACHE_OPS[name]
        fn(*tensors) if name in QK_OPS else fn(tensors)  # allowed in inference mode
        kept = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match="inference tensor"):
        fn(*tensors) if name in QK_OPS else fn(tensors)
    for t, want in zip(tensors, kept):
        assert torch.equal(t, want)  # refused before anything was written


@pytest.mark.parametrize("return_k", [False, True])
def test_rope_append_kv_in_place_writes_k_only_with_return_k(return_k):
    # Without return_k, rope_append_kv_ leaves k as it was (the rotated k goes to the cache):
    # a graph that saved k still backpropagates, k's version stays, and an inference k may be
    # passed outside inference mode. With return_k, k is written: both are refused.
    w = torch.randn(8, dtype=F64, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 2, 8, dtype=F64) for _ in "qkv")
    k_cache, v_cache = caches()
    y = (k * w).sum()
    before, k0 = k._version, k.clone()
    out = F.rope_append_kv(q, k, v, k_cache, v_cache, offset=1, inplace=True, return_k=return_k)
    if return_k:
        assert out[1] is k and k._version > before and not torch.equal(k, k0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    else:
        assert k._version == before and torch.equal(k, k0)
        y.backward()
        assert torch.equal(w.grad, k0.sum((0, 1, 2)))
    with torch.inference_mode():
        k_inf = torch.randn(1, 2, 2, 8, dtype=F64)
    q2 = torch.randn(1, 2, 2, 8, dtype=F64)
    if return_k:
        with pytest.raises(RuntimeError, match="inference tensor"):
            F.rope_append_kv(q2, k_inf, v, k_cache, v_cache, offset=1, inplace=True, return_k=True)
    else:
        k_cache_before = k_cache.clone()
        F.rope_append_kv(q2, k_inf, v, k_cache, v_cache, offset=3, inplace=True)
        want, _ = F.apply_rope(k_inf.clone(), k_inf.clone(), offset=3)
        assert torch.equal(k_cache[:, 3:5], want) and torch.equal(k_cache[:, :3], k_cache_before[:, :3])


def test_rope_append_kv_in_place_takes_a_negative_bit_k_it_does_not_write():
    # A k with the negative bit is read (resolved, as ATen's fallback does) when the call does
    # not write it; written (return_k) it is refused.
    z = torch.randn(1, 2, 2, 8, dtype=torch.complex128)
    k = z.conj().imag  # the negative bit: values -z.imag
    assert k.is_neg()
    q, v = (torch.randn(1, 2, 2, 8, dtype=F64) for _ in "qv")
    k_cache, v_cache = caches()
    F.rope_append_kv(q, k, v, k_cache, v_cache, offset=1, inplace=True)
    want, _ = F.apply_rope(-z.imag, -z.imag, offset=1)
    assert torch.equal(k_cache[:, 1:3], want)
    with pytest.raises(RuntimeError, match="negative"):
        F.rope_append_kv(q, k, v, k_cache, v_cache, offset=1, inplace=True, return_k=True)


@pytest.mark.parametrize("return_k", [False, True])
def test_rope_append_kv_in_place_under_compile_writes_k_only_with_return_k(return_k):
    # The same contract under torch.compile: functionalization follows the schema of the
    # overload the call takes (rope_append_kv_.keep_k reads k), so k is neither copied back
    # nor has its version moved without return_k.
    w = torch.randn(8, dtype=F64, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 2, 8, dtype=F64) for _ in "qkv")
    k_cache, v_cache = caches()
    want_cache = (k_cache.clone(), v_cache.clone())
    y = (k * w).sum()
    before, k0 = k._version, k.clone()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, k_cache, v_cache):
        return F.rope_append_kv(q, k, v, k_cache, v_cache, offset=1, inplace=True, return_k=return_k)

    with torch.no_grad():
        step(q, k, v, k_cache, v_cache)
    F.rope_append_kv(torch.randn(1, 2, 2, 8, dtype=F64), k0.clone(), v, *want_cache, offset=1)
    assert torch.equal(k_cache, want_cache[0])
    if return_k:
        assert k._version > before and not torch.equal(k, k0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    else:
        assert k._version == before and torch.equal(k, k0)
        y.backward()
