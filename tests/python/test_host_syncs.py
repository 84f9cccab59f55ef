"""No hidden host-device sync in the per-step calls: run on FakeTensorMode "cuda" tensors (no
GPU needed), every aten op that would block the host on a real CUDA tensor is logged (a read
back: .item(), a copy to the CPU, nonzero; a blocking copy from pageable host memory), and a
read of a fake tensor's values raises. The documented syncs (the modules' check_positions)
are counted, not absent."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
import posenc.functional as F

A = torch.ops.aten
READS = {A._local_scalar_dense, A.nonzero, A.equal, A.is_nonzero, A.item}


def _device(x):
    return x.device.type if isinstance(x, torch.Tensor) else None


class SyncLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in READS and any(_device(a) == "cuda" for a in args):
            self.syncs.append(str(func))
        elif packet is A._to_copy:
            src = _device(args[0])
            dst = torch.device(kwargs["device"]).type if kwargs.get("device") is not None else src
            if (src, dst) == ("cuda", "cpu") or ((src, dst) == ("cpu", "cuda") and not kwargs.get("non_blocking")):
                self.syncs.append(f"{func} {src} -> {dst}")
        elif packet is A.copy_:
            dst, src = _device(args[0]), _device(args[1])
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if (src, dst) == ("cuda", "cpu") or ((src, dst) == ("cpu", "cuda") and blocking):
                self.syncs.append(f"{func} {src} -> {dst}")
        elif str(func) == "posenc.position_bounds.default":
            self.syncs.append(str(func))  # one read back (on fake tensors: a stand-in)
            return 0, 0
        return func(*args, **kwargs)


def syncs(build):
    """The syncs of the call build() returns (inputs made by build, under the fake mode, not logged)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        call = build()
        log = SyncLog()
        with log:
            call()
    return log.syncs


B, S, H, D = 2, 8, 4, 32


def q():
    return torch.randn(B, S, H, D, device="cuda")


def test_functions_of_a_step_read_nothing_back():
    cuda_offset = lambda: torch.full((), 5, dtype=torch.int64, device="cuda")  # noqa: E731
    cases = {
        # A tensor offset on the device is added there (it was read as the op's int: .item()).
        "add_position, CUDA offset": lambda: (lambda x, t, o: lambda: F.add_position(x, t, offset=o))(
            torch.randn(B, S, D, device="cuda"), torch.randn(64, D, device="cuda"), cuda_offset()),
        "apply_rope": lambda: (lambda a: lambda: F.apply_rope(a, a))(q()),
        "apply_rope, CUDA positions": lambda: (lambda a, p: lambda: F.apply_rope(a, a, positions=p))(
            q(), torch.arange(S, device="cuda").expand(B, S)),
        "apply_rope, CUDA offsets": lambda: (lambda a, o: lambda: F.apply_rope(a, a, offset=o))(
            q(), torch.tensor([3, 4], device="cuda")),
        "apply_rope, CUDA 0-dim offset": lambda: (lambda a, o: lambda: F.apply_rope(a, a, offset=o))(
            q(), cuda_offset()),
        # A CPU 0-dim offset (a traced decode step's cache.shape[1]) was a blocking copy.
        "apply_rope, CPU 0-dim offset": lambda: (lambda a: lambda: F.apply_rope(a, a, offset=torch.tensor(7)))(q()),
        "qk_norm_rope, CUDA offsets": lambda: (lambda a, w, o: lambda: F.qk_norm_rope(a, a, w, w, offset=o))(
            q(), torch.ones(D, device="cuda"), torch.tensor([3, 4], device="cuda")),
        # The frequencies were a blocking copy per call.
        "rope_cos_sin": lambda: (lambda p: lambda: F.rope_cos_sin(p, D))(torch.arange(S, device="cuda")[None]),
        "sinusoidal_table": lambda: (lambda p: lambda: F.sinusoidal_table(p, D))(torch.arange(S, device="cuda")),
    }
    found = {name: syncs(build) for name, build in cases.items()}
    assert found == {name: [] for name in cases}


@pytest.mark.parametrize("check_positions", [True, False])
def test_an_add_position_module_reads_a_device_offset_only_to_check_it(check_positions):
    """The module's check_positions (default True) is its one documented sync; off, nothing."""
    pe = posenc.PositionalEncoding(D, 0.0, max_len=64)

    def build():
        m = pe.to("cuda")
        m.check_positions = check_positions
        x, offset = torch.randn(S, B, D, device="cuda"), torch.full((), 5, dtype=torch.int64, device="cuda")
        return lambda: m(x, offset=offset)

    assert syncs(build) == (["posenc.position_bounds.default"] if check_positions else [])
