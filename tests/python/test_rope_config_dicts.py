"""RoPE settings as users already hold them: transformers 4 and 5 rope dicts (rope_theta,
partial_rotary_factor, Qwen-VL's mrope_section / mrope_interleaved, "mrope"), Hugging Face's
(1, seq) position_ids, and torchtune's ``input_pos=``."""

import pytest
import torch

import posenc
from conftest import torchtune_position_embeddings
from multi_axis_reference import qwen2vl_mrope, qwen3vl_mrope_interleaved
from posenc.functional import apply_rope, rope_frequencies

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_transformers5_dict_sets_base():
    q = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    want = apply_rope(q, base=500000.0, scaling=LLAMA3)
    assert torch.equal(apply_rope(q, scaling={**LLAMA3, "rope_theta": 500000.0}), want)
    assert torch.equal(apply_rope(q, base=500000.0, scaling={**LLAMA3, "rope_theta": 500000.0}), want)
    assert not torch.equal(apply_rope(q, scaling=LLAMA3), want)  # the default base is 10000
    with pytest.raises(ValueError, match=r"base=10000.0 disagrees with the scaling dict's rope_theta=500000.0"):
        apply_rope(q, base=10000.0, scaling={**LLAMA3, "rope_theta": 500000.0})
    rope = posenc.RotaryPositionalEncoding(16, scaling={"rope_type": "default", "rope_theta": 1e6})
    assert rope.base == 1e6 and torch.equal(rope(q), apply_rope(q, base=1e6))
    inv, _ = rope_frequencies(16, scaling={"rope_type": "default", "rope_theta": 1e6})
    torch.testing.assert_close(inv, 1e6 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    with pytest.raises(ValueError, match=r"unknown rope scaling key\(s\) \['theta'\]"):
        apply_rope(q, scaling={"rope_type": "default", "theta": 3.0})


@pytest.mark.parametrize("key", ["factor", "original_max_position_embeddings", "beta_fast"])
def test_a_scaling_key_beside_the_default_type(key):
    """"default" reads no scaling key. A dict that has one (a config's stray "factor": 1.0)
    gets transformers' treatment: the key is ignored, with a warning (transformers logs it
    as unrecognized), for the function, the module and the frequencies alike. The op itself
    refuses it: C++'s RopeScaling, whose rope_type defaults to "default", would otherwise
    hide a forgotten type (GoogleTest KeysBesideTheDefaultTypeAreRefused)."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    scaling = {"rope_type": "default", key: 8.0}
    warned = rf"rope_type 'default' reads no scaling key; {key} ignored, as transformers ignores them"
    with pytest.warns(UserWarning, match=warned):
        assert torch.equal(apply_rope(q, scaling=scaling), apply_rope(q))
    with pytest.warns(UserWarning, match=warned):
        assert torch.equal(posenc.RotaryPositionalEncoding(8, scaling=scaling)(q), apply_rope(q))
    with pytest.warns(UserWarning, match=warned):
        assert torch.equal(rope_frequencies(8, scaling=scaling)[0], rope_frequencies(8)[0])
    from posenc._rope import SCALING_KEYS

    values = [0.0] * len(SCALING_KEYS)
    values[SCALING_KEYS.index(key)] = 8.0
    with pytest.raises(ValueError, match=rf"rope scaling type 'default' reads no rope scaling key, got {key}"):
        torch.ops.posenc.rope(q, None, rope_type="default", scaling=[float(1 << SCALING_KEYS.index(key))] + values)


def test_partial_rotary_factor_sets_rotary_dim():
    q = torch.randn(2, 5, 3, 32, dtype=torch.float64)
    cfg = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert torch.equal(apply_rope(q, scaling=cfg), apply_rope(q, rotary_dim=8))
    assert torch.equal(apply_rope(q, scaling=cfg, rotary_dim=8), apply_rope(q, rotary_dim=8))
    # The dict's value as given, and the rotary_dim it sets (it said partial_rotary_factor=8).
    with pytest.raises(ValueError, match=r"rotary_dim=16 disagrees with the scaling dict's "
                                         r"partial_rotary_factor=0\.25 \(rotary_dim 8\); pass one of them"):
        apply_rope(q, scaling=cfg, rotary_dim=16)
    rope = posenc.RotaryPositionalEncoding(32, scaling=cfg)
    assert rope.rotary_dim == 8 and torch.equal(rope(q), apply_rope(q, rotary_dim=8))
    with pytest.raises(ValueError, match="partial_rotary_factor' in \\(0, 1\\]"):
        apply_rope(q, scaling={"rope_type": "default", "partial_rotary_factor": 1.5})
    # rope_frequencies applies the key to its width as to a head_dim, as rope_cos_sin and
    # transformers do (it was dropped: 16 frequencies where the rotation has 4).
    inv, _ = rope_frequencies(32, scaling=cfg)
    assert torch.equal(inv, rope_frequencies(8)[0]) and inv.shape == (4,)
    linear = {"rope_type": "linear", "factor": 4.0, "partial_rotary_factor": 0.5}
    assert torch.equal(rope_frequencies(16, scaling=linear)[0],
                       rope_frequencies(8, scaling={"rope_type": "linear", "factor": 4.0})[0])


def test_qwen_vl_dicts_set_sections():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 128, dtype=torch.float64), torch.randn(2, 2, 9, 128, dtype=torch.float64)
    pos = torch.randint(0, 500, (3, 2, 9))
    # transformers 4 Qwen2-VL: {"type": "mrope", "mrope_section": [...]} with rope_theta beside it.
    v4 = {"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1e6}
    oq, ok = apply_rope(q, k, positions=pos, scaling=v4, layout="bhsd")
    rq, rk = qwen2vl_mrope(q, k, pos, [16, 24, 24], 1e6)
    torch.testing.assert_close(oq, rq)
    torch.testing.assert_close(ok, rk)
    # transformers 5 Qwen3-VL rope_parameters.
    v5 = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True, "rope_theta": 5e6}
    oq, ok = apply_rope(q, k, positions=pos, scaling=v5, layout="bhsd")
    rq, rk = qwen3vl_mrope_interleaved(q, k, pos, [24, 20, 20], 5e6)
    torch.testing.assert_close(oq, rq)
    torch.testing.assert_close(ok, rk)
    rope = posenc.RotaryPositionalEncoding(128, max_len=1000, scaling=v5, layout="bhsd")
    assert list(rope.sections) == [24, 20, 20] and rope.sections_mode == "mrope_interleaved"
    assert all(torch.equal(a, b) for a, b in zip(rope(q, k, positions=pos), (oq, ok)))
    with pytest.raises(ValueError, match=r"sections=\[16, 24, 24\] disagrees with the scaling dict's mrope_section"):
        apply_rope(q, positions=pos, scaling=v5, sections=[16, 24, 24], layout="bhsd")


@pytest.mark.parametrize("section", [[8, 20, 20], [0, 8, 8], [24, 20, 20]])
def test_a_qwen3_vl_dict_whose_sections_sum_short_turns_the_whole_head(section):
    """transformers' interleaved M-RoPE turns the whole rotary part, T taking every pair its
    H and W sections do not (mrope_section[0] is never read): a dict whose sections sum to
    less than head_dim / 2 turned only 2 * sum(sections) features at other frequencies here
    (max diff 6.9; found by an audit). Explicit ``sections`` keep their documented rule (they
    set rotary_dim: test_rope_multi_axis.py)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 128, dtype=torch.float64), torch.randn(2, 2, 9, 128, dtype=torch.float64)
    pos = torch.randint(0, 500, (3, 2, 9))
    v5 = {"rope_type": "default", "mrope_section": section, "mrope_interleaved": True, "rope_theta": 5e6}
    oq, ok = apply_rope(q, k, positions=pos, scaling=v5, layout="bhsd")
    rq, rk = qwen3vl_mrope_interleaved(q, k, pos, section, 5e6)
    torch.testing.assert_close(oq, rq)
    torch.testing.assert_close(ok, rk)
    rope = posenc.RotaryPositionalEncoding(128, max_len=1000, scaling=v5, layout="bhsd")
    assert sum(rope.sections) == 64 and list(rope.sections)[1:] == section[1:]
    assert torch.equal(rope(q, k, positions=pos)[0], oq)


