"""Ops that write memory (issue 34, item 4): rope_ and qk_norm_rope_ (q and k in place),
rope_append_kv (the caches) and rope_append_kv_ (the caches, q, and k with return_k). Each
computes the right answer for the aliasing it accepts and refuses the rest with an error
naming both arguments: nothing written may share a byte with itself or with any other
argument unless that is proven ("cannot tell" is a refusal; written_memory.cpp). Every case
runs through the CPU kernel and through the ATen fallback (the op's CompositeExplicitAutograd
kernel, reached with redispatch), which must refuse the same calls."""

import pytest
import torch

import posenc  # noqa: F401

F64 = torch.float64
PATHS = ["kernel", "aten_fallback"]
COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def call(path, name, *args, **kwargs):
    op = getattr(torch.ops.posenc, name).default
    if path == "kernel":
        return op(*args, **kwargs)
    return op.redispatch(COMPOSITE, *args, **kwargs)


def rand(*shape, dtype=F64):
    return torch.rand(*shape, dtype=F64).mul(4).sub(2).to(dtype)


def kv(B=2, S=3, Hq=2, H=2, D=8, L=7):
    return rand(B, S, Hq, D), rand(B, S, H, D), rand(B, S, H, D), rand(B, L, H, D), rand(B, L, H, D)


# ---- rope_append_kv_ (in place) and rope_append_kv ------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_v_is_k_in_place_with_return_k_is_refused(path):
    # Tied K/V: k is rotated in place, so v (the same memory) would reach the v cache rotated.
    q, k, _, kc, vc = kv()
    kc0, vc0, q0 = kc.clone(), vc.clone(), q.clone()
    with pytest.raises(RuntimeError, match=r"rope_append_kv_: expected k and v in separate memory"):
        call(path, "rope_append_kv_", q, k, k, kc, vc, None, True, offset=1)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0) and torch.equal(q, q0)


@pytest.mark.parametrize("path", PATHS)
def test_v_is_k_in_place_without_return_k_is_right(path):
    # k is only read then (q alone is rotated in place): the v cache gets k as it is.
    q, k, _, kc, vc = kv()
    k0 = k.clone()
    want_q, want_k = torch.ops.posenc.rope_append_kv(q, k, k0, kc.clone(), vc.clone(), None, True, offset=1)
    call(path, "rope_append_kv_", q, k, k, kc, vc, None, False, offset=1)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(kc[:, 1:4], want_k)
    assert torch.equal(vc[:, 1:4], k0) and torch.equal(k, k0)


@pytest.mark.parametrize("path", PATHS)
def test_v_is_q_in_place_is_refused(path):
    q, k, _, kc, vc = kv(Hq=2, H=2)
    vc0 = vc.clone()
    with pytest.raises(RuntimeError, match=r"expected q and v in separate memory \(q is written, v is read\)"):
        call(path, "rope_append_kv_", q, k, q, kc, vc, None, False, offset=1)
    assert torch.equal(vc, vc0)


@pytest.mark.parametrize("path", PATHS)
def test_v_overlapping_k_in_place_is_refused(path):
    B, S, H, D = 2, 3, 2, 8
    buf = rand(B, S, H, D + 4)
    k, v = buf[..., :D], buf[..., 4:]  # half of each row shared
    q, _, _, kc, vc = kv()
    with pytest.raises(RuntimeError, match="expected k and v in separate memory"):
        call(path, "rope_append_kv_", q, k, v, kc, vc, None, True, offset=0)


@pytest.mark.parametrize("path", PATHS)
def test_k_as_a_strided_slice_of_the_buffer_holding_k_cache_is_refused(path):
    # One (batch, max_len, 2 * heads, head_dim) buffer holds the k cache in its first heads;
    # k is a strided slice of the same buffer over the rows being written. Neither view is
    # dense (torch's overlap test answers "too hard"): they overlap, so refused.
    B, S, H, D, L = 2, 3, 2, 8, 7
    buf = rand(B, L, 2 * H, D)
    kc, k = buf[:, :, :H], buf[:, 2:2 + S, :H]
    q, _, v, _, vc = kv()
    buf0 = buf.clone()
    for name in ("rope_append_kv", "rope_append_kv_"):
        with pytest.raises(RuntimeError, match=r"expected k_cache and k in separate memory \(k_cache is "
                                               r"written, k is read\), got views whose separation cannot be proven"):
            call(path, name, q, k, v, kc, vc, None, False, offset=1)
    assert torch.equal(buf, buf0)
    # The dense case was refused before too.
    kc = rand(B, L, H, D)
    with pytest.raises(RuntimeError, match="expected k_cache and k in separate memory"):
        call(path, "rope_append_kv", q, kc[:, 2:2 + S], v, kc, vc, None, False, offset=1)


