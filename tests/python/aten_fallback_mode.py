"""Reaching the ATen fallback on CPU tensors through the dispatcher (csrc/ops/common/aten_fallback.h).

Every posenc op has a CompositeExplicitAutograd kernel made of ATen ops, which devices without
a posenc kernel take; on the CPU the CPU kernels win. ``ThroughTheFallback`` is a dispatch mode
that sends each posenc op it sees (below autograd: the C++ autograd kernels call the ops, so
backward passes go the same way) to that kernel with ``redispatch``, and counts the calls so a
test can assert that the fallback ran. Nothing is unregistered: the CPU kernels stay the
default for every other call in the process.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def has_composite(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd")


class ThroughTheFallback(TorchDispatchMode):
    """Within the block, posenc ops run their ATen composite; ``calls`` counts them by name."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "posenc" and has_composite(func):
            self.calls[func.name()] = self.calls.get(func.name(), 0) + 1
            return func.redispatch(COMPOSITE, *args, **kwargs)
        return func(*args, **kwargs)
