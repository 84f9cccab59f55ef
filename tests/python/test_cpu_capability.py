"""The CPU kernels' runtime ISA choice (csrc/ops/common/cpu/cpu_capability.h).

Each vector-ISA kernel is built for the baseline (DEFAULT) and AVX2; the library picks one
once per process, capped by POSENC_CPU_CAPABILITY=default|avx2|avx512. "avx512" is the AVX2
build with its AVX-512 paths (dropout in one pass from a 16-lane Philox; sinusoidal_table's
sweep; qk_norm_rope's rows; FP8 cache quantisation), "avx2" the same build with the 8-lane AVX2 Philox and the fused float32 dropout path. Each level runs in its own process (the choice is made once)
and every CPU kernel must give the same bits at every level the host supports: the dropout
masks (Philox, saved bits), the sums of the table gradient, the RoPE rotations (one fma per
output, so the baseline must not round a * b + c twice).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc  # noqa: F401  (registers torch.ops.posenc)
from conftest import host_levels

ROOT = Path(__file__).resolve().parents[2]


# Every CPU kernel once per dtype, on shapes that reach each path: rows of 512 (whole groups
# of the fused dropout), of 37 (blocks cut by rows, tails), a row of 1030 (cut by the
# 1024-element chunks); positions (S,), (B, S) and offsets; the saved-mask backward (grad
# mode on) and the regenerated one (the raw ops with the (seed, offset) key).
SCRIPT = r"""
import sys
import torch
import posenc

F = posenc.functional
out = {"capability": torch.ops.posenc.cpu_capability()}
g = torch.Generator().manual_seed(1234)

