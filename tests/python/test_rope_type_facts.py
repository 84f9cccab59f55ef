"""The facts of each RoPE scaling type (POSENC_ROPE_TYPES in posenc/math/rope.h, exported by
``torch.ops.posenc.rope_scaling_spec``: scales by length, reads the list keys, takes
original_max_position_embeddings or factor from the model) against what every Python front
end does with that type: ``apply_rope``, ``RotaryPositionalEncoding``, ``rope_cos_sin`` and the
op itself. A new type gets these checks from the table; it only needs a sample below.
(The C++ API and module: tests/cpp/test_rope.cpp, RopeTypeFacts.)"""

import pytest
import torch

from posenc import RotaryPositionalEncoding
from posenc import _rope
from posenc.functional import apply_rope, apply_rope_cos_sin, rope_cos_sin
from rope_reference import scaling_samples

F64 = torch.float64
ROT = 8
MAX_LEN = 64

# A valid configuration of every type for rotary_dim 8.
SAMPLES = scaling_samples(ROT)  # a valid configuration of every type


def frequencies(scaling, seq_len=0):
    """(inv_freq, attention factor) from the op, the scaling dict flattened without model defaults."""
    rope_type, values = _rope.scaling_arguments(scaling)
    return torch.ops.posenc.rope_frequencies(ROT, 10000.0, rope_type, values, seq_len, [], "axial")


def outcome(fn):
    """What a call gives: its tensors, or its error's type and message."""
    try:
        result = fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return type(e), str(e)
    return tuple(t for t in (result if isinstance(result, tuple) else (result,)))


def same(a, b):
    if isinstance(a[0], type) or isinstance(b[0], type):
        return a == b
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


def test_spec_exports_the_facts_of_every_type():
    spec = torch.ops.posenc.rope_scaling_spec()
    assert len(spec) == 10
    assert spec[8] == 2**53 == _rope.MAX_POSITION  # the positions' range, [-2**53, 2**53]
    types, facts, per_type = spec[0], spec[5], spec[6]
    assert facts == ["scales_by_length", "list_keys", "original_from_model", "factor_from_model"]
    assert len(per_type) == len(types) and all(0 <= f < 1 << len(facts) for f in per_type)
    assert set(SAMPLES) == set(types), "a new rope type needs a sample configuration in SAMPLES"
    # The sets as they stand, so that a change to the table is a visible change here.
    assert _rope.LENGTH_SCALED_TYPES == ("dynamic", "longrope")
    assert _rope.LIST_KEY_TYPES == ("longrope",)
    assert _rope.ORIGINAL_FROM_MODEL_TYPES == ("dynamic", "yarn")
    assert _rope.FACTOR_FROM_MODEL_TYPES == ("longrope",)
    assert _rope.PARTIAL_ROTARY_KEY_TYPES == ("proportional",)
    # The keys each type's formulas read (the keys column of POSENC_ROPE_TYPES).
    assert _rope.TYPE_KEYS == {
        "default": (),
        "linear": ("factor",),
        "dynamic": ("factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
                 "mscale_all_dim", "truncate"),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "longrope": ("factor", "original_max_position_embeddings", "attention_factor"),
        "proportional": ("factor", "partial_rotary_factor"),
    }


# A value each key may take in any type's sample (valid where the type reads it).
FOREIGN_VALUES = {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
                  "attention_factor": 1.5, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}


@pytest.mark.parametrize("rope_type", sorted(SAMPLES))
def test_a_key_the_type_does_not_read_is_dropped_with_a_warning_and_refused_by_the_op(rope_type):
    """transformers ignores a key its type does not read (it logs it as unrecognized): the
    dict reader drops it with a warning, so the frequencies are the dict's without it, and
    the op, which would ignore it silently (a C++ RopeScaling with a field its type never
    reads), refuses it. Until the keys column existed, only "default" warned; the other
    types passed such keys to the op, which ignored them without a word (an audit)."""
    sample = SAMPLES[rope_type]
    want = frequencies(sample, seq_len=64)
    unread = [k for k in FOREIGN_VALUES if k not in _rope.TYPE_KEYS[rope_type]]
    assert unread or rope_type == "yarn"
    for key in unread:
        with pytest.warns(UserWarning, match=rf"rope: rope_type '{rope_type}' reads .*; {key} ignored, as "
                                              r"transformers ignores them"):
            got = frequencies({**sample, key: FOREIGN_VALUES[key]}, seq_len=64)
        assert torch.equal(got[0], want[0]) and got[1] == want[1], key
        # The op itself: the same values with the key's bit and value set.
        kind, values = _rope.scaling_arguments(sample)
        values = list(values) if values else [0.0] * (1 + len(_rope.SCALING_KEYS))
        i = _rope.SCALING_KEYS.index(key)
        values[0] += float(1 << i)
        values[1 + i] = float(FOREIGN_VALUES[key])
        with pytest.raises(ValueError, match=rf"rope scaling type '{rope_type}' (does not read the rope scaling "
                                             rf"key\(s\) {key} \(it reads|reads no rope scaling key, got {key})"):
            torch.ops.posenc.rope_frequencies(ROT, 10000.0, kind, values, 64, [], "axial")