def test_an_explicit_sections_mode_and_the_dicts_mrope_keys():
    """The dict's mrope keys and an explicit sections_mode: agreeing ones combine, others are
    a ValueError naming both. The explicit mode used to be replaced silently: "mrope" for a
    dict with mrope_section (6.3 off Qwen3-VL, whose rotary is always interleaved and does not
    read mrope_interleaved), and mrope_interleaved=True without mrope_section was dropped
    (explicit sections then ran "axial")."""
    torch.manual_seed(1)
    q = torch.randn(1, 2, 8, 64, dtype=torch.float64)
    pos = torch.randint(0, 64, (3, 1, 8))
    want, _ = qwen3vl_mrope_interleaved(q, q, pos, [16, 8, 8], 5e6)
    no_flag = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [16, 8, 8]}
    got = apply_rope(q, positions=pos, scaling=no_flag, sections_mode="mrope_interleaved", layout="bhsd")
    torch.testing.assert_close(got, want)
    module = posenc.RotaryPositionalEncoding(64, max_len=64, scaling=no_flag, sections_mode="mrope_interleaved",
                                             layout="bhsd")
    assert module.sections_mode == "mrope_interleaved" and torch.equal(module(q, positions=pos), got)
    want2, _ = qwen2vl_mrope(q, q, pos, [16, 8, 8], 5e6)  # no flag, no mode: Qwen2-VL's M-RoPE
    torch.testing.assert_close(apply_rope(q, positions=pos, scaling=no_flag, layout="bhsd"), want2)
    flag_only = {"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True}
    got = apply_rope(q, positions=pos, scaling=flag_only, sections=[16, 8, 8], layout="bhsd")
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"sections_mode='axial' disagrees with the scaling dict's 'mrope_section'"):
        apply_rope(q, positions=pos, scaling=no_flag, sections_mode="axial", layout="bhsd")
    with pytest.raises(ValueError, match=r"sections_mode='mrope' disagrees .*'mrope_interleaved'"):
        apply_rope(q, positions=pos, scaling=flag_only, sections=[16, 8, 8], sections_mode="mrope", layout="bhsd")
    with pytest.raises(TypeError, match="mrope_interleaved' to be a bool"):
        apply_rope(q, positions=pos, scaling={**no_flag, "mrope_interleaved": "yes"}, layout="bhsd")


