"""CPU output memory (csrc/ops/common/cpu/cpu_support.cpp): by default the CPU ops' outputs of
>= 32 MiB reuse the blocks of freed outputs (POSENC_CPU_OUTPUTS=reuse), so the values must not
depend on what a reused block held before, and the outputs must behave as any tensor's
(resizable, shareable). POSENC_CPU_OUTPUTS=fresh / huge and the old POSENC_NO_HUGE_PAGES=1
are read once per process: checked in subprocesses."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import posenc
from conftest import reference_add, reference_table
from rope_reference import default_inv_freq, reference_rope

# (8, 1024, 1024) float32: 32 MiB, the size from which outputs are reused.
SHAPE = (8, 1024, 1024)


# The AddressSanitizer build (scripts/sanitize.sh preloads libasan) takes fresh outputs by
# default: mmap'ed blocks would hide overflows from it.
SANITIZED = "libasan" in os.environ.get("LD_PRELOAD", "")


def policy_of_this_process() -> str:
    chosen = os.environ.get("POSENC_CPU_OUTPUTS", "")
    if chosen:
        return chosen
    if os.environ.get("POSENC_NO_HUGE_PAGES", "") not in ("", "0") or SANITIZED:
        return "fresh"
    return "reuse"


needs_reuse = pytest.mark.skipif(policy_of_this_process() != "reuse",
                                 reason="this process's POSENC_CPU_OUTPUTS is not the default")


@needs_reuse
def test_a_freed_output_block_serves_the_next_output_and_is_fully_overwritten():
    pe = posenc.PositionalEncoding(SHAPE[-1], 0.0, max_len=SHAPE[1]).eval()
    x = torch.randn(SHAPE)
    first = pe(x)
    first.fill_(float("nan"))  # what the next output must not show
    address = first.data_ptr()
    del first
    second = pe(x)
    assert second.data_ptr() == address  # the block was reused (not a fresh mmap)
    ref = x.double() + reference_table(torch.arange(SHAPE[1]), SHAPE[-1])
    torch.testing.assert_close(second.double(), ref, rtol=0, atol=2e-6)


@needs_reuse
def test_backward_and_rope_outputs_from_reused_blocks_are_exact():
    torch.manual_seed(0)
    pe = posenc.LearnedPositionalEncoding(SHAPE[-1], 0.1, max_len=SHAPE[1])
    x = torch.randn(SHAPE, requires_grad=True)
    grad = torch.randn(SHAPE)
    for _ in range(3):  # the 2nd and 3rd rounds run on blocks freed by the 1st
        out = pe(x)
        gx, = torch.autograd.grad(out, x, grad)
        keep = out.detach() != 0  # dropped elements are exact zeros in out and grad_x
        scale = 1 / 0.9
        expected_out = reference_add(x.detach(), pe.pe.detach()).double() * scale * keep
        torch.testing.assert_close(out.detach().double(), expected_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gx.double(), grad.double() * scale * keep, rtol=1e-6, atol=1e-6)
        del out, gx

    # RoPE in the Hugging Face layout (a transposed view): the output keeps q's strides.
    q = torch.randn(2, 16, 2048, 128).transpose(1, 2)  # bshd view of bhsd storage, 32 MiB
    inv = default_inv_freq(128, 10000.0)
    pos = torch.arange(2048).expand(2, 2048)
    for _ in range(3):
        out = posenc.functional.apply_rope(q)
        assert out.stride() == q.stride()
        torch.testing.assert_close(out.double(), reference_rope(q, "bshd", pos, inv, 128, False),
                                   rtol=1e-5, atol=1e-5)
        del out


@needs_reuse
def test_a_reused_block_output_resizes_clones_and_shares_like_any_tensor():
    pe = posenc.PositionalEncoding(SHAPE[-1], 0.0, max_len=SHAPE[1]).eval()
    x = torch.randn(SHAPE)
    out = pe(x)
    expected = out.clone()
    flat = out.view(-1)
    flat.resize_(flat.numel() * 2)  # through the block allocator: a larger block, data kept
    torch.testing.assert_close(flat[: expected.numel()], expected.view(-1), rtol=0, atol=0)
    flat[expected.numel():] = 1.0
    assert float(flat[-1]) == 1.0
    shared = pe(x).share_memory_()
    assert shared.is_shared()
    torch.testing.assert_close(shared, expected, rtol=0, atol=0)
    assert torch.equal(torch.from_numpy(pe(x).numpy()), expected)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("POSENC_CPU_OUTPUTS", "POSENC_NO_HUGE_PAGES")}
    package_root = str(Path(posenc.__file__).resolve().parent.parent)
    environment["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [environment.get("PYTHONPATH")])])
    environment.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment,
                          capture_output=True, text=True, timeout=300)


CHECK_VALUES = """
    import torch, posenc
    pe = posenc.PositionalEncoding(1024, 0.0, max_len=1024).eval()
    x = torch.randn(8, 1024, 1024)
    for _ in range(3):
        out = pe(x)
        ref = x.double() + pe.pe[0].double()
        assert (out.double() - ref).abs().max().item() < 2e-6
        del out
    print("ok")