NEITHER_PRIVATE = r"two host storages neither of which torch's CPU allocator made"


@pytest.mark.parametrize("path", PATHS)
def test_two_storages_over_one_buffer_are_refused(path):
    # torch.from_numpy twice: two storages, one memory (as from_blob or DLPack).
    B, S, H, D, L = 2, 3, 2, 8, 7
    a = rand(B * L * H * D).numpy()
    kc = torch.from_numpy(a).view(B, L, H, D)
    k = torch.from_numpy(a)[: B * S * H * D].view(B, S, H, D)  # kc's first rows
    q, _, v, _, vc = kv()
    with pytest.raises(RuntimeError, match=r"expected k_cache and k in separate memory .*two storages over "
                                           r"overlapping memory"):
        call(path, "rope_append_kv", q, k, v, kc, vc, None, False, offset=3)
    # v and k over one buffer, k rotated in place.
    b = rand(2 * B * S * H * D).numpy()
    k = torch.from_numpy(b)[: B * S * H * D].view(B, S, H, D)
    v = torch.from_numpy(b)[B * S * H * D // 2:][: B * S * H * D].view(B, S, H, D)
    with pytest.raises(RuntimeError, match="expected k and v in separate memory"):
        call(path, "rope_append_kv_", q, k, v, rand(B, L, H, D), vc, None, True, offset=0)
    # Disjoint halves of one numpy buffer through two storages: their addresses are apart, but
    # two storages that torch did not allocate may be one memory at two addresses (below), so
    # they are refused too; one of torch's own beside a numpy buffer is separate memory.
    v = torch.from_numpy(b)[B * S * H * D:].view(B, S, H, D)
    k0 = k.clone()
    with pytest.raises(RuntimeError, match="expected k and v in separate memory .*" + NEITHER_PRIVATE):
        call(path, "rope_append_kv_", q, k, v, rand(B, L, H, D), vc, None, True, offset=0)
    assert torch.equal(k, k0)
    v = v.clone()  # torch's allocator's memory
    call(path, "rope_append_kv_", q, k, v, rand(B, L, H, D), vc, None, True, offset=0)


@pytest.mark.parametrize("path", PATHS)
def test_two_mappings_of_one_file_are_refused(path, tmp_path):
    """torch.from_file twice over one file: two storages at different addresses over the same
    bytes. Compared by address they looked apart, and rope_ rotated k over the q it had just
    written (max error 9.1; with 2 threads the result changed from run to run), rope_append_kv
    wrote the v rows over the k rows. Refused now, before anything is written."""
    B, S, H, D = 1, 64, 4, 16
    n = B * S * H * D
    path_ = str(tmp_path / "shared.bin")
    rand(n).numpy().tofile(path_)
    first = torch.from_file(path_, shared=True, size=n, dtype=F64)
    second = torch.from_file(path_, shared=True, size=n, dtype=F64)
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)
    before = first.clone()
    q, k = first.view(B, S, H, D), second.view(B, S, H, D)
    with pytest.raises(RuntimeError, match="rope_: expected q and k in separate memory .*" + NEITHER_PRIVATE):
        call(path, "rope_", q, k)
    qk_weight = torch.ones(D, dtype=F64)
    with pytest.raises(RuntimeError, match="qk_norm_rope_: expected q and k in separate memory .*" + NEITHER_PRIVATE):
        call(path, "qk_norm_rope_", q, k, qk_weight, qk_weight)
    kq, kk, kv_ = rand(B, 2, H, D), rand(B, 2, H, D), rand(B, 2, H, D)
    with pytest.raises(RuntimeError, match="expected k_cache and v_cache in separate memory .*" + NEITHER_PRIVATE):
        call(path, "rope_append_kv", kq, kk, kv_, q, k, None, False, offset=0)
    with pytest.raises(RuntimeError, match="rope_shift_kv_: expected k_cache and from_positions in separate "
                                           "memory .*" + NEITHER_PRIVATE):
        positions = torch.from_file(path_, shared=True, size=2, dtype=torch.int64)
        call(path, "rope_shift_kv_", q, positions, positions.clone())
    assert torch.equal(first, before) and torch.equal(second, before)
    # One of them in torch's own memory: separate, whatever the other's addresses.
    want = call(path, "rope", before.view(B, S, H, D), before.view(B, S, H, D).clone())
    q2 = before.view(B, S, H, D).clone()
    call(path, "rope_", q2, k)
    assert torch.equal(q2, want[0]) and torch.equal(k, want[1]) and torch.equal(first.view(B, S, H, D), want[1])