def test_hf_position_ids_of_one_sequence():
    """position_ids (1, seq) serve every batch row, as Hugging Face broadcasts them."""
    q = torch.randn(3, 6, 2, 8, dtype=torch.float64)
    pos = torch.tensor([[4, 9, 1, 0, 7, 7]])
    assert torch.equal(apply_rope(q, positions=pos), apply_rope(q, positions=pos[0]))
    rope = posenc.RotaryPositionalEncoding(8, max_len=10)
    assert torch.equal(rope(q, positions=pos), apply_rope(q, positions=pos[0]))


def test_torchtune_input_pos():
    """torchtune's attention calls pos_embeddings(q, input_pos=...)."""
    rope = posenc.RotaryPositionalEncoding(16, max_len=64, interleaved=True)
    q = torch.randn(2, 5, 3, 16)
    input_pos = torch.randint(0, 64, (2, 5))
    assert torch.equal(rope(q, input_pos=input_pos), rope(q, positions=input_pos))
    assert torch.equal(rope(q, input_pos=None), rope(q))
    with pytest.raises(ValueError, match="both positions and input_pos"):
        rope(q, positions=input_pos, input_pos=input_pos)
    with pytest.raises(IndexError, match="max_len=64"):
        rope(q, input_pos=input_pos + 64)


def test_real_torchtune_rotary_positional_embeddings():
    """torchtune's own RotaryPositionalEmbeddings and posenc's module, called as a torchtune
    attention calls its pos_embeddings (x, input_pos=...): the same rotation, to float32 rounding."""
    position_embeddings = torchtune_position_embeddings()
    theirs = position_embeddings.RotaryPositionalEmbeddings(64, max_seq_len=128)
    ours = posenc.RotaryPositionalEncoding(64, max_len=128, interleaved=True)
    x = torch.randn(2, 10, 4, 64)
    input_pos = torch.randint(0, 128, (2, 10))
    torch.testing.assert_close(ours(x, input_pos=input_pos), theirs(x, input_pos=input_pos), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ours(x), theirs(x), rtol=2e-5, atol=2e-5)


def torchtune_rotary_positional_embeddings(x, input_pos, dim, base=10000, max_seq_len=128):
    """torchtune's RotaryPositionalEmbeddings.forward (torchtune/modules/position_embeddings.py),
    written out: a float32 cache of (cos, sin) per position and pair, adjacent pairs."""
    theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    idx_theta = torch.einsum("i, j -> ij", torch.arange(max_seq_len, dtype=theta.dtype), theta).float()
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
    rope_cache = cache[: x.size(1)] if input_pos is None else cache[input_pos]
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack([
        xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
        xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
    ], -1)
    return x_out.flatten(3).type_as(x)


def test_torchtune_rotary_positional_embeddings_formula():
    """The call form a torchtune attention makes (pos_embeddings(x, input_pos=...)), against
    torchtune's forward written out, so it runs where torchtune is not installed (the test
    above then skips)."""
    ours = posenc.RotaryPositionalEncoding(64, max_len=128, interleaved=True)
    x = torch.randn(2, 10, 4, 64)
    input_pos = torch.randint(0, 128, (2, 10))
    want = torchtune_rotary_positional_embeddings(x, input_pos, 64)
    torch.testing.assert_close(ours(x, input_pos=input_pos), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ours(x), torchtune_rotary_positional_embeddings(x, None, 64), rtol=2e-5, atol=2e-5)
    assert not torch.allclose(ours(x, input_pos=input_pos), ours(x))  # the positions mattered
