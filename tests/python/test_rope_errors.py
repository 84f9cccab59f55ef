"""RoPE: bad input raises a clear error naming the argument, its value and what was expected."""

import re
import subprocess
import sys

import pytest
import torch

import posenc
from conftest import DEVICES, host_levels
from posenc._rope import SCALING_KEYS
from posenc.functional import apply_rope, rope_frequencies


def qk(device="cpu", D=8):
    return torch.randn(2, 5, 3, D, device=device), torch.randn(2, 5, 1, D, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_dim_and_head_dim(device):
    q, k = qk(device)
    with pytest.raises(ValueError, match="rotary_dim to be even.*got 5"):
        apply_rope(q, k, rotary_dim=5)
    with pytest.raises(ValueError, match=r"rotary_dim <= head_dim = 8, got 10"):
        apply_rope(q, k, rotary_dim=10)
    with pytest.raises(ValueError, match="positive even number or None, got 0"):
        apply_rope(q, rotary_dim=0)
    with pytest.raises(ValueError, match=r"even.*got 7 \(the heads' head_dim\)"):
        apply_rope(torch.randn(1, 2, 1, 7, device=device))
    # Past rotary_offset, the width that is left; a cache's heads named as q's are (rope_shift_kv
    # has no q: the message said "the head_dim of q", and 5 for heads of 8).
    with pytest.raises(ValueError, match=r"even.*got 5 \(head_dim 8 - rotary_offset 3\)"):
        apply_rope(q, rotary_offset=3)
    with pytest.raises(ValueError, match=r"even.*got 5 \(the heads' head_dim\)"):
        posenc.functional.rope_shift_kv(torch.zeros(1, 4, 1, 5, device=device), torch.arange(2), torch.arange(2) + 1)
    assert apply_rope(torch.randn(1, 2, 1, 7, device=device), rotary_dim=6).shape == (1, 2, 1, 7)
    with pytest.raises(RuntimeError, match="same head_dim"):
        apply_rope(q, torch.randn(2, 5, 1, 6, device=device))
    with pytest.raises(RuntimeError, match="same batch and sequence sizes"):
        apply_rope(q, torch.randn(2, 4, 1, 8, device=device))
    with pytest.raises(ValueError, match="rotary_dim 1024 is not supported; expected at most 512"):
        apply_rope(torch.randn(1, 1, 1, 1024, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_and_ranks(device):
    q, k = qk(device)
    with pytest.raises(TypeError, match="floating-point dtype.*torch.int64|floating-point dtype.*Long"):
        apply_rope(torch.ones(1, 2, 1, 8, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="k to have q's dtype"):
        apply_rope(q, k.double())
    with pytest.raises(RuntimeError, match=r"q to be a 4-D tensor \(batch, seq, heads, head_dim\)"):
        apply_rope(q[0])
    with pytest.raises(RuntimeError, match=r"3-D tensor \(tokens, heads, head_dim\) for layout 'thd'"):
        apply_rope(q, layout="thd", cu_seqlens=torch.tensor([0, 2], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_positions_dtype_shape_device(device):
    q, k = qk(device)
    with pytest.raises(TypeError, match="positions to have dtype torch.int64, got Float"):
        apply_rope(q, k, positions=torch.arange(5.0, device=device))
    with pytest.raises(TypeError, match="positions to have dtype torch.int64, got Int"):
        apply_rope(q, k, positions=torch.arange(5, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match=r"positions of shape \(seq,\) = \(5,\) or \(batch, seq\) = \(2, 5\), got shape \[4\]"):
        apply_rope(q, k, positions=torch.arange(4, device=device))
    with pytest.raises(RuntimeError, match="positions on q's device"):
        apply_rope(q, k, positions=torch.arange(5, device="meta"))
    with pytest.raises(RuntimeError, match=r"offsets of shape \(2,\), one per batch row"):
        apply_rope(q, k, offset=torch.tensor([1, 2, 3], device=device))
    with pytest.raises(TypeError, match="offset to be an int or an int64 tensor, got 1.5"):
        apply_rope(q, k, offset=1.5)


@pytest.mark.parametrize("device", DEVICES)
def test_cu_seqlens(device):
    x = torch.randn(9, 2, 8, device=device)
    # The op checks CPU cu_seqlens; CUDA ones on the host only with check_inputs=True (by
    # default the kernel asserts on the device: test_cuda_device_asserts.py).
    for bad in ([0, 5, 3, 9], [0, 4, 8], [1, 4, 9], [0, 4, 10]):
        with pytest.raises(ValueError, match=r"cu_seqlens to start at 0, never decrease and end at the number of tokens 9"):
            apply_rope(x, cu_seqlens=torch.tensor(bad, device=device), layout="thd", check_inputs=True)
        if device == "cpu":
            with pytest.raises(ValueError, match=r"cu_seqlens to start at 0, never decrease and end at the number of tokens 9"):
                apply_rope(x, cu_seqlens=torch.tensor(bad, device=device), layout="thd")
    with pytest.raises(ValueError, match="layout 'thd' .* needs cu_seqlens"):
        apply_rope(x, layout="thd")
    with pytest.raises(ValueError, match="cu_seqlens is only used with layout 'thd'"):
        apply_rope(torch.randn(1, 9, 2, 8, device=device), cu_seqlens=torch.tensor([0, 9], device=device))
    with pytest.raises(TypeError, match="cu_seqlens to have dtype torch.int64 or torch.int32"):
        apply_rope(x, cu_seqlens=torch.tensor([0.0, 9.0], device=device), layout="thd")
    with pytest.raises(ValueError, match="positions=None with layout 'thd'"):
        apply_rope(x, cu_seqlens=torch.tensor([0, 9], device=device), positions=torch.arange(9, device=device), layout="thd")


def test_layout_and_scaling_names():
    q, k = qk()
    with pytest.raises(ValueError, match="unknown layout 'bsdh'; expected one of bshd, bhsd, sbhd, thd"):
        apply_rope(q, k, layout="bsdh")
    with pytest.raises(TypeError, match="expected layout to be a str, one of bshd, bhsd, sbhd, thd; got 0"):
        apply_rope(q, k, layout=0)
    for scaling in ("linear", [("rope_type", "linear"), ("factor", 2.0)]):  # dict() read the first as pairs
        with pytest.raises(TypeError, match="RotaryPositionalEncoding: expected scaling to be None or a dict, got"):
            posenc.RotaryPositionalEncoding(8, 16, scaling=scaling)
    with pytest.raises(ValueError, match="unknown layout 'hsd'; expected one of 'bshd', 'bhsd', 'sbhd' or 'thd'"):
        torch.ops.posenc.rope(q, k, layout="hsd")
    with pytest.raises(ValueError, match="unknown rope scaling type 'ntk'; expected one of default, linear, dynamic, yarn, llama3"):
        apply_rope(q, scaling={"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(ValueError, match="unknown rope scaling type 'xpos'; expected one of 'default', 'linear'"):
        torch.ops.posenc.rope(q, k, rope_type="xpos")
    with pytest.raises(ValueError, match="needs 'rope_type'"):
        apply_rope(q, scaling={"factor": 2.0})
    # The dict as given (it showed what was left after rope_theta and partial_rotary_factor: {}).
    with pytest.raises(ValueError, match=r"needs 'rope_type'.*got \{'rope_theta': 500.0, 'partial_rotary_factor': 0.5\}"):
        apply_rope(q, scaling={"rope_theta": 500.0, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"needs 'rope_type'.*got \{'rope_type': None, 'rope_theta': 5.0\}"):
        apply_rope(q, scaling={"rope_type": None, "rope_theta": 5.0})
    with pytest.raises(ValueError, match=r"unknown rope scaling key\(s\) \['fator'\]"):
        apply_rope(q, scaling={"rope_type": "linear", "fator": 2.0})
    with pytest.raises(ValueError, match="'llama3' needs the key 'low_freq_factor'"):
        apply_rope(q, scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="'yarn' needs the key 'original_max_position_embeddings'"):
        apply_rope(q, scaling={"rope_type": "yarn", "factor": 8.0})
    with pytest.raises(ValueError, match="'factor' to be a positive number, got -2"):
        apply_rope(q, scaling={"rope_type": "linear", "factor": -2.0})
    with pytest.raises(TypeError, match="'factor' to be a number, got '2'"):
        apply_rope(q, scaling={"rope_type": "linear", "factor": "2"})
    with pytest.raises(ValueError, match="'high_freq_factor' .* greater than 'low_freq_factor'"):
        rope_frequencies(8, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 64})
    with pytest.raises(TypeError, match="scaling to be None or a dict"):
        apply_rope(q, scaling="linear")
    with pytest.raises(ValueError, match="base > 1, got 1"):
        apply_rope(q, base=1.0)
    # Module: yarn takes original_max_position_embeddings from max_len.
    rope = posenc.RotaryPositionalEncoding(8, max_len=64, scaling={"rope_type": "yarn", "factor": 2.0})
    assert rope(q).shape == q.shape
    # "dynamic" rescales only beyond original_max_position_embeddings, and the module stops
    # at max_len: a missing key (no default) or one at or above max_len would be a no-op.
    with pytest.raises(ValueError, match=r"'dynamic' scaling needs 'original_max_position_embeddings'.*below max_len=64"):
        posenc.RotaryPositionalEncoding(8, max_len=64, scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=64 >= max_len=64 would never apply"):
        posenc.RotaryPositionalEncoding(8, max_len=64, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64})
    # The model's length given apart from max_len is the baseline transformers reads (its
    # dynamic rule takes config.max_position_embeddings): the dict needs no key then.
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    by_model = posenc.RotaryPositionalEncoding(8, max_len=64, max_position_embeddings=16, scaling=dynamic)
    keyed = posenc.RotaryPositionalEncoding(8, max_len=64, scaling={**dynamic, "original_max_position_embeddings": 16})
    long_q = torch.randn(1, 40, 2, 8, dtype=torch.float64)
    assert torch.equal(by_model(long_q), keyed(long_q))
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=64 >= max_len=64 would never apply"):
        posenc.RotaryPositionalEncoding(8, max_len=64, max_position_embeddings=64, scaling=dynamic)
    # The scaling applied (positions past 16 rotate otherwise than unscaled).
    assert not torch.allclose(by_model(long_q), posenc.RotaryPositionalEncoding(8, max_len=64)(long_q))
    # A key given as None is not given (as the parser reads it): the model's length.
    by_none = posenc.RotaryPositionalEncoding(8, max_len=64, max_position_embeddings=16,
                                              scaling={**dynamic, "original_max_position_embeddings": None})
    assert torch.equal(by_none(long_q), keyed(long_q))
    # Both given and different: two readings (transformers reads the model's, posenc the key),
    # refused as rope_cos_sin refuses them; equal ones agree.
    with pytest.raises(ValueError, match=r"scales beyond one length.*\(32\).*\(16\)"):
        posenc.RotaryPositionalEncoding(8, max_len=64, max_position_embeddings=32,
                                        scaling={**dynamic, "original_max_position_embeddings": 16})
    both = posenc.RotaryPositionalEncoding(8, max_len=64, max_position_embeddings=16,
                                           scaling={**dynamic, "original_max_position_embeddings": 16})
    assert torch.equal(both(long_q), keyed(long_q))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_messages_name_what_the_caller_passed(device):
    """Issue 26 item 5: a missing required key is reported missing (it used to read as NaN,
    "got nan"), and a width that comes from sections names sections, not the rotary_dim the
    caller never passed."""
    q = torch.randn(1, 5, 2, 16, device=device)
    # ("proportional" without partial_rotary_factor is transformers' default 1.0 now, not a
    # missing key: test_rope_proportional.py.)
    with pytest.raises(ValueError, match=r"^posenc: rope scaling type 'linear' needs the key "
                       r"'factor', which was not given"):
        apply_rope(q, scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match=r"^posenc: rope scaling type 'linear' needs the key "
                       r"'factor', which was not given"):
        rope_frequencies(16, scaling={"rope_type": "linear"})
    pos3 = torch.zeros(3, 5, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"^posenc: expected sections to hold at most head_dim / 2 = 8 "
                       r"rotary pairs, got sections=\[4, 4, 4\] \(12 pairs\)"):
        apply_rope(q, positions=pos3, sections=[4, 4, 4])
    # A rotary_dim given explicitly is still what the message names.
    with pytest.raises(ValueError, match=r"^posenc: expected rotary_dim <= head_dim = 16, got 24"):
        apply_rope(q, positions=pos3, sections=[4, 4, 4], rotary_dim=24)


@pytest.mark.cuda
def test_cuda_q_with_cpu_index_tensors():
    """Index tensors on another device than q: a RuntimeError naming the argument and both
    devices, from the functional form and from the module (whose range check must not
    swallow it)."""
    q, k = qk("cuda")
    dev = str(q.device)  # cuda:0
    with pytest.raises(RuntimeError, match=rf"positions on q's device {dev}, got positions on cpu"):
        apply_rope(q, k, positions=torch.arange(5))
    with pytest.raises(RuntimeError, match=rf"offsets on q's device {dev}, got offsets on cpu"):
        apply_rope(q, k, offset=torch.tensor([1, 2]))
    x = torch.randn(9, 2, 8, device="cuda")
    with pytest.raises(RuntimeError, match=rf"cu_seqlens on q's device {dev}, got cu_seqlens on cpu"):
        apply_rope(x, cu_seqlens=torch.tensor([0, 4, 9]), layout="thd")
    with pytest.raises(RuntimeError, match=rf"cu_seqlens on q's device {dev}, got cu_seqlens on cpu"):
        apply_rope(x, x[:, :1].clone(), cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32), layout="thd")
    with pytest.raises(RuntimeError, match=rf"k on q's device {dev}, got k on cpu"):
        apply_rope(q, k.cpu())
    rope = posenc.RotaryPositionalEncoding(8, max_len=64).cuda()
    with pytest.raises(RuntimeError, match=rf"positions on q's device {dev}, got positions on cpu"):
        rope(q, k, positions=torch.arange(5))
    with pytest.raises(RuntimeError, match=rf"offsets on q's device {dev}, got offsets on cpu"):
        rope(q, k, offset=torch.tensor([1, 2]))


@pytest.mark.parametrize("key", ["beta_fast", "beta_slow"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf")])
def test_yarn_betas_must_be_positive(key, bad):
    """yarn's optional beta_fast / beta_slow: a given 0 or negative value used to give NaN
    frequencies (beta_fast=0) or a silently clamped ramp; now a ValueError naming the key."""
    q = torch.randn(1, 4, 1, 8)
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4, key: bad}
    with pytest.raises(ValueError, match=rf"rope scaling key '{key}' to be (a positive number|finite)"):
        apply_rope(q, scaling=scaling)
    # Positive values are taken as given (HF's defaults are 32 and 1).
    ok = dict(scaling, **{key: 16.0 if key == "beta_fast" else 2.0})
    inv, _ = rope_frequencies(8, scaling=ok)
    assert torch.isfinite(inv).all()


def test_rotary_dim_cap_applies_when_the_module_is_built():
    """The kernels hold at most 256 frequency pairs: a module asking for more used to build
    and fail only at its first call (and rope_frequencies raised MemoryError for 2**40)."""
    with pytest.raises(ValueError, match="rotary_dim 1024 is not supported; expected at most 512"):
        posenc.RotaryPositionalEncoding(1024)
    with pytest.raises(ValueError, match="rotary_dim 1099511627776 is not supported"):
        torch.ops.posenc.rope_frequencies(2**40, 10000.0, "default", [], 0)
    assert posenc.RotaryPositionalEncoding(1024, rotary_dim=64).inv_freq.shape == (32,)


@pytest.mark.parametrize("device", DEVICES)
def test_positions_beyond_2_pow_53_are_refused_not_wrapped(device):
    """Positions, offsets and the int offset live in [-2**53, 2**53]: beyond, sums could wrap
    around int64 (the module's range check passed a position of 2**63 - 1 + 1 that way)."""
    msg = r"expected {} within \[-2\*\*53, 2\*\*53\] \(integers exact in the float64 angle\), got {}"
    q = torch.randn(1, 2, 1, 8, device=device)
    with pytest.raises(ValueError, match=msg.format("offset", 2**53 + 1)):
        apply_rope(q, offset=2**53 + 1)
    with pytest.raises(ValueError, match=msg.format("offset", -(2**62))):
        apply_rope(q, offset=-(2**62))
    assert apply_rope(q, offset=2**53 - 1).shape == q.shape  # the edge is accepted
    rope = posenc.RotaryPositionalEncoding(8, max_len=16)
    big = torch.tensor([0, 2**63 - 1], device=device)
    with pytest.raises(ValueError, match=msg.format("positions", 2**63 - 1)):
        rope(q, positions=big, offset=1)
    with pytest.raises(ValueError, match=msg.format("positions", -(2**63))):
        rope(torch.randn(1, 1, 1, 8, device=device), positions=torch.tensor([-(2**63)], device=device),
             offset=torch.tensor([-(2**63)], device=device))
    thd = posenc.RotaryPositionalEncoding(8, max_len=16, layout="thd")
    with pytest.raises(ValueError, match=msg.format("offsets", 2**63 - 1)):
        thd(torch.randn(2, 1, 8, device=device), cu_seqlens=torch.tensor([0, 2], device=device),
            offset=torch.tensor([2**63 - 1], device=device))
    if device == "cpu":  # CPU index values are checked by the op itself (no sync to pay)
        with pytest.raises(ValueError, match=msg.format("positions", 2**60)):
            apply_rope(q, positions=torch.tensor([0, 2**60]))
        with pytest.raises(ValueError, match=msg.format("offsets", -(2**62))):
            apply_rope(q, offset=torch.tensor([-(2**62)]))
    # Meta tensors: the int offset and base are checked by the Meta kernel too.
    with pytest.raises(ValueError, match=msg.format("offset", 2**60)):
        apply_rope(q.to("meta"), offset=2**60)
    with pytest.raises(ValueError, match=r"expected base > 1, got -1"):
        apply_rope(q.to("meta"), base=-1.0)
    # "dynamic" reads the longest position through the same check.
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}
    with pytest.raises(ValueError, match=msg.format("positions", 2**62)):
        apply_rope(q, positions=torch.tensor([0, 2**62], device=device), scaling=dyn)


@pytest.mark.parametrize("device", DEVICES)
def test_module_names_bad_cu_seqlens_not_the_positions_they_imply(device):
    thd = posenc.RotaryPositionalEncoding(8, max_len=16, layout="thd")
    q = torch.randn(3, 1, 8, device=device)
    for cu, got in (([0, 100], "first value 0, last value 100, shortest step 100"),
                    ([1, 3], "first value 1, last value 3"),
                    ([0, 2, 1, 3], "first value 0, last value 3, shortest step -1")):
        with pytest.raises(ValueError, match=rf"expected cu_seqlens to start at 0, never decrease and end at "
                                             rf"the number of tokens 3, got {got}"):
            thd(q, cu_seqlens=torch.tensor(cu, device=device))
    with pytest.raises(ValueError, match=r"got 1 value\(s\) for 3 tokens"):
        thd(q, cu_seqlens=torch.tensor([0], device=device))


def test_settings_giving_non_finite_frequencies_are_refused():
    """Each scaling key passes its own check, but a linear factor of 1e-310 gives inf
    frequencies (NaN outputs) and a dynamic base beyond float64 gives 0 (no rotation); past
    2**16 (a linear factor of 1e-300: NaN outputs, its angles beyond the reduction's reach)
    a frequency is refused too."""
    msg = r"give inverse frequency {} for pair {}; expected finite positive frequencies of at most 2\*\*16"
    with pytest.raises(ValueError, match=msg.format("inf", 0)):
        rope_frequencies(8, scaling={"rope_type": "linear", "factor": 1e-310})
    with pytest.raises(ValueError, match=msg.format("inf", 0)):
        apply_rope(torch.randn(1, 2, 1, 8), scaling={"rope_type": "linear", "factor": 1e-310})
    with pytest.raises(ValueError, match=msg.format(0, 1)):
        torch.ops.posenc.rope_frequencies(8, 1e300, "dynamic", [0b1001, 2.0, 0.0, 0.0, 4.0] + [0.0] * (len(SCALING_KEYS) - 4),
                                          2**62)
    for factor in (1e-300, 2.0**-16 / 1.5):
        with pytest.raises(ValueError, match=msg.format(re.escape(f"{1 / factor:g}"), 0)):
            apply_rope(torch.randn(1, 2, 1, 8), scaling={"rope_type": "linear", "factor": factor})
    assert rope_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0**-16})[0][0] == 2.0**16
    long = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1e-308] * 4,
            "original_max_position_embeddings": 4, "factor": 4.0}
    with pytest.raises(ValueError, match=r"expected finite positive frequencies of at most 2\*\*16"):
        apply_rope(torch.randn(1, 9, 1, 8), scaling=long)


@pytest.mark.parametrize("level", host_levels())
def test_angles_past_2_to_the_55_take_their_quadrant(level, monkeypatch):
    """The reduction's quadrant at the largest angles the frequency bound allows: from k0 mod 4
    plus a second step's adjust, whose sum left [-2, 5] past ~2**55.8 (a quarter turn off:
    inverse frequency 10 at position 6369051672525776 gave (cos, sin) = (0.7165, 0.6976)
    where float64 gives (0.6976, -0.7165); found by fuzzing). Every CPU level (the AVX2
    kernel has its own vector form), against cos and sin of the same float64 angle."""
    script = """
import math, torch
from posenc.functional import apply_rope
pos = [6369051672525776, 2**53 - 1, 2**53, 3 * 2**51 + 7, 2**52 + 12345]
for factor in (0.1, 2.0**-16, 0.001):
    x = torch.zeros(1, len(pos), 1, 2, dtype=torch.float64)
    x[..., 0] = 1.0
    out = apply_rope(x, positions=torch.tensor(pos), scaling={"rope_type": "linear", "factor": factor})
    out32 = apply_rope(x.float(), positions=torch.tensor(pos), scaling={"rope_type": "linear", "factor": factor})
    for i, p in enumerate(pos):
        angle = float(p) * (1.0 / factor)
        want = (math.cos(angle), math.sin(angle))
        for got, tol in ((out, 1e-9), (out32, 2e-7)):
            c, s = float(got[0, i, 0, 0]), float(got[0, i, 0, 1])
            assert abs(c - want[0]) <= tol and abs(s - want[1]) <= tol, (factor, p, (c, s), want)
print("ok")
"""
    monkeypatch.setenv("POSENC_CPU_CAPABILITY", level)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_module_on_meta_tensors_infers_shapes_without_reading_index_tensors():
    rope = posenc.RotaryPositionalEncoding(8, max_len=16).to("meta")
    q = torch.randn(1, 3, 2, 8, device="meta")
    assert rope(q, positions=torch.arange(3, device="meta")).shape == q.shape
    oq, ok = rope(q, q, offset=torch.zeros(1, dtype=torch.long, device="meta"))
    assert oq.is_meta and ok.shape == q.shape


def test_numbers_python_cannot_hand_the_op_are_value_errors():
    """Found by fuzzing: a scaling value past float's range was a bare OverflowError, a section
    past int64 the schema parser's RuntimeError, a partial_rotary_factor giving no rotary pair
    was blamed on rotary_dim."""
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match=r"expected rope scaling key 'factor' to be finite, got inf"):
        apply_rope(q, scaling={"rope_type": "linear", "factor": 10**400})
    with pytest.raises(ValueError, match=r"apply_rope: expected each of sections to fit in int64, got 2\*\*70|"
                                         r"apply_rope: expected each of sections to fit in int64, got 1180591620717411303424"):
        apply_rope(q, sections=[2**70, 1])
    with pytest.raises(ValueError, match=r"apply_rope: the scaling dict's partial_rotary_factor 0.01 gives rotary_dim "
                                         r"int\(8 \* 0.01\) = 0; expected a positive even number"):
        apply_rope(q, scaling={"rope_type": "default", "partial_rotary_factor": 0.01})
    assert apply_rope(q, scaling={"rope_type": "default", "partial_rotary_factor": 0.25})[..., 2:].equal(q[..., 2:])


def test_a_meta_offset_beside_a_real_q_is_refused_by_name():
    """A 0-dim meta offset with a CPU q: ATen's "Cannot copy out of meta tensor" (a
    NotImplementedError) before; the ops' own refusal of a meta tensor among real ones now."""
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match=r"apply_rope: got offset on the meta device but q on cpu"):
        apply_rope(q, offset=torch.tensor(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"RotaryPositionalEncoding: got offset on the meta device but q on cpu"):
        posenc.RotaryPositionalEncoding(8)(q, offset=torch.tensor(3, device="meta"))
    assert apply_rope(q.to("meta"), offset=torch.tensor(3, device="meta")).is_meta


def test_a_section_that_is_not_positive_is_named_before_the_width():
    """sections=[-1, 5] was reported as "at most head_dim / 2 = 4 rotary pairs ... (5 pairs)"
    (found by fuzzing): the section itself is what is wrong."""
    q = torch.randn(1, 2, 1, 8)
    for sections in ([-1, 5], [0, 2], [3, -2**62]):
        with pytest.raises(ValueError, match=r"expected every section to be a positive number of rotary pairs, "
                                             rf"got sections=\[{sections[0]}, {sections[1]}\]"):
            apply_rope(q, positions=torch.zeros(2, 2, dtype=torch.long), sections=sections)
    with pytest.raises(ValueError, match=r"expected sections to hold at most head_dim / 2 = 4 rotary pairs"):
        apply_rope(q, positions=torch.zeros(2, 2, dtype=torch.long), sections=[2, 3])
