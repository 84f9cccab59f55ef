"""No hidden host-device sync in a training or decoding step on a GPU: every hot call, forward
and backward, runs under torch.cuda.set_sync_debug_mode("error"), which raises at any
synchronising CUDA call torch makes (a blocking copy to or from the device, .item(), a stream
or device synchronize) wherever it is made: in the Python front ends, in torch's ops and in
posenc's C++ (which test_host_syncs.py and test_no_host_sync.py, on fake or CPU tensors, cannot
see). The documented syncs are left out: the modules' check_positions with tensor positions,
check_inputs=True, the length-scaled types ("dynamic", "longrope") without seq_len (apply_rope,
rope_append_kv, rope_shift_kv's from/to_seq_len and rope_cos_sin read the longest position). Needs a GPU (scripts/gpu_check.sh); not run here."""

import pytest
import torch

import posenc

F = posenc.functional


def _steps(device):
    """(name, call) pairs: each call builds its inputs, runs the forward and, where the op is
    differentiable, the backward. The inputs are made before the sync check starts."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_(grad)

    def backward(*outputs):
        torch.autograd.backward([o for o in outputs], [torch.ones_like(o) for o in outputs])

    B, S, H, KV, D = 2, 6, 4, 2, 32
    positions = torch.arange(S, device=device).expand(B, S).contiguous() + 3
    offsets = torch.tensor([0, 5], device=device)
    cu = torch.tensor([0, 4, 9], device=device, dtype=torch.int32)
    pe = posenc.PositionalEncoding(D, 0.1, 64).to(device)
    learned = posenc.LearnedPositionalEncoding(D, 0.1, 64).to(device)
    rope = posenc.RotaryPositionalEncoding(D, 64).to(device)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    dynamic = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=4)
    qkn = posenc.QKNormRotary(D).to(device)
    cos, sin = F.rope_cos_sin(torch.arange(S, device=device), D)
    cache = torch.zeros(B, 16, KV, D, device=device)
    pool = torch.zeros(5, 8, KV, D, device=device)  # 40 slots in blocks of 8
    slots = torch.tensor([7, 30], device=device)
    fp8 = torch.zeros(B, 16, KV, D, device=device, dtype=torch.float8_e4m3fn)
    scale = torch.tensor(0.5, device=device)
    x = randn(B, S, D, grad=True)
    q, k = randn(B, S, H, D, grad=True), randn(B, S, KV, D, grad=True)
    q1, k1, v1 = randn(B, 1, H, D), randn(B, 1, KV, D), randn(B, 1, KV, D)
    packed = randn(9, H, D, grad=True)
    table = randn(64, D, grad=True)
    t = torch.rand(B, device=device) * 1000
    return [
        ("PositionalEncoding train", lambda: backward(pe(x, offset=5))),
        ("LearnedPositionalEncoding train", lambda: backward(learned(x, offset=5))),
        ("add_position positions dropout", lambda: backward(F.add_position(x, table, positions=positions, p=0.1))),
        ("add_position tensor offset", lambda: backward(F.add_position(x, table, offset=offsets[1:]))),
        ("apply_rope positions", lambda: backward(*F.apply_rope(q, k, positions=positions))),
        ("apply_rope offsets yarn", lambda: backward(*F.apply_rope(q, k, offset=offsets, scaling=yarn))),
        ("apply_rope dynamic seq_len", lambda: backward(*F.apply_rope(q, k, scaling=dynamic, seq_len=S))),
        ("apply_rope thd", lambda: backward(F.apply_rope(packed, cu_seqlens=cu, layout="thd"))),
        ("RotaryPositionalEncoding", lambda: backward(*rope(q, k, offset=7))),
        ("apply_rope_cos_sin", lambda: backward(*F.apply_rope_cos_sin(q, k, cos, sin, layout="bshd"))),
        ("rope_cos_sin", lambda: F.rope_cos_sin(positions, D, scaling=yarn)),
        ("qk_norm_rope", lambda: backward(*qkn(q, k, offset=offsets))),
        ("rope_append_kv decode", lambda: F.rope_append_kv(q1, k1, v1, cache, cache.clone(), offset=offsets)),
        ("rope_append_kv paged", lambda: F.rope_append_kv(q1[:, 0], k1[:, 0], v1[:, 0], pool, pool.clone(),
                                                          slot_mapping=slots, positions=offsets, layout="thd")),
        ("rope_append_kv FP8", lambda: F.rope_append_kv(q1, k1, v1, fp8, fp8.clone(), offset=offsets,
                                                        k_scale=scale, v_scale=scale)),
        ("rope_append_kv QK-norm", lambda: F.rope_append_kv(q1, k1, v1, cache, cache.clone(), offset=offsets,
                                                            q_weight=qkn.q_norm.weight.detach(),
                                                            k_weight=qkn.k_norm.weight.detach())),
        ("rope_shift_kv", lambda: F.rope_shift_kv(cache, torch.arange(4, 8, device=device),
                                                  torch.arange(2, 6, device=device),
                                                  rows=torch.arange(4, 8, device=device))),
        ("sinusoidal_table", lambda: F.sinusoidal_table(positions, D)),
        ("timestep_embedding", lambda: F.timestep_embedding(t, D)),
    ]


STEPS = [name for name, _ in _steps("cpu")]


@pytest.mark.cuda
@pytest.mark.parametrize("step", STEPS)
def test_hot_calls_do_not_sync(step):
    call = dict(_steps("cuda"))[step]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_the_steps_run_on_the_cpu():
    """Every step is a valid call (so the GPU test does not rot unseen), each named once."""
    steps = _steps("cpu")
    assert len(dict(steps)) == len(steps)
    for _name, call in steps:
        call()