def test_the_layouts_geometry_is_the_ops():
    """The layouts' (batch, seq, heads) dims come from the library (one table,
    ops::rope_layout_axes) and say what the op does: a q built in each layout from one
    (batch, seq, heads, head_dim) tensor rotates to that tensor's rotation, placed back by
    the same axes."""
    assert _rope.LAYOUT_AXES == {"bshd": (0, 1, 2), "bhsd": (0, 2, 1), "sbhd": (1, 0, 2), "thd": (None, 0, 1)}
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=F64)  # (batch, seq, heads, head_dim)
    positions = torch.randint(0, 50, (2, 5), generator=g)
    want = apply_rope(x, positions=positions)
    for layout, (b, s, h) in _rope.LAYOUT_AXES.items():
        if b is None:
            continue
        order = [0, 0, 0, 3]
        order[b], order[s], order[h] = 0, 1, 2
        q = x.permute(order)  # x in the layout
        got = apply_rope(q, positions=positions, layout=layout)
        assert torch.equal(_rope._canonical(got, layout), want), layout


@pytest.mark.parametrize("rope_type", _rope.ROPE_TYPES)
def test_length_scaled_set_is_what_the_frequencies_do(rope_type):
    """A type is in LENGTH_SCALED_TYPES exactly when the op's frequencies change with seq_len
    (the formula in rope_inv_freq against the table's flag)."""
    unscaled = frequencies(SAMPLES[rope_type], 0)
    scaled = frequencies(SAMPLES[rope_type], 1000)
    changes = not (torch.equal(unscaled[0], scaled[0]) and unscaled[1] == scaled[1])
    assert changes == (rope_type in _rope.LENGTH_SCALED_TYPES)


@pytest.mark.parametrize("rope_type", _rope.ROPE_TYPES)
def test_every_front_end_passes_the_longest_position(rope_type):
    """apply_rope, the module and rope_cos_sin + apply_rope_cos_sin all give the op's result
    for seq_len = longest position + 1 (a length-scaled type given 0 would differ)."""
    scaling = SAMPLES[rope_type]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 2, ROT, generator=g, dtype=F64)
    positions = torch.tensor([[0, 3, 9, 2, 40], [1, 1, 7, 33, 6]])
    name, values = _rope.scaling_arguments(scaling)
    want = torch.ops.posenc.rope(q, None, positions=positions, rope_type=name, scaling=values, seq_len=41)[0]
    unscaled = torch.ops.posenc.rope(q, None, positions=positions, rope_type=name, scaling=values, seq_len=0)[0]
    assert torch.equal(unscaled, want) == (rope_type not in _rope.LENGTH_SCALED_TYPES)
    torch.testing.assert_close(apply_rope(q, positions=positions, scaling=scaling), want, rtol=0, atol=0)
    module = RotaryPositionalEncoding(ROT, max_len=MAX_LEN, scaling=scaling)
    torch.testing.assert_close(module(q, positions=positions), want, rtol=0, atol=0)
    cos, sin = rope_cos_sin(positions, ROT, scaling=scaling, dtype=F64)
    torch.testing.assert_close(apply_rope_cos_sin(q, None, cos, sin, layout="bshd"), want, rtol=1e-12, atol=1e-12)


def without(scaling, *keys):
    return {key: value for key, value in scaling.items() if key not in keys}


