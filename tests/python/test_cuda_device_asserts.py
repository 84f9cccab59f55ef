"""Out-of-range index values on CUDA (issue 26, item 3): the kernels check them on the
device, as ATen's indexing does, so the default call needs no host sync and a bad value is
never silent. A failed check stops the kernel with a device-side assert: a RuntimeError at
the next synchronisation, the kernel's message on stderr, and a CUDA context that is
unusable afterwards; so each case runs in its own Python process. (The CPU kernels raise
IndexError / ValueError for the same values: test_add_position_errors.py,
test_rope_errors.py.)"""
import os
import re
import subprocess
import sys
import textwrap

import pytest
from rope_reference import default_inv_freq, reference_rope, thd_positions

pytestmark = pytest.mark.cuda

PYTHON_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "python")

SETUP = """
import torch, posenc
F = posenc.functional
x = torch.randn(2, 5, 16, device="cuda")
table = torch.randn(8, 16, device="cuda")
q = torch.randn(9, 2, 8, device="cuda")
"""

# The kernels' assert messages, as regular expressions.
OUT_OF_TABLE = re.escape("posenc: add_position: a position is outside [0, max_len) of the table")
CU_SEQLENS = "|".join(re.escape(m) for m in (
    "posenc: rope: a packed token lies outside every sequence of cu_seqlens",
    "posenc: rope: expected cu_seqlens to start at 0, never decrease and end at the number of tokens"))

# name -> (the call, the kernel's assert message as a regular expression)
CASES = {
    "add_position_positions": (
        "F.add_position(x, table, positions=torch.tensor([0, 1, 2, 3, 8], device='cuda'), p=0.0)",
        OUT_OF_TABLE),
    "add_position_negative": (
        "F.add_position(x, table, positions=torch.tensor([[0, 1, 2, 3, 4], [0, -1, 2, 3, 4]], device='cuda'), p=0.0)",
        OUT_OF_TABLE),
    "add_position_offset": (
        "F.add_position(x, table, offset=4, p=0.0)",
        OUT_OF_TABLE),
    "module_unchecked": (
        "m = posenc.PositionalEncoding(16, 0.0, 8).cuda(); m.check_positions = False\n"
        "m(x, positions=torch.tensor([0, 1, 2, 3, 99], device='cuda'))",
        OUT_OF_TABLE),
    "learned_module_unchecked": (
        "m = posenc.LearnedPositionalEncoding(16, 0.0, 10).cuda(); m.check_positions = False\n"
        "m(x.requires_grad_(), positions=torch.tensor([0, 3, 10, -1, 9], device='cuda').expand(2, 5)).sum().backward()",
        OUT_OF_TABLE),
    # A cu_seqlens that ends short fails two checks, whichever thread asserts first.
    "rope_cu_seqlens_short": (
        "F.apply_rope(q, cu_seqlens=torch.tensor([0, 4, 6], device='cuda'), layout='thd')",
        CU_SEQLENS),
    "rope_cu_seqlens_decreasing": (
        "F.apply_rope(q, cu_seqlens=torch.tensor([0, 5, 3, 9], device='cuda', dtype=torch.int32), layout='thd')",
        CU_SEQLENS),
    "rope_positions": (
        "F.apply_rope(q.unsqueeze(0), positions=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 2**60], device='cuda'))",
        re.escape("posenc: rope: expected positions within [-2**53, 2**53]")),
    # qk_norm_rope's kernel shares rope's checks (cuda/common/rope_device_checks.cuh).
    "qk_norm_rope_cu_seqlens_short": (
        "w = torch.ones(8, device='cuda')\n"
        "F.qk_norm_rope(q, q[:, :1].contiguous(), w, w, cu_seqlens=torch.tensor([0, 4, 6], device='cuda'), layout='thd')",
        CU_SEQLENS),
    "qk_norm_rope_positions": (
        "w = torch.ones(8, device='cuda')\n"
        "F.qk_norm_rope(q.unsqueeze(0), q[:, :1].unsqueeze(0), w, w, "
        "positions=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 2**60], device='cuda'))",
        re.escape("posenc: qk_norm_rope: expected positions within [-2**53, 2**53]")),
    "rope_offsets": (
        "F.apply_rope(q.view(3, 3, 2, 8), offset=torch.tensor([0, -2**54, 1], device='cuda'))",
        re.escape("posenc: rope: expected offsets within [-2**53, 2**53]")),
}

SCRIPT = """
try:
    {call}
    torch.cuda.synchronize()
except RuntimeError as e:
    print("raised:", type(e).__name__, str(e).splitlines()[0])
else:
    print("no error")
"""


@pytest.mark.parametrize("name", sorted(CASES))
def test_out_of_range_index_values_stop_the_cuda_kernel(name):
    call, message = CASES[name]
    code = SETUP + SCRIPT.format(call=textwrap.indent(call, "    ").lstrip())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "raised:" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "device-side assert triggered" in r.stdout, r.stdout
    # The device's assert report (file, block, thread, the message) may reach either stream.
    assert re.search(message, r.stdout + r.stderr), r.stderr[-2000:]


def test_in_range_values_pass_the_device_checks():
    """The same calls with valid values run and synchronise cleanly (in this process)."""
    import torch

    import posenc

    F = posenc.functional
    x = torch.randn(2, 5, 16, device="cuda")
    table = torch.randn(8, 16, device="cuda")
    y = F.add_position(x, table, positions=torch.tensor([0, 1, 2, 3, 7], device="cuda"), p=0.0)
    torch.testing.assert_close(y, x + table[[0, 1, 2, 3, 7]], rtol=0, atol=0)
    q = torch.randn(9, 2, 8, device="cuda", dtype=torch.float64)
    cu = torch.tensor([0, 4, 4, 9], device="cuda")  # an empty sequence is fine
    out = F.apply_rope(q, cu_seqlens=cu, layout="thd")
    pos = thd_positions(cu.cpu())  # 0..3, then 0..4
    want = reference_rope(q.cpu(), "thd", pos, default_inv_freq(8, 10000.0), 8, False)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-12, atol=1e-12)