@pytest.mark.parametrize("path", PATHS)
def test_index_tensors_inside_written_memory_are_refused(path):
    # positions or slot_mapping stored in a cache that the call writes (int64 views of a
    # float64 cache): the write would change them while they are read.
    q, k, v, kc, vc = kv()
    positions = kc.view(torch.int64)[0, :3, 0, 0]
    positions.copy_(torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="expected k_cache and positions in separate memory"):
        call(path, "rope_append_kv", q, k, v, kc, vc, None, False, positions=positions, offset=1)
    offsets = vc.view(torch.int64)[:, 0, 0, 0]
    offsets.copy_(torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="expected v_cache and offset in separate memory"):
        call(path, "rope_append_kv", q, k, v, kc, vc, None, False, offsets=offsets)
    S, H, D = 3, 2, 8
    blocks = rand(4, 2, H, D)
    slots = blocks.view(torch.int64)[0, 0, 0, :S]
    slots.copy_(torch.tensor([7, -1, 5]))
    with pytest.raises(RuntimeError, match="expected k_cache and slot_mapping in separate memory"):
        call(path, "rope_append_kv", rand(S, H, D), rand(S, H, D), rand(S, H, D), blocks, rand(4, 2, H, D),
             slots, False, layout="thd")
    # Written in place: q holding the positions.
    q = rand(2, 3, 2, 8)
    positions = q.view(torch.int64)[0, :, 0, 0]
    positions.copy_(torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="expected q and positions in separate memory"):
        call(path, "rope_append_kv_", q, k, v, kc, vc, None, False, positions=positions, offset=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_fused_qkv_slices_in_place_are_accepted_and_right(path, layout):
    # q, k, v as slices of one fused projection (B, S, Hq + 2 H, D): the rows interleave
    # without sharing a byte (rows_provably_disjoint), so in place is fine.
    torch.manual_seed(3)
    B, S, Hq, H, D, L = 2, 5, 4, 2, 16, 9
    if layout == "thd":
        qkv = rand(S, Hq + 2 * H, D)
        q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + H], qkv[:, Hq + H:]
        kc, vc = rand(4, 4, H, D), rand(4, 4, H, D)
        kw = dict(slot_mapping=torch.tensor([3, -1, 12, 0, 7]), layout="thd")
    else:
        qkv = rand(B, S, Hq + 2 * H, D)
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + H], qkv[:, :, Hq + H:]
        kc, vc = rand(B, L, H, D), rand(B, L, H, D)
        kw = dict(offset=2)
    slot = kw.pop("slot_mapping", None)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q, want_k = torch.ops.posenc.rope_append_kv(q.clone(), k.clone(), v.clone(), want_kc, want_vc, slot,
                                                     True, **kw)
    v0 = v.clone()
    call(path, "rope_append_kv_", q, k, v, kc, vc, slot, True, **kw)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(kc, want_kc)
    assert torch.equal(vc, want_vc) and torch.equal(v, v0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_kv_caches_interleaved_in_one_buffer_are_accepted(path, layout):
    # k and v caches as the two halves of each row of one buffer (neither view dense): their
    # rows interleave without sharing a byte, so they are separate memory.
    torch.manual_seed(5)
    B, S, H, D, L = 2, 3, 2, 8, 6
    if layout == "thd":
        buf = rand(4, 2, H, 2, D)  # (blocks, block_size, heads, k/v, head_dim)
        kc, vc = buf[:, :, :, 0], buf[:, :, :, 1]
        q, k, v = rand(S, H, D), rand(S, H, D), rand(S, H, D)
        kw = dict(slot_mapping=torch.tensor([5, -1, 0]), layout="thd")
    elif layout == "bhsd":
        buf = rand(B, H, L, 2, D)
        kc, vc = buf[:, :, :, 0], buf[:, :, :, 1]
        q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
        kw = dict(offset=2, layout="bhsd")
    else:
        buf = rand(B, L, 2, H, D)
        kc, vc = buf[:, :, 0], buf[:, :, 1]
        q, k, v = rand(B, S, H, D), rand(B, S, H, D), rand(B, S, H, D)
        kw = dict(offset=2)
    slot = kw.pop("slot_mapping", None)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = torch.ops.posenc.rope_append_kv(q, k, v, want_kc, want_vc, slot, True, **kw)
    got = call(path, "rope_append_kv", q, k, v, kc, vc, slot, True, **kw)
    for g, w in zip(got + (kc, vc), want + (want_kc, want_vc)):
        torch.testing.assert_close(g, w)


# ---- rope_ -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_rope_inplace_refuses_index_tensors_inside_q_or_k(path):
    q, k = rand(2, 4, 1, 2), rand(2, 4, 1, 2)
    positions = q.view(torch.int64)[0, :, 0, 0]  # (4,), stride 2: inside q's rows
    positions.copy_(torch.arange(4))
    q0 = q.clone()
    with pytest.raises(RuntimeError, match=r"rope_: expected q and positions in separate memory \(q is "
                                           r"written, positions is read\)"):
        call(path, "rope_", q, k, positions)
    assert torch.equal(q, q0)
    offsets = k.view(torch.int64)[:, 0, 0, 1]
    offsets.copy_(torch.tensor([3, 5]))
    with pytest.raises(RuntimeError, match="expected k and offset in separate memory"):
        call(path, "rope_", q, k, None, offsets)
    qt = rand(6, 1, 2)
    cu = qt.view(torch.int64)[:3, 0, 0]
    cu.copy_(torch.tensor([0, 2, 6]))
    with pytest.raises(RuntimeError, match="expected q and cu_seqlens in separate memory"):
        call(path, "rope_", qt, None, None, None, 0, cu, layout="thd")


@pytest.mark.parametrize("path", PATHS)
def test_rope_inplace_refuses_internal_overlap_torch_cannot_decide(path):
    # Heads 4 elements apart, rows of 8: heads overlap. Not dense, so at::has_internal_overlap
    # answers "too hard"; the strides prove the overlap.
    base = rand(64)
    q = base.as_strided((1, 3, 2, 8), (48, 16, 4, 1))
    with pytest.raises(RuntimeError, match="rope_: expected q without internal overlap"):
        call(path, "rope_", q)
    # Strides that do not overlap (a padded, non-dense view) are fine.
    q = base.as_strided((1, 3, 2, 4), (48, 16, 5, 1))
    want = torch.ops.posenc.rope(q.clone())[0]
    call(path, "rope_", q)
    torch.testing.assert_close(q, want)


# ---- qk_norm_rope_ -----------------------------------------------------------------------------


def qk(B=2, S=3, H=2, D=8):
    return rand(B, S, H, D), rand(B, S, H, D), rand(D).abs() + 0.5, rand(D).abs() + 0.5


@pytest.mark.parametrize("path", PATHS)
def test_qk_norm_rope_inplace_accepts_weights_beside_q_in_one_storage(path):
    # The weights were refused for sharing q's storage at all; disjoint bytes are separate.
    B, S, H, D = 2, 3, 2, 8
    n = B * S * H * D
    buf = rand(n + 2 * D)
    buf[n:].abs_().add_(0.5)
    q, wq, wk = buf[:n].view(B, S, H, D), buf[n:n + D], buf[n + D:]
    _, k, _, _ = qk()
    want_q, want_k = torch.ops.posenc.qk_norm_rope(q.clone(), k.clone(), wq.clone(), wk.clone())
    call(path, "qk_norm_rope_", q, k, wq, wk)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


@pytest.mark.parametrize("path", PATHS)
def test_qk_norm_rope_inplace_refuses_aliases_it_could_not_see(path):
    B, S, H, D = 2, 3, 2, 8
    # A weight over q's memory through a second storage (numpy): the old check compared
    # storages only.
    a = (rand(B * S * H * D).abs() + 0.5).numpy()
    q = torch.from_numpy(a).view(B, S, H, D)
    wq = torch.from_numpy(a)[:D]
    _, k, _, wk = qk()
    with pytest.raises(RuntimeError, match=r"qk_norm_rope_: expected q and q_weight in separate memory .*two "
                                           r"storages over overlapping memory"):
        call(path, "qk_norm_rope_", q, k, wq, wk)
    # Positions inside k.
    q, k, wq, wk = qk()
    positions = k.view(torch.int64)[0, :, 0, 0]
    positions.copy_(torch.tensor([4, 5, 6]))
    with pytest.raises(RuntimeError, match="expected k and positions in separate memory"):
        call(path, "qk_norm_rope_", q, k, wq, wk, positions=positions)


# ---- Meta kernels and tracing: the same refusals -------------------------------------------------


def meta_cases():
    """(name, call, expected message) over views of one Meta buffer: what the CPU refuses."""
    buf = torch.empty(256, device="meta", dtype=F64)
    q, k = buf[:48].view(1, 3, 2, 8), buf[8:56].view(1, 3, 2, 8)
    w = torch.ones(8, device="meta", dtype=F64)
    other = torch.empty(1, 6, 2, 8, device="meta", dtype=F64)
    return [
        ("rope_", lambda: torch.ops.posenc.rope_(q, k), "rope_: expected q and k in separate memory"),
        ("qk_norm_rope_", lambda: torch.ops.posenc.qk_norm_rope_(q, k, w, w),
         "qk_norm_rope_: expected q and k in separate memory"),
        ("rope_append_kv", lambda: torch.ops.posenc.rope_append_kv(
            buf[200:248].view(1, 3, 2, 8), buf[:48].view(1, 3, 2, 8), buf[:48].view(1, 3, 2, 8),
            buf[:96].view(1, 6, 2, 8), other, offset=0),
         "rope_append_kv: expected k_cache and k in separate memory"),
        ("rope_append_kv_", lambda: torch.ops.posenc.rope_append_kv_(
            buf[200:248].view(1, 3, 2, 8), buf[100:148].view(1, 3, 2, 8), buf[100:148].view(1, 3, 2, 8),
            other, other.clone(), None, True, offset=0),
         "rope_append_kv_: expected k and v in separate memory"),
        ("rope_shift_kv_", lambda: torch.ops.posenc.rope_shift_kv_(
            buf[:96].view(1, 6, 2, 8), buf[:2].view(torch.int64), buf[2:4].view(torch.int64)),
         "rope_shift_kv_: expected k_cache and from_positions in separate memory"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_meta_kernels_refuse_what_the_cpu_kernels_refuse(case):
    # The Meta kernels are what torch.compile and torch.export trace with: a call they accepted
    # ran under aot_eager (on functionalization's copies) while eager refused it.
    name, fn, message = meta_cases()[case]
    with pytest.raises(RuntimeError, match=message):
        fn()


def test_meta_kernels_accept_views_that_share_no_byte():
    # Fused q, k, v slices of one Meta buffer interleave without sharing a byte, as on the CPU.
    qkv = torch.empty(2, 5, 8, 16, device="meta", dtype=F64)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    caches = torch.empty(2, 9, 2, 2, 16, device="meta", dtype=F64)
    torch.ops.posenc.rope_append_kv_(q, k, v, caches[:, :, 0], caches[:, :, 1], None, True, offset=2)
    torch.ops.posenc.rope_(q, k)


def test_compile_refuses_what_eager_refuses():
    buf = rand(100)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def rotate(buf):
        torch.ops.posenc.rope_(buf[:48].view(1, 3, 2, 8), buf[8:56].view(1, 3, 2, 8))
        return buf

    before = buf.clone()
    with pytest.raises(Exception, match="rope_: expected q and k in separate memory"):
        rotate(buf)
    assert torch.equal(buf, before)


def test_export_refuses_aliased_concrete_operands_beside_symbolic_ones():
    # The proof skips only the pairs it has no numbers for: with q, k, v of a dynamic length,
    # one static cache passed as both k_cache and v_cache is still refused when traced, as
    # eager refuses it (until 6747575 any symbolic operand skipped every pair: torch.export
    # took the call, and what the package wrote was never checked).
    class Append(torch.nn.Module):
        def forward(self, q, k, v, k_cache, v_cache):
            torch.ops.posenc.rope_append_kv_(q, k, v, k_cache, v_cache, None, True, offset=0)
            return k_cache.clone(), v_cache.clone()

    q, k, v = rand(1, 5, 2, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    cache = rand(1, 16, 2, 8)
    message = "rope_append_kv_: expected k_cache and v_cache in separate memory"
    with pytest.raises(RuntimeError, match=message):
        Append()(q.clone(), k.clone(), v.clone(), cache, cache)
    n = torch.export.Dim("n", max=16)
    dynamic = ({1: n}, {1: n}, {1: n}, None, None)
    before = cache.clone()
    with pytest.raises(Exception, match=message):
        torch.export.export(Append(), (q, k, v, cache, cache), dynamic_shapes=dynamic)
    assert torch.equal(cache, before)
    # Separate caches beside the same symbolic q, k, v: exported, and written as eager writes.
    k_cache, v_cache = rand(1, 16, 2, 8), rand(1, 16, 2, 8)
    exported = torch.export.export(Append(), (q.clone(), k.clone(), v.clone(), k_cache.clone(), v_cache.clone()),
                                   dynamic_shapes=dynamic).module()
    want = Append()(q.clone(), k.clone(), v.clone(), k_cache.clone(), v_cache.clone())
    got = exported(q.clone(), k.clone(), v.clone(), k_cache.clone(), v_cache.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not torch.equal(want[0], k_cache)


def test_compiled_writes_into_a_view_at_a_symbolic_offset_are_refused():
    # Layer 1 of stacked caches taken inside the graph under dynamic shapes: Inductor (torch
    # 2.11) hands a custom op its written view at storage offset 0 (pytorch/pytorch#198068), so
    # the shift turned layer 0's keys, silently. Refused when traced (the backend cannot be
    # told there); a view at a static offset is written where it lies.
    def shift_layer1(k_caches, from_positions, to_positions):
        torch.ops.posenc.rope_shift_kv_(k_caches[1], from_positions, to_positions)

    k_caches = rand(2, 2, 32, 2, 16)
    from_positions, to_positions = torch.arange(5) + 3, torch.arange(5)
    before = k_caches.clone()
    with pytest.raises(Exception, match=r"rope_shift_kv_: k_cache is a view at a symbolic storage offset "
                                        r"\(16\*s"):
        torch.compile(shift_layer1, backend="aot_eager", fullgraph=True, dynamic=True)(
            k_caches, from_positions, to_positions)
    assert torch.equal(k_caches, before)
    want = k_caches.clone()
    shift_layer1(want, from_positions, to_positions)
    torch.compile(shift_layer1, backend="aot_eager", fullgraph=True, dynamic=False)(
        k_caches, from_positions, to_positions)
    assert torch.equal(k_caches, want) and not torch.equal(want[1], before[1]) and torch.equal(want[0], before[0])


def test_exported_writes_into_a_view_at_a_lone_symbol_offset_are_refused():
    # A cache carved from a flat pool after a prefix of dynamic length: its offset is one
    # symbol (the prefix's size), which an AOTInductor package dropped to 0 (it wrote elements
    # 32.. whatever the prefix); torch.export fixes its inputs' offsets, so a symbolic one is
    # always computed in the graph.
    class Carve(torch.nn.Module):
        def forward(self, prefix, pool, from_positions, to_positions):
            n = prefix.shape[0]
            torch.ops.posenc.rope_shift_kv_(pool[n:n + 256].view(1, 8, 2, 16), from_positions, to_positions)
            return pool.clone()

    args = (torch.zeros(5), rand(1024), torch.arange(3) + 2, torch.arange(3))
    with pytest.raises(Exception, match=r"rope_shift_kv_: k_cache is a view at a symbolic storage offset"):
        torch.export.export(Carve(), args, dynamic_shapes=({0: torch.export.Dim("n", max=512)}, None, None, None))


# ---- the proof itself ----------------------------------------------------------------------------


def element_offsets(t):
    """Storage offsets of every element of t."""
    idx = torch.zeros(t.shape, dtype=torch.int64) + t.storage_offset()
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = n
        idx = idx + (torch.arange(n) * s).view(shape)
    return set(idx.flatten().tolist())


def test_accepted_views_never_share_an_element():
    """Random strided views q and k of one buffer through rope_ in place: whatever the proof
    accepts is disjoint (and free of internal overlap), checked element by element; and it
    accepts some of the interleaved views that torch's overlap test cannot decide."""
    g = torch.Generator().manual_seed(34)

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    def strides(size):
        """Strides without internal overlap (mostly): dims in a random order, each stride past
        the reach of the smaller ones plus some padding (sometimes none, sometimes too little)."""
        order = torch.randperm(4, generator=g).tolist()
        out, reach = [0] * 4, 0
        for d in order:
            out[d] = max(1, reach + 1 + randint(-1, 3))
            reach = out[d] * (size[d] - 1) + reach
        return out

    accepted = interleaved = 0
    for trial in range(400):
        B, S, D = randint(1, 3), randint(1, 3), 2 * randint(1, 2)
        qsize, ksize = (B, S, randint(1, 3), D), (B, S, randint(1, 3), D)
        qs = strides(qsize)
        ks = qs if trial % 2 else strides(ksize)  # one layout for both, as slices of one buffer
        views = [(qsize, qs, randint(0, 30)), (ksize, ks, randint(0, 30))]
        buf = torch.randn(1000, generator=g)
        q, k = (buf.as_strided(*v) for v in views)
        eq, ek = element_offsets(q), element_offsets(k)
        try:
            torch.ops.posenc.rope_(q, k)
        except RuntimeError as e:
            assert "separate memory" in str(e) or "internal overlap" in str(e), e
            continue
        accepted += 1
        assert not (eq & ek), (views, sorted(eq & ek))
        assert len(eq) == q.numel() and len(ek) == k.numel(), views
        interleaved += not (max(eq) < min(ek) or max(ek) < min(eq))
    assert accepted > 20 and interleaved > 0, (accepted, interleaved)


# ---- views with the negative bit (z.conj().imag) ---------------------------------------------


def test_written_tensors_with_the_negative_bit_are_refused_before_any_write():
    """ATen's fallback for the Negative key replaced a written neg-bit view by a resolved copy,
    so the alias checks saw only the copy and the copy was written back over what the op had
    written through the other argument (rope_ with q = z.conj().imag[:, :4] and k =
    z.imag[:, 1:]: k off by 1.4), or (rope_append_kv, which does not return its caches) an
    internal assert after the other cache was written. Now a RuntimeError naming the
    argument, with nothing written; a read-only neg-bit input is resolved and computes right."""
    from posenc.functional import apply_rope, qk_norm_rope, rope_append_kv, rope_shift_kv

    torch.manual_seed(0)
    z = torch.randn(1, 5, 1, 4, dtype=torch.complex128)
    z0 = z.clone()
    q, k = z.conj().imag[:, 0:4], z.imag[:, 1:5]
    assert q.is_neg()
    with pytest.raises(RuntimeError, match=r"rope_: expected q without the negative bit"):
        apply_rope(q, k, inplace=True)
    w = torch.ones(4, dtype=F64)
    with pytest.raises(RuntimeError, match=r"qk_norm_rope_: expected q without the negative bit"):
        qk_norm_rope(q, k, w, w, inplace=True)
    assert torch.equal(torch.view_as_real(z), torch.view_as_real(z0))

    q2, k2, v2, kc, vc = kv()
    zc = torch.zeros(2, 7, 2, 8, dtype=torch.complex128)
    kc_neg = zc.conj().imag  # no overlap at all: still refused (the fallback asserted here)
    vc0 = vc.clone()
    for inplace in (False, True):
        with pytest.raises(RuntimeError, match=r"expected k_cache without the negative bit"):
            rope_append_kv(q2, k2, v2, kc_neg, vc, offset=1, inplace=inplace)
    assert torch.equal(vc, vc0) and torch.equal(torch.view_as_real(zc), torch.zeros_like(torch.view_as_real(zc)))
    with pytest.raises(RuntimeError, match=r"rope_shift_kv_: expected k_cache without the negative bit"):
        rope_shift_kv(kc_neg, torch.tensor([0, 1]), torch.tensor([2, 3]))

    # Read-only inputs with the bit: their values (negated) are what the op reads.
    v_neg = torch.randn(2, 3, 2, 8, dtype=torch.complex128).conj().imag
    want_kc, want_vc = kc.clone(), vc.clone()
    rope_append_kv(q2, k2, v_neg.resolve_neg(), want_kc, want_vc, offset=1)
    rope_append_kv(q2, k2, v_neg, kc, vc, offset=1)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    k_neg = torch.randn(1, 4, 1, 4, dtype=torch.complex128).conj().imag
    got = apply_rope(q.resolve_neg(), k_neg)
    want = apply_rope(q.resolve_neg(), k_neg.resolve_neg())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
