"""The dropout mask as an independent reference: Philox4x32-10 written out in NumPy from
posenc/math/philox.h (counter = (offset / 4, block), key = seed, 16 bits per element, keep
iff bits >= round(p * 65536)), shared by the tests that check the CPU kernels' masks bit for
bit (test_add_position_dropout_bits.py, test_add_position_saved_mask.py)."""
import numpy as np
import torch

M32 = np.uint64(0xFFFFFFFF)


def philox_bits16(seed: int, offset: int, n: int) -> np.ndarray:
    """The 16 random bits of elements 0 .. n - 1 of a call with this (seed, offset)."""
    seed &= (1 << 64) - 1
    blocks = np.arange((n + 7) // 8, dtype=np.uint64)
    c0 = np.full_like(blocks, (offset >> 2) & 0xFFFFFFFF)
    c1 = np.full_like(blocks, (offset >> 34) & 0xFFFFFFFF)
    c2, c3 = blocks & M32, blocks >> np.uint64(32)
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    for _ in range(10):
        p0, p1 = c0 * np.uint64(0xD2511F53), c2 * np.uint64(0xCD9E8D57)
        hi0, lo0 = p0 >> np.uint64(32), p0 & M32
        hi1, lo1 = p1 >> np.uint64(32), p1 & M32
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    words = np.stack([c0, c1, c2, c3], axis=1)
    halves = np.stack([words & np.uint64(0xFFFF), words >> np.uint64(16)], axis=2)
    return halves.reshape(-1)[:n].astype(np.int64)


def keep_mask(seed: int, offset: int, shape, p: float) -> torch.Tensor:
    threshold = min(int(p * 65536.0 + 0.5), 65536)
    n = int(np.prod(shape))
    return torch.from_numpy(philox_bits16(seed, offset, n) >= threshold).reshape(shape)


def dropout_scale(p: float, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The survivors' factor as nn.Dropout computes it in ``dtype`` (float32 or float64): 1 - p
    rounded to the dtype, then one division in it (0 for p >= 1). (1 / (1 - p) in float64
    rounded to float32 differs for about a quarter of p values, p = 0.15 among them.)"""
    if p >= 1:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.ones((), dtype=dtype, device=device) / torch.tensor(1.0 - p, dtype=dtype, device=device)


def expected_masked(grad: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """grad * (keep ? scale : 0) in the accumulation dtype, rounded once (the kernels' math)."""
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    scale = dropout_scale(p, acc)
    factor = torch.where(keep, scale, torch.zeros((), dtype=acc))
    return (grad.to(acc) * factor).to(grad.dtype)