@pytest.mark.parametrize("rope_type", [t for t in _rope.ROPE_TYPES if t != "default"])
def test_model_defaults_follow_the_facts(rope_type):
    """original_max_position_embeddings and factor missing from the dict: the module (max_len)
    and rope_cos_sin (max_position_embeddings) fill them for the types the table names, and
    for no other (those get what the dict alone gives: the same numbers, or the same error)."""
    positions = torch.tensor([0, 5, 17, 30, 2, 63])
    sample = SAMPLES[rope_type]

    def tables(scaling, model=None):
        return outcome(lambda: rope_cos_sin(positions, ROT, scaling=scaling, dtype=F64,
                                            max_position_embeddings=model))

    def module(scaling):
        return outcome(lambda: (lambda m: (m.inv_freq, torch.tensor(m.attention_scaling)))(
            RotaryPositionalEncoding(ROT, max_len=MAX_LEN, scaling=scaling)))

    def plain(scaling):
        return outcome(lambda: (lambda f: (f[0].float(), torch.tensor(f[1])))(frequencies(scaling)))

    no_orig = without(sample, "original_max_position_embeddings")
    if rope_type in _rope.ORIGINAL_FROM_MODEL_TYPES:
        filled = dict(no_orig, original_max_position_embeddings=MAX_LEN)
        assert same(tables(no_orig, MAX_LEN), tables(filled))
        if rope_type in _rope.LENGTH_SCALED_TYPES:  # the default would never rescale below max_len
            with pytest.raises(ValueError, match="original_max_position_embeddings"):
                RotaryPositionalEncoding(ROT, max_len=MAX_LEN, scaling=no_orig)
        else:
            assert same(module(no_orig), plain(filled))
    else:
        assert same(tables(no_orig, MAX_LEN), tables(no_orig))
        assert same(module(no_orig), plain(no_orig))
    no_factor = without(sample, "factor", "attention_factor")
    if rope_type in _rope.FACTOR_FROM_MODEL_TYPES:
        filled = dict(no_factor, factor=MAX_LEN / sample["original_max_position_embeddings"])
        assert same(tables(no_factor, MAX_LEN), tables(filled))
        assert same(module(no_factor), plain(filled))
    else:
        if rope_type in _rope.LENGTH_BASELINE_TYPES:
            # "dynamic": transformers scales by the model's length and ignores the dict's key,
            # so a dict stating another length beside the model's is refused first.
            got = tables(no_factor, MAX_LEN)
            assert got[0] is ValueError and "ignores the dict's original_max_position_embeddings" in got[1], got
        else:
            assert same(tables(no_factor, MAX_LEN), tables(no_factor))
        assert same(module(no_factor), plain(no_factor))


@pytest.mark.parametrize("rope_type", _rope.ROPE_TYPES)
def test_list_keys_follow_the_facts(rope_type):
    """Only the types of LIST_KEY_TYPES take short_factor / long_factor: Python refuses them
    for the others, and so does the op's parser (extra values)."""
    lists = {key: [1.0] * (ROT // 2) for key in _rope.SCALING_LIST_KEYS}
    scaling = {**SAMPLES[rope_type], **lists}
    if rope_type in _rope.LIST_KEY_TYPES:
        frequencies(scaling)
        with pytest.raises(ValueError, match="needs the scaling key"):
            frequencies(without(scaling, _rope.SCALING_LIST_KEYS[0]))
        return
    with pytest.raises(ValueError, match="belong to rope_type"):
        frequencies(scaling)
    _, values = _rope.scaling_arguments(SAMPLES[rope_type])
    values = values or [0.0] * (1 + len(_rope.SCALING_KEYS))  # the mask: no key given
    with pytest.raises(ValueError, match="rope scaling values"):
        torch.ops.posenc.rope_frequencies(ROT, 10000.0, rope_type, values + [1.0] * ROT, 0, [], "axial")


@pytest.mark.parametrize("rope_type", _rope.ROPE_TYPES)
def test_partial_rotary_factor_follows_the_facts(rope_type):
    """A config's partial_rotary_factor sets rotary_dim (int(head_dim * factor), the other
    features pass through), except for the types of PARTIAL_ROTARY_KEY_TYPES, which read it as
    their own key over the whole head_dim. Checked by the result: with rotary_dim set, the
    last head_dim - rotary_dim features are q's own."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 1, 16, generator=g, dtype=F64)
    positions = torch.arange(3, 9)
    scaling = {**SAMPLES[rope_type], "partial_rotary_factor": 0.5}
    out = apply_rope(q, positions=positions, scaling=scaling)
    if rope_type in _rope.PARTIAL_ROTARY_KEY_TYPES:
        want = apply_rope(q, positions=positions, scaling=scaling, rotary_dim=16)
    else:
        want = apply_rope(q, positions=positions, scaling=without(scaling, "partial_rotary_factor"), rotary_dim=8)
        assert torch.equal(out[..., 8:], q[..., 8:])
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("rope_type", sorted(t for t in SAMPLES if t not in _rope.PARTIAL_ROTARY_KEY_TYPES))
def test_partial_rotary_factor_reaching_the_op_for_another_type_is_refused_with_advice(rope_type):
    """For the types that do not read it as a scaling key, a config's partial_rotary_factor is
    rotary_dim (the front ends resolve it): given to the op it is refused, saying so."""
    kind, values = _rope.scaling_arguments(SAMPLES[rope_type])
    values = list(values) if values else [0.0] * (1 + len(_rope.SCALING_KEYS))
    i = _rope.SCALING_KEYS.index("partial_rotary_factor")
    values[0] += float(1 << i)
    values[1 + i] = 0.5
    with pytest.raises(ValueError, match=rf"rope scaling type '{rope_type}' does not read the key "
                                         r"'partial_rotary_factor' \(it sets rotary_dim there.*rotary_dim = "
                                         r"int\(head_dim \* 0.5\) instead"):
        torch.ops.posenc.rope_frequencies(ROT, 10000.0, kind, values, 64, [], "axial")