"""


@pytest.mark.parametrize("env", [{"POSENC_CPU_OUTPUTS": "fresh"}, {"POSENC_CPU_OUTPUTS": "huge"},
                                 {"POSENC_NO_HUGE_PAGES": "1"}, {"POSENC_CPU_OUTPUTS": "reuse"}])
def test_each_setting_gives_the_same_values(env):
    proc = run_python(CHECK_VALUES, **env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_an_unknown_setting_is_an_error_naming_the_variable():
    proc = run_python(CHECK_VALUES, POSENC_CPU_OUTPUTS="always")
    assert proc.returncode != 0
    assert "posenc: expected POSENC_CPU_OUTPUTS to be reuse, fresh or huge, got 'always'" in proc.stderr


MAPPED = """
    def mapped(a):  # is address a inside one of this process's mappings?
        for line in open("/proc/self/maps"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= a < hi:
                return True
        return False
"""

MAPPED_AFTER_FREE = MAPPED + """
    import torch, posenc
    # 40 MiB: above glibc's largest mmap threshold (32 MiB), so torch's allocator unmaps it on free.
    pe = posenc.PositionalEncoding(1024, 0.0, max_len=1024).eval()
    out = pe(torch.randn(10, 1024, 1024))
    address = out.data_ptr()
    del out

    print(int(mapped(address)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
@pytest.mark.skipif(SANITIZED, reason="AddressSanitizer's allocator keeps freed blocks mapped (its quarantine), "
                                      "so a fresh output's block stays mapped too: only glibc's allocator tells them apart")
@pytest.mark.parametrize("env, kept", [({}, "1"), ({"POSENC_CPU_OUTPUTS": "reuse"}, "1"),
                                       ({"POSENC_CPU_OUTPUTS": "fresh"}, "0"), ({"POSENC_NO_HUGE_PAGES": "1"}, "0")])
def test_a_freed_output_stays_mapped_only_when_reused(env, kept):
    proc = run_python(MAPPED_AFTER_FREE, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == kept


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_reuses_the_parents_cached_blocks_and_its_own():
    code = """
        import os, torch, posenc
        pe = posenc.PositionalEncoding(1024, 0.0, max_len=1024).eval()
        x = torch.randn(8, 1024, 1024)
        ref = x.double() + pe.pe[0].double()
        pe(x)  # its block is freed at once: cached in the parent
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)  # GNU OpenMP's pool does not survive a fork (any op hangs)
            for _ in range(3):
                ok = (pe(x).double() - ref).abs().max().item() < 2e-6
                if not ok:
                    os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"


EMPTY_CACHE = MAPPED + """
    import torch, posenc
    pe = posenc.PositionalEncoding(1024, 0.0, max_len=1024).eval()
    out = pe(torch.randn(10, 1024, 1024))  # 40 MiB, a cached size
    address, nbytes = out.data_ptr(), out.nbytes
    del out

    before = mapped(address)
    released = torch.ops.posenc.empty_cpu_output_cache()
    print(int(before), int(released >= nbytes), int(mapped(address)), torch.ops.posenc.empty_cpu_output_cache())
    kept = pe(torch.randn(10, 1024, 1024))  # a block in use is never released
    torch.ops.posenc.empty_cpu_output_cache()
    kept.add_(1)
    print(torch.isfinite(kept).all().item())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
@pytest.mark.skipif(SANITIZED, reason="AddressSanitizer's allocator keeps freed blocks mapped (its quarantine)")
@pytest.mark.parametrize("env, expected", [({}, "1 1 0 0"), ({"POSENC_CPU_OUTPUTS": "fresh"}, "0 0 0 0")])
def test_empty_cpu_output_cache_unmaps_the_free_blocks_only(env, expected):
    proc = run_python(EMPTY_CACHE, **env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert lines[0].strip() == expected
    assert lines[1].strip() == "True"
