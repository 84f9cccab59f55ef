"""RoPE's configuration facts, each stated once: the keyword list (Python's
_CONFIG_KEYWORDS, which every RoPE function and module shows through with_rope_settings)
and the rotary-width rule (the op rope_rotary_width, which both modules ask)."""

import inspect

import pytest
import torch
from torch.library import opcheck

import posenc
from posenc._rope import _CONFIG_KEYWORDS
from posenc.functional import apply_rope, qk_norm_rope, rope_append_kv

FRONT_ENDS = (apply_rope, qk_norm_rope, rope_append_kv, posenc.RotaryPositionalEncoding, posenc.QKNormRotary)


def test_every_front_end_lists_the_keywords_from_one_table():
    schema = [a.name for a in torch.ops.posenc.rope.default._schema.arguments]
    # The table is the schema's configuration tail (less the op's own rope_type, seq_len, inverse).
    tail = schema[schema.index("base"):]
    assert set(_CONFIG_KEYWORDS) == set(tail) - {"rope_type", "seq_len", "inverse"}
    for fn in FRONT_ENDS:
        params = inspect.signature(fn).parameters
        missing = [name for name in _CONFIG_KEYWORDS if name not in params]
        assert not missing, (fn, missing)
        assert all(params[name].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                   for name in _CONFIG_KEYWORDS)
        # Not restated: the function's own code takes them through **rope (the module's
        # positional base is the one keyword a front end names itself).
        code = (fn.__init__ if isinstance(fn, type) else fn).__code__
        named = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
        assert named & set(_CONFIG_KEYWORDS) <= {"base"}, (fn, named & set(_CONFIG_KEYWORDS))


@pytest.mark.parametrize("fn", [apply_rope, qk_norm_rope, rope_append_kv])
def test_unknown_keyword_is_a_type_error_naming_it(fn):
    q = torch.randn(1, 2, 1, 8)
    args = {apply_rope: (q,), qk_norm_rope: (q, q, torch.ones(8), torch.ones(8)),
            rope_append_kv: (q, q, q, torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))}[fn]
    with pytest.raises(TypeError, match=r"unknown RoPE setting\(s\) \['rotary_ofset'\]"):
        fn(*args, rotary_ofset=2)


def reference_width(head_dim, rotary_dim=-1, sections=(), rotary_offset=0):
    if rotary_dim >= 0:
        return rotary_dim
    if sections:
        return 2 * sum(sections)
    return head_dim - rotary_offset


@pytest.mark.parametrize("head_dim,kwargs", [
    (16, {}), (16, dict(rotary_dim=8)), (16, dict(rotary_offset=6)), (16, dict(rotary_offset=4, rotary_dim=6)),
    (24, dict(sections=[2, 3, 3])), (24, dict(sections=[2, 2], sections_mode="mrope")), (10, dict(layout="thd")),
    (12, dict(layout="bhsd", rotary_dim=4, interleaved=True)),
])
def test_rotary_width_is_the_ops_rule_in_both_modules(head_dim, kwargs):
    want = reference_width(head_dim, kwargs.get("rotary_dim", -1), kwargs.get("sections", ()),
                           kwargs.get("rotary_offset", 0))
    rope = posenc.RotaryPositionalEncoding(head_dim, max_len=32, **kwargs)
    assert rope.rotary_dim == want and rope.inv_freq.shape == (want // 2,)
    layout = kwargs.get("layout", "bshd")
    q = torch.empty(0, 1, head_dim) if layout == "thd" else torch.empty(0, 0, 1, head_dim)
    extra = dict(cu_seqlens=torch.zeros(1, dtype=torch.int64)) if layout == "thd" else {}
    assert torch.ops.posenc.rope_rotary_width(q, **kwargs, **extra) == want
    posenc.QKNormRotary(head_dim, **kwargs)  # checks the same values at construction


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rotary_dim=7), ValueError, "rotary_dim to be even"),
    (dict(rotary_dim=10), ValueError, "rotary_dim <= head_dim = 8"),
    (dict(rotary_offset=4, rotary_dim=6), ValueError, r"rotary features \[4, 10\)"),
    (dict(sections=[3, 3]), ValueError, "sections to hold at most head_dim / 2 = 4"),
    (dict(base=1.0), ValueError, "base > 1"),
])
def test_both_modules_refuse_at_construction_with_the_ops_message(kwargs, error, match):
    for module in (posenc.RotaryPositionalEncoding, posenc.QKNormRotary):
        with pytest.raises(error, match=match):
            module(8, **kwargs)


def test_opcheck_rope_rotary_width():
    q = torch.randn(2, 3, 2, 12)
    k = torch.randn(2, 3, 1, 12)
    opcheck(torch.ops.posenc.rope_rotary_width.default, (q, k), dict(rotary_offset=4),
            test_utils=("test_schema", "test_faketensor"))
    assert torch.ops.posenc.rope_rotary_width(q.to("meta"), rotary_dim=6) == 6


@pytest.mark.parametrize("kwargs,match", [
    (dict(eps=float("inf")), r"expected eps > 0 \(added to the mean square\), got inf"),
    (dict(eps=float("nan")), r"expected eps > 0 \(added to the mean square\), got nan"),
    (dict(weight_offset=float("inf")), "expected a finite weight_offset, got inf"),
])
def test_qk_norm_rotary_refuses_non_finite_norm_settings_at_construction(kwargs, match):
    # As the C++ module does (it raised only at the first forward in Python).
    with pytest.raises(ValueError, match="QKNormRotary: " + match):
        posenc.QKNormRotary(16, **kwargs)


def test_rotary_module_checks_k_and_a_0_dim_q_against_its_dim():
    # A ValueError naming the argument, as in C++ (the op's RuntimeError before).
    rope = posenc.RotaryPositionalEncoding(8, max_len=16)
    q = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError, match=r"expected k with head_dim 8 \(the module's dim\), got shape \(2, 3, 1, 6\)"):
        rope(q, torch.randn(2, 3, 1, 6))
    with pytest.raises(ValueError, match=r"expected q with head_dim 8 \(the module's dim\), got shape \(\)"):
        rope(torch.tensor(1.0))
