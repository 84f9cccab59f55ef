"""rope_append_kv's ATen fallback on a device (issue 34, item 7): one error contract on every
path, and no host sync. The fallback (the composite in rope_append_kv.cpp) skipped slots below -1
silently on a device (the CPU kernel raises IndexError, the CUDA kernel asserts), wrote a
negative cache row at the cache's end, and read the slots back to the host (nonzero) on every
call. Without a GPU, a tensor subclass stands for the device (OnDevice): the fallback sees
tensors that are not on the CPU, while every ATen op it calls runs on the CPU tensor inside."""

import pytest
import torch

import posenc  # noqa: F401
from test_rope_append_kv import F64, TOL, make

COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


class OnDevice(torch.Tensor):
    """A CPU tensor that reports the device "meta": a stand-in for a device without posenc
    kernels (MPS, XPU, ...), where rope_append_kv runs its ATen fallback. The fallback sees a
    tensor that is not on the CPU (so it may not read values on the host), while every ATen
    op it calls runs on the CPU tensor inside (__torch_dispatch__). Ops that read a device
    tensor back to the host (nonzero, item, boolean-mask indexing, ...) are recorded."""

    host_reads = []
    HOST_READS = {"nonzero", "_local_scalar_dense", "item", "is_nonzero", "masked_select", "_unique2",
                  "unique_dim", "unique_consecutive", "repeat_interleave"}

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device="meta", storage_offset=inner.storage_offset())

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten, tree_map

        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name.startswith("index") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1:])[0])
        if name in cls.HOST_READS or bool_index:
            cls.host_reads.append(name)
        unwrap = lambda t: t.inner if isinstance(t, OnDevice) else t  # noqa: E731
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = dict(kwargs, device=torch.device("cpu"))  # new_empty(..., device=the stand-in's)
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        return tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)


def fallback_on_device(*args, inplace=False, **kwargs):
    """rope_append_kv(_)'s ATen fallback with every tensor on the stand-in device."""
    op = (torch.ops.posenc.rope_append_kv_ if inplace else torch.ops.posenc.rope_append_kv).default
    wrap = lambda t: OnDevice(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    OnDevice.host_reads.clear()
    return op.redispatch(COMPOSITE, *map(wrap, args), **{n: wrap(v) for n, v in kwargs.items()})


@pytest.mark.parametrize("case", ["paged", "offsets", "offset"])
def test_aten_fallback_on_a_device_writes_the_kernel_rows_without_host_reads(case):
    """On a device the fallback neither reads values back (no nonzero, no .item(): a host
    sync each) nor leaves out what the kernel writes: -1 slots write nothing, every other
    row as the CPU kernel's."""
    torch.manual_seed(4)
    layout = "thd" if case == "paged" else "bshd"
    q, k, v, kc, vc = make(layout, S=5)
    kw = {"paged": dict(slot_mapping=torch.tensor([5, -1, 0, 19, -1]), layout="thd"),
          "offsets": dict(offsets=torch.tensor([0, 6, 3]), offset=1),
          "offset": dict(offset=4)}[case]
    slots = kw.pop("slot_mapping", None)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q, want_k = torch.ops.posenc.rope_append_kv(q, k, v, want_kc, want_vc, slots, True, **kw)
    got_q, got_k = fallback_on_device(q, k, v, kc, vc, slots, True, **kw)
    assert OnDevice.host_reads == []
    torch.testing.assert_close(got_q.inner, want_q, **TOL[F64])
    torch.testing.assert_close(got_k.inner, want_k, **TOL[F64])
    torch.testing.assert_close(kc, want_kc, **TOL[F64])
    assert torch.equal(vc, want_vc)
    q0 = q.clone()
    fallback_on_device(q, k, v, kc, vc, slots, False, inplace=True, **kw)
    assert OnDevice.host_reads == []
    torch.testing.assert_close(q, want_q, **TOL[F64])
    assert not torch.equal(q, q0)


@pytest.mark.parametrize("case", ["slot_low", "slot_high", "row_low", "row_high", "offset_domain"])
def test_aten_fallback_on_a_device_refuses_rows_outside_the_cache(case):
    """A slot below -1 was skipped silently by the fallback on a device (a negative row
    was written at the cache's end): every path refuses rows outside the cache, here with
    the device-side check (at::_assert_async, or an index that makes index_put_ fail)."""
    layout = "thd" if case.startswith("slot") else "bshd"
    q, k, v, kc, vc = make(layout, S=3)
    kw = {"slot_low": dict(slot_mapping=torch.tensor([0, -2, 3])),
          "slot_high": dict(slot_mapping=torch.tensor([0, 20, 3])),
          "row_low": dict(offsets=torch.tensor([0, -1, 3])),
          "row_high": dict(offsets=torch.tensor([0, 10, 3])),
          "offset_domain": dict(offsets=torch.tensor([0, 2**53 + 2, 3]), offset=-(2**53),
                                positions=torch.arange(3))}[case]
    slots = kw.pop("slot_mapping", None)
    with pytest.raises((RuntimeError, IndexError), match="slot_mapping|cache row|out of bounds"):
        fallback_on_device(q, k, v, kc, vc, slots, False, layout=layout, **kw)
    assert OnDevice.host_reads == []


@pytest.mark.parametrize("case", ["slot_low", "slot_high", "row_low", "row_high"])
def test_aten_fallback_on_the_cpu_refuses_as_the_kernel(case):
    """On the CPU, where reading the rows costs nothing, the fallback raises the kernel's own
    IndexError before anything is written."""
    layout = "thd" if case.startswith("slot") else "bshd"
    q, k, v, kc, vc = make(layout, S=3)
    kw = {"slot_low": dict(slot_mapping=torch.tensor([0, -2, 3])),
          "slot_high": dict(slot_mapping=torch.tensor([0, 20, 3])),
          "row_low": dict(offsets=torch.tensor([0, -1, 3])),
          "row_high": dict(offsets=torch.tensor([0, 10, 3]))}[case]
    slots = kw.pop("slot_mapping", None)
    op = torch.ops.posenc.rope_append_kv.default
    errors = []
    for run in (op, lambda *a, **k: op.redispatch(COMPOSITE, *a, **k)):
        before = kc.clone(), vc.clone()
        with pytest.raises(IndexError) as e:
            run(q, k, v, kc, vc, slots, False, layout=layout, **kw)
        errors.append(str(e.value).splitlines()[0])
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert errors[0] == errors[1] and ("slot_mapping[1]" in errors[0] or "batch row 1" in errors[0]), errors
