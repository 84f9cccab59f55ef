"""The default call of every op reads no tensor value on the host (issue 26, item 4): on CUDA
such a read is a device sync, which stalls the stream and breaks CUDA graph capture
(test_cuda_streams.py captures the default calls on a GPU). Here, on the CPU, a dispatch
mode records every aten._local_scalar_dense (.item(), int(t), bool(t), .tolist()) made while
the call runs: on CPU tensors those are not syncs, so to reach the front ends' CUDA-only
branches the index tensors are wrapped in a subclass that says it lives on CUDA.

What it covers, and what it cannot see: the mode sits at the Python dispatch key, so it sees
the reads made by Python code (the front ends) and by ops that reach the dispatcher above the
backend kernels; a read made inside a C++ kernel after dispatch (an .item() in a CPU or CUDA
kernel, a cudaMemcpy or stream sync in CUDA code) is below it and invisible here. Those are
covered by reading the code and, on a GPU, by test_cuda_streams.py's CUDA graph capture of
the default calls (capture fails on any sync); no GPU has run it yet."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import posenc

F = posenc.functional


class ScalarReads(TorchDispatchMode):
    """Records the ops that copy a tensor value to the host."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


class SaysCuda(torch.Tensor):
    """A CPU tensor whose is_cuda is True: what the Python front ends test before a host check."""

    @property
    def is_cuda(self):
        return True


def says_cuda(t):
    return t.as_subclass(SaysCuda)


def host_reads(fn):
    with ScalarReads() as mode:
        fn()
    return len(mode.reads)


def test_the_recorder_sees_host_reads():
    """The test below could not pass by a blind recorder: the opt-in host check reads."""
    q = torch.randn(9, 2, 8)
    cu = says_cuda(torch.tensor([0, 4, 9]))
    assert host_reads(lambda: F.apply_rope(q, cu_seqlens=cu, layout="thd", check_inputs=True)) > 0
    assert host_reads(lambda: torch.tensor([3]).item()) == 1


@pytest.mark.parametrize("int32", [False, True])
def test_packed_apply_rope_default_call_reads_no_value(int32):
    """apply_rope(layout="thd") with CUDA cu_seqlens used to check them on the host by
    default (check_inputs=True): a sync on every packed call."""
    q, k = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    cu = says_cuda(torch.tensor([0, 4, 9], dtype=torch.int32 if int32 else torch.int64))
    assert host_reads(lambda: F.apply_rope(q, k, cu_seqlens=cu, layout="thd")) == 0
    offsets = says_cuda(torch.tensor([3, 7]))
    assert host_reads(lambda: F.apply_rope(q, cu_seqlens=cu, offset=offsets, layout="thd")) == 0


def test_other_default_calls_read_no_value():
    x, table = torch.randn(2, 5, 16), torch.randn(8, 16)
    pos = says_cuda(torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]))
    q = torch.randn(2, 5, 4, 16)
    cos, sin = F.rope_cos_sin(torch.arange(5), 16)
    calls = {
        "add_position": lambda: F.add_position(x, table, positions=pos, p=0.1, training=True),
        "add_position offset": lambda: F.add_position(x, table, offset=3, p=0.0),
        "apply_rope positions": lambda: F.apply_rope(q, positions=pos),
        "apply_rope offsets": lambda: F.apply_rope(q, offset=says_cuda(torch.tensor([1, 2]))),
        "apply_rope llama3": lambda: F.apply_rope(q, positions=pos, scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "apply_rope_cos_sin": lambda: F.apply_rope_cos_sin(q, None, cos, sin, layout="bshd"),
        "sinusoidal_table": lambda: F.sinusoidal_table(says_cuda(torch.arange(5)), 16),
    }
    reads = {name: host_reads(fn) for name, fn in calls.items()}
    assert reads == dict.fromkeys(calls, 0)