def rand(*shape, dtype):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    name = str(dtype)
    for d, batch_first in ((512, True), (37, False), (1030, True)):
        shape = (3, 9, d) if batch_first else (9, 3, d)
        x = rand(*shape, dtype=dtype).requires_grad_()
        table = rand(20, d, dtype=torch.float32).requires_grad_()
        for kind, kw in (("offset", dict(offset=4)),
                         ("pos_s", dict(positions=torch.randint(0, 20, (9,), generator=g))),
                         ("pos_bs", dict(positions=torch.randint(0, 20, (3, 9), generator=g)))):
            for p in (0.0, 0.3):
                torch.manual_seed(7)
                y = F.add_position(x, table, p=p, batch_first=batch_first, **kw)
                gx, gt = torch.autograd.grad(y, (x, table), rand(*shape, dtype=dtype))
                key = (name, d, kind, p)
                out[key] = (y.detach(), gx, gt)
        # The raw ops: the mask regenerated from a (seed, offset) key.
        grad = rand(*shape, dtype=dtype)
        rng = torch.tensor([0x1234_5678_9ABC_DEF, 40], dtype=torch.int64)
        out[(name, d, "dropout_backward")] = torch.ops.posenc.add_position_backward(grad, rng, 0.3)
        out[(name, d, "backward_with_table")] = torch.ops.posenc.add_position_backward_with_table(
            grad, rng, None, 1, batch_first, 0.3, 12, True)
    for head_dim, interleaved in ((64, False), (64, True), (40, False)):
        q = rand(2, 7, 4, head_dim, dtype=dtype).requires_grad_()
        k = rand(2, 7, 2, head_dim, dtype=dtype).requires_grad_()
        for rotary_dim in (head_dim, head_dim // 2):
            qo, ko = F.apply_rope(q, k, offset=3, interleaved=interleaved, rotary_dim=rotary_dim)
            gq, gk = torch.autograd.grad((qo, ko), (q, k), (torch.ones_like(qo), torch.ones_like(ko)))
            out[(name, "rope", head_dim, interleaved, rotary_dim)] = (qo.detach(), ko.detach(), gq, gk)
        # Long positions: angles over every quadrant and the float32 polynomials' whole
        # range (positions 3..9 alone agreed even while the levels rounded them differently).
        long_q = rand(1, 4096, 1, head_dim, dtype=dtype)
        out[(name, "rope_long", head_dim, interleaved)] = F.apply_rope(
            long_q, positions=torch.arange(4096) * 37 + 1000, interleaved=interleaved)
        # Positions anywhere in [-2**53, 2**53] (the vectorised angles' double reduction),
        # the heads-outer walk of "bhsd", multi-axis positions.
        out[(name, "rope_huge", head_dim, interleaved)] = F.apply_rope(
            long_q, positions=torch.randint(-2**53, 2**53, (4096,), generator=g), interleaved=interleaved)
        out[(name, "rope_bhsd", head_dim, interleaved)] = F.apply_rope(
            q.detach().transpose(1, 2).contiguous(), k.detach().transpose(1, 2).contiguous(), layout="bhsd",
            offset=5, interleaved=interleaved)
        out[(name, "rope_mrope", head_dim, interleaved)] = F.apply_rope(
            q.detach(), positions=torch.randint(0, 5000, (3, 7), generator=g), interleaved=interleaved,
            sections=[head_dim // 8, head_dim // 8, head_dim // 4], sections_mode="mrope")
        q2 = q.detach().clone()
        F.apply_rope(q2, positions=torch.arange(7).flip(0), inplace=True, interleaved=interleaved)
        out[(name, "rope_", head_dim, interleaved)] = q2
        cos, sin = F.rope_cos_sin(torch.arange(7), head_dim, dtype=torch.float32)
        qb = q.detach().transpose(1, 2).requires_grad_()
        kb = k.detach().transpose(1, 2).requires_grad_()
        qo, ko = F.apply_rope_cos_sin(qb, kb, cos, sin, interleaved=interleaved)
        gq, gk = torch.autograd.grad((qo, ko), (qb, kb), (torch.ones_like(qo), torch.ones_like(ko)))
        out[(name, "cos_sin", head_dim, interleaved)] = (qo.detach(), ko.detach(), gq, gk)
    # sinusoidal_table: the product recurrence of integer progressions (runs of 1024 rows,
    # 8 column pairs at a time and a tail), and libm per entry elsewhere.
    out[(name, "table")] = F.sinusoidal_table(torch.arange(-300, 4000, 3), 37, dtype=dtype)
    out[(name, "table_512")] = F.sinusoidal_table(torch.arange(3000), 512, dtype=dtype)
    out[(name, "table_float")] = F.sinusoidal_table(torch.rand(50, generator=g) * 100, 21, dtype=dtype)
# bfloat16 rows whose rounding meets its special lanes, compared as bits (int16 views; NaN
# lanes as one NaN: ATen's own scalar and vector roundings give NaN different payloads):
# random bit patterns (NaN, infinities, zeros, denormals, overflow among inputs and outputs),
# and values near float32's smallest normal whose rotations are denormal (the AVX512_BF16
# instruction flushes those; the rotation must round them as ATen does).
def as_bits(t):
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int16)

for name, x in (("bits", torch.randint(-2**15, 2**15, (2, 64, 4, 64), generator=g, dtype=torch.int16)
                 .view(torch.bfloat16)),
                ("tiny", (rand(2, 64, 4, 64, dtype=torch.float64) * 1e-38).to(torch.bfloat16))):
    for interleaved in (False, True):
        out[("bf16_special", name, interleaved)] = as_bits(F.apply_rope(x, offset=5, interleaved=interleaved))
        y = x.clone()
        F.apply_rope(y, offset=5, interleaved=interleaved, inplace=True)
        out[("bf16_special_", name, interleaved)] = as_bits(y)
# Dropout over random bit patterns in both half dtypes (the AVX-512 level's fused pass widens
# and rounds them itself): a half-precision and a float32 table.
for dtype in (torch.bfloat16, torch.float16):
    x = torch.randint(-2**15, 2**15, (3, 9, 1030), generator=g, dtype=torch.int16).view(dtype)
    for table in (rand(20, 1030, dtype=dtype), rand(20, 1030, dtype=torch.float32)):
        torch.manual_seed(7)
        with torch.no_grad():
            y = F.add_position(x, table, p=0.3, batch_first=True)
        out[("dropout_special", str(dtype), str(table.dtype))] = as_bits(y)
# add_position forwards large enough to stream (8 MiB or more written), eval and with dropout:
# streamed vectors (avx2, avx512 outside its fused dropout groups), plain stores (default).
# Rows of 200 (d % 128 != 0: the fused pass's remainder goes through the general path) and
# float16 too.
for dtype, seq, d in ((torch.float32, 512, 512), (torch.bfloat16, 512, 512), (torch.float32, 1024, 200),
                      (torch.float16, 2048, 200)):
    x = rand(16, seq, d, dtype=dtype)
    table = rand(seq + 8, d, dtype=dtype)
    for p in (0.0, 0.3):
        torch.manual_seed(11)
        with torch.no_grad():
            out[("add_position_stream", str(dtype), d, p)] = F.add_position(x, table, offset=3, p=p)
# The backward with the table gradient of a call large enough to stream grad_x (saved mask,
# batch rows two at a time: masked_saved_rows_fast).
for dtype in (torch.float32, torch.bfloat16):
    x = rand(16, 512, 512, dtype=dtype).requires_grad_()
    table = rand(520, 512, dtype=torch.float32).requires_grad_()
    torch.manual_seed(13)
    y = F.add_position(x, table, offset=3, p=0.3)
    out[("add_position_stream_backward", str(dtype))] = torch.autograd.grad(y, (x, table), rand(16, 512, 512,
                                                                                              dtype=dtype))
# FP8 caches of a prefill large enough to stream (8 MiB or more written): whole 64-byte lines
# (avx512), 32-byte halves (avx2), the scalar rounding (default); saturating, normal and
# subnormal values.
for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
    q, k, v = (rand(1, 2048, h, 128, dtype=torch.float32)
               * torch.tensor([300.0, 1.0, 3e-3])[torch.randint(0, 3, (1, 2048, h, 128), generator=g)]
               for h in (8, 4, 4))
    kc, vc = torch.zeros(1, 2056, 4, 128, dtype=fmt), torch.zeros(1, 2056, 4, 128, dtype=fmt)
    F.rope_append_kv(q, k, v, kc, vc, offset=5, k_scale=0.37, v_scale=3.0)
    out[("fp8_stream", str(fmt))] = (kc.view(torch.uint8), vc.view(torch.uint8))
torch.save(out, sys.argv[1])
"""


def run_at(level: str, tmp_path: Path) -> dict:
    env = dict(os.environ, POSENC_CPU_CAPABILITY=level, PYTHONPATH=str(ROOT / "python"))
    path = tmp_path / f"{level}.pt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


def flatten(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in flatten(v)]


def test_the_chosen_level_is_reported():
    level = torch.ops.posenc.cpu_capability()
    forced = os.environ.get("POSENC_CPU_CAPABILITY", "").lower()
    levels = host_levels()
    # A cap above what the CPU runs (or none) gives what it runs.
    assert level == (forced if forced in levels else levels[-1])


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
def test_each_level_runs_in_a_process_of_its_own(level):
    env = dict(os.environ, POSENC_CPU_CAPABILITY=level.upper(), PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-c", "import torch, posenc; "
                           "print(torch.ops.posenc.cpu_capability())"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    levels = host_levels()
    # A cap above what the CPU runs gives what it runs.
    want = level if level in levels else levels[-1]
    assert proc.stdout.strip() == want


def test_an_unknown_level_is_refused_by_name():
    env = dict(os.environ, POSENC_CPU_CAPABILITY="sse9", PYTHONPATH=str(ROOT / "python"))
    code = ("import torch, posenc\n"
            "try:\n"
            "    torch.ops.posenc.cpu_capability()\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("posenc: expected the environment variable POSENC_CPU_CAPABILITY to be one of "
            "default, avx2, avx512 (or unset), got 'sse9'") in proc.stdout


def test_every_level_gives_the_same_bits(tmp_path):
    levels = host_levels()
    if len(levels) < 2:
        pytest.skip("this CPU runs only the baseline kernels (no AVX2 + FMA + F16C)")
    # Without AVX-512F/BW/VL the AVX-512 Philox cannot run here: default and avx2 only.
    results = {level: run_at(level, tmp_path) for level in levels}
    base = results["default"]
    assert base["capability"] == "default"
    keys = [k for k in base if k != "capability"]
    assert len(keys) > 100
    for level in levels[1:]:
        got = results[level]
        assert got["capability"] == level
        for key in keys:
            for a, b in zip(flatten(base[key]), flatten(got[key]), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, key
                assert torch.equal(a, b), (level, key, (a.double() - b.double()).abs().max())
    # The cases are not all trivial: dropout zeroed elements and kept others.
    y, _, _ = base[("torch.float32", 512, "offset", 0.3)]
    assert 0.2 < (y == 0).double().mean() < 0.4



# qk_norm_rope forward and backward (every dtype, norm "head" and "hidden", a rotary slice
# inside the head): its sums of squares and backward products were contracted into FMAs by
# the AVX2 build and not by the baseline until the ISA units were compiled with
# -ffp-contract=off (CMakeLists.txt); its half-precision rows of 4 heads and more take vector
# paths of their own (bfloat16: widened and narrowed in lane order, the weights permuted), and
# on AVX-512 CPUs a backward of 16-lane rows (backward_heads_avx512).
QK_NORM_SCRIPT = r"""
import sys
import torch
import posenc

g = torch.Generator().manual_seed(5)
out = []
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    q = torch.randn(2, 37, 5, 128, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 37, 2, 128, generator=g).to(dtype).requires_grad_()
    w = (torch.rand(128, generator=g) + 0.5).to(dtype).requires_grad_()
    wh = (torch.rand(5 * 128, generator=g) + 0.5).to(dtype).requires_grad_()
    wkh = (torch.rand(2 * 128, generator=g) + 0.5).to(dtype).requires_grad_()
    for args, kw in (((w, w), {}), ((wh, wkh), {"norm": "hidden"}), ((w, w), {"rotary_offset": 32, "rotary_dim": 80})):
        a, b = posenc.functional.qk_norm_rope(q, k, *args, offset=3, **kw)
        grads = torch.autograd.grad((a, b), (q, k) + args, (torch.ones_like(a), torch.ones_like(b)))
        out += [a.detach(), b.detach(), *grads]
torch.save(out, sys.argv[1])
"""


def test_qk_norm_rope_gives_the_same_bits_at_every_level(tmp_path):
    levels = host_levels()
    if len(levels) < 2:
        pytest.skip("this CPU runs only the baseline kernels (no AVX2 + FMA + F16C)")
    outs = {}
    for level in levels:  # avx512: the half-precision backward's 16-lane rows
        env = dict(os.environ, POSENC_CPU_CAPABILITY=level, PYTHONPATH=str(ROOT / "python"))
        path = tmp_path / f"qk_{level}.pt"
        proc = subprocess.run([sys.executable, "-c", QK_NORM_SCRIPT, str(path)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outs[level] = torch.load(path)
    for level in levels[1:]:
        assert len(outs[level]) == len(outs["default"])
        for a, b in zip(outs["default"], outs[level]):
            assert torch.equal(a, b), level
