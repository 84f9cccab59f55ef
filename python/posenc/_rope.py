"""Rotary position embedding (RoPE): the Python front end of ``torch.ops.posenc.rope``.

The scaling dict follows Hugging Face's ``rope_scaling``; it is flattened here into the op's
``(rope_type, scaling)`` arguments, and the frequencies themselves are computed by the
library (``posenc/math/rope.h``), the same code the kernels run.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import types
import warnings

from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from posenc._common import (_bool_arg, _check_positive_int, _float_arg, _in_int64, _int_arg, _integer,
                            _optional_tensor_args, _real, _refuse_captured_writes, _specialised, _specialised_int,
                            _static_shape, _tensor_arg, _untraced)
from posenc._dtensor import is_dtensor, is_sharded, place_beside, placed_as

# The names the ops accept, from the library's own tables (posenc/math/rope.h): the rope
# types, the scaling keys in the order of the op's ``scaling`` list, the layouts, the
# multi-axis sections modes and the list-valued keys; then the facts of the types
# (POSENC_ROPE_TYPE_FACTS: their names, and per type an int whose bit i is fact i), the
# layouts' geometry (ops::rope_layout_axes: 3 dims per layout), the largest position
# magnitude the ops take (kRopeMaxPosition: 2**53, integers exact in the float64 angle) and
# the keys each type reads (POSENC_ROPE_TYPES' keys column: bit i is SCALING_KEYS[i]).
*_SPEC_LISTS, MAX_POSITION, _TYPE_KEY_MASKS = torch.ops.posenc.rope_scaling_spec()
ROPE_TYPES, SCALING_KEYS, LAYOUTS, SECTIONS_MODES, SCALING_LIST_KEYS, _FACTS, _TYPE_FACTS, _AXES = map(
    tuple, _SPEC_LISTS)
# rope type -> the scaling keys its formulas read.
TYPE_KEYS = {t: tuple(k for i, k in enumerate(SCALING_KEYS) if mask >> i & 1)
             for t, mask in zip(ROPE_TYPES, _TYPE_KEY_MASKS)}
# layout -> (batch, seq, heads) dims of q and k (head_dim is last); batch None: none ("thd"
# packs its sequences into one token dim).
LAYOUT_AXES = {
    name: (None if _AXES[3 * i] < 0 else _AXES[3 * i], _AXES[3 * i + 1], _AXES[3 * i + 2])
    for i, name in enumerate(LAYOUTS)
}


def _types_with(fact: str) -> Tuple[str, ...]:
    bit = 1 << _FACTS.index(fact)
    return tuple(t for t, facts in zip(ROPE_TYPES, _TYPE_FACTS) if facts & bit)


# The types whose frequencies depend on the call's longest position (seq_len).
LENGTH_SCALED_TYPES = _types_with("scales_by_length")
# The types that read the list keys (SCALING_LIST_KEYS, one value per rotary pair).
LIST_KEY_TYPES = _types_with("list_keys")
# The types whose original_max_position_embeddings defaults to the model's
# max_position_embeddings, and those whose factor defaults to max_position_embeddings /
# original_max_position_embeddings when not given.
ORIGINAL_FROM_MODEL_TYPES = _types_with("original_from_model")
FACTOR_FROM_MODEL_TYPES = _types_with("factor_from_model")
# "dynamic": scaled by the call's length beyond original_max_position_embeddings, whose
# default is the model's length (transformers reads only the model's; the module refuses a
# default at max_len, rope_cos_sin a dict disagreeing with the model's).
LENGTH_BASELINE_TYPES = tuple(t for t in LENGTH_SCALED_TYPES if t in ORIGINAL_FROM_MODEL_TYPES)
# The types that read partial_rotary_factor as their own scaling key ("proportional"); for
# the others a config's partial_rotary_factor sets rotary_dim.
PARTIAL_ROTARY_KEY_TYPES = tuple(t for t, keys in TYPE_KEYS.items() if "partial_rotary_factor" in keys)


# The op's ``scaling`` list: [] for "default" with no key, else ``[given, *keys, *lists]``:
# ``given`` is the bitmask of the keys the dict gave (bit i: SCALING_KEYS[i]; exact as a
# float), then one value per key (0.0 where not given), then the list keys' values. Presence
# travels in the mask, so no float value means "not given" (posenc/math/rope.h, RopeScalingParams).

# Keys of a transformers 5 ``rope_parameters`` / ``rope_scaling`` dict (and of Qwen-VL
# configs) that are not scaling keys but set other arguments: resolved by resolve_config_keys.
CONFIG_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _missing_rope_type(scaling: Mapping) -> ValueError:
    return ValueError(f"rope: the scaling dict needs 'rope_type', one of {', '.join(ROPE_TYPES)}; got {dict(scaling)}")


def resolve_config_keys(
    scaling: Optional[Mapping[str, Any]],
    *,
    base: Optional[float],
    rotary_dim: Optional[int],
    head_dim: int,
    sections: Optional[Sequence[int]],
    sections_mode: Optional[str],
    fn: str = "apply_rope",
) -> Tuple[Optional[Mapping[str, Any]], Optional[float], Optional[int], Optional[Sequence[int]], str]:
    """Reads the non-scaling keys of a transformers 4 or 5 dict into the arguments they set:
    ``rope_theta`` -> base, ``partial_rotary_factor`` -> rotary_dim (``int(head_dim *
    factor)``, as transformers; a key of rope_type "proportional" itself), ``mrope_section``
    -> sections (mode "mrope", or "mrope_interleaved" with ``mrope_interleaved=True``;
    rope_type "mrope" is "default"; ``mrope_interleaved=True`` alone sets the mode of the
    sections given). ``sections_mode`` None: not given ("axial" unless the dict sets it).
    An explicit argument that disagrees is a ValueError naming both (a dict with
    ``mrope_section`` and no ``mrope_interleaved`` states M-RoPE, not which of its two pair
    orders: an explicit "mrope" or "mrope_interleaved" then decides). Returns (scaling
    without those keys, base, rotary_dim, sections, sections_mode); base None means 10000."""
    if isinstance(scaling, Mapping) and any(key in scaling for key in CONFIG_KEYS + ("type",)):
        if scaling.get("rope_type", scaling.get("type")) is None:  # the dict as given in the message
            raise _missing_rope_type(scaling)
        scaling = dict(scaling)

        def take(key: str, current: Any, given: Any, name: str, explicit: bool, value: Any = None) -> Any:
            """given (the dict's key's value, or what it sets: then value is the key's own)."""
            if given is None:
                return current
            if explicit and current != given:
                shown = f"{key}={given!r}" if value is None else f"{key}={value!r} ({name} {given!r})"
                raise ValueError(f"{fn}: {name}={current!r} disagrees with the scaling dict's {shown}; "
                                 f"pass one of them")
            return given

        theta = scaling.pop("rope_theta", None)
        if theta is not None:
            if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
                raise TypeError(f"{fn}: expected scaling key 'rope_theta' to be a number, got {theta!r}")
            base = take("rope_theta", None if base is None else float(base), float(theta), "base", base is not None)
        # A type of PARTIAL_ROTARY_KEY_TYPES ("proportional", Gemma 4) reads
        # partial_rotary_factor itself: the share of pairs that turn, over the whole head_dim;
        # it is a scaling key there, not rotary_dim.
        own_key = scaling.get("rope_type", scaling.get("type")) in PARTIAL_ROTARY_KEY_TYPES
        factor = None if own_key else scaling.pop("partial_rotary_factor", None)
        if factor is not None:
            if not 0 < _real(fn, "scaling key 'partial_rotary_factor'", factor, "a number in (0, 1]") <= 1:
                raise ValueError(f"{fn}: expected scaling key 'partial_rotary_factor' in (0, 1], got {factor!r}")
            width = int(head_dim * factor)
            if head_dim > 0 and (width <= 0 or width % 2):  # named by the key that gave it, not as rotary_dim
                raise ValueError(f"{fn}: the scaling dict's partial_rotary_factor {factor!r} gives rotary_dim "
                                 f"int({head_dim} * {factor!r}) = {width}; expected a positive even number")
            rotary_dim = take("partial_rotary_factor", rotary_dim, int(head_dim * factor), "rotary_dim",
                              rotary_dim is not None, factor)
        section = scaling.pop("mrope_section", None)
        interleaved = scaling.pop("mrope_interleaved", None)
        if interleaved is not None and not isinstance(interleaved, bool):
            raise TypeError(f"{fn}: expected scaling key 'mrope_interleaved' to be a bool, got {interleaved!r}")
        if section is not None:
            sections = take("mrope_section", None if sections is None else list(sections), list(section),
                            "sections", sections is not None)
        # The modes the dict allows (the first its default): mrope_interleaved=True states the
        # interleaved order; with mrope_section, False states "mrope" and no key either order.
        if interleaved:
            allowed: Tuple[str, ...] = ("mrope_interleaved",)
        elif section is None:
            allowed = ()
        elif interleaved is None:
            allowed = ("mrope", "mrope_interleaved")
        else:
            allowed = ("mrope",)
        if allowed:
            if sections_mode is not None and sections_mode not in allowed:
                stated = (("mrope_section", section), ("mrope_interleaved", interleaved))
                keys = " and ".join(f"'{k}'" for k, v in stated if v is not None)
                raise ValueError(f"{fn}: sections_mode={sections_mode!r} disagrees with the scaling dict's {keys} "
                                 f"(sections_mode {' or '.join(map(repr, allowed))}); pass one of them")
            sections_mode = allowed[0] if sections_mode is None else sections_mode
        width = head_dim if rotary_dim is None else rotary_dim
        if (section is not None and sections_mode == "mrope_interleaved" and len(sections) == 3
                and all(isinstance(n, numbers.Integral) and n >= 0 for n in sections)
                and 2 * sum(sections) < width):
            # transformers' interleaved M-RoPE (Qwen3-VL) turns the whole rotary part: the
            # pairs its H and W sections do not take are T's, whatever mrope_section[0] says
            # (a dict whose sections sum to less turned only 2 * sum(sections) features here).
            sections = [width // 2 - sections[1] - sections[2], sections[1], sections[2]]
        if scaling.get("rope_type", scaling.get("type")) == "mrope":  # transformers 4's Qwen2-VL name
            scaling.pop("type", None)
            scaling["rope_type"] = "default"
    return (scaling, base, rotary_dim, sections,
            _SCHEMA_DEFAULTS["sections_mode"] if sections_mode is None else sections_mode)


def _scaling_mapping(fn: str, scaling: Any) -> Optional[Mapping]:
    """``scaling`` if it is None or a mapping (a dict, a transformers config's rope_scaling);
    TypeError naming it otherwise."""
    if scaling is not None and not isinstance(scaling, Mapping):
        raise TypeError(f"{fn}: expected scaling to be None or a dict, got {type(scaling).__name__}")
    return scaling


def unread_scaling_key(rope_type: str, key: str) -> bool:
    """Whether ``key`` is a scaling key that ``rope_type`` does not read (transformers ignores
    it). partial_rotary_factor is read by every type, as rotary_dim where it is not a scaling
    key (resolve_config_keys takes it there; reaching the op, the op refuses it with advice)."""
    return key in SCALING_KEYS and key not in TYPE_KEYS[rope_type] and key != "partial_rotary_factor"


def scaling_arguments(
    scaling: Optional[Mapping], max_position_embeddings: Optional[int] = None
) -> Tuple[str, list]:
    """``(rope_type, values)`` for the op from a Hugging Face ``rope_scaling`` dict.

    ``max_position_embeddings`` is the model's (the module's ``max_position_embeddings=``,
    default its max_len): as transformers fills them from the config, it is
    ``original_max_position_embeddings`` when the dict has none
    for the types of ORIGINAL_FROM_MODEL_TYPES ("yarn", "dynamic"), and sets ``factor`` to
    max_position_embeddings / original_max_position_embeddings when it is not given for
    those of FACTOR_FROM_MODEL_TYPES ("longrope"). The list
    keys (LIST_KEY_TYPES: "longrope"'s ``short_factor``, ``long_factor``) follow the keys in
    ``values``.
    """
    if _scaling_mapping("rope", scaling) is None:
        return "default", []
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise _missing_rope_type(scaling)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope: unknown rope scaling type {rope_type!r}; expected one of {', '.join(ROPE_TYPES)}")
    unknown = sorted(set(scaling) - set(SCALING_KEYS) - set(SCALING_LIST_KEYS) - set(CONFIG_KEYS)
                     - {"rope_type", "type"})
    if unknown:
        raise ValueError(
            f"rope: unknown rope scaling key(s) {unknown}; accepted keys are rope_type, "
            f"{', '.join(dict.fromkeys(SCALING_KEYS + SCALING_LIST_KEYS + CONFIG_KEYS))}"
        )
    values = [0.0] * len(SCALING_KEYS)
    given = set()
    for i, key in enumerate(SCALING_KEYS):
        value = scaling.get(key)
        if value is None:
            continue
        if key == "truncate":
            if not isinstance(value, bool):
                raise TypeError(f"rope: expected scaling key 'truncate' to be a bool, got {value!r}")
            value = 1.0 if value else 0.0
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"rope: expected scaling key {key!r} to be a number, got {value!r}")
        # The op checks the value (finite, in range); an int past float's range reaches it as
        # its sign's infinity (a bare OverflowError before).
        values[i] = _float_arg("rope", f"scaling key {key!r}", value)
        given.add(i)
    unread = sorted(i for i in given if unread_scaling_key(rope_type, SCALING_KEYS[i]))
    if unread:
        # transformers logs a key its type does not read as unrecognized and ignores it (a
        # config's stray "factor": 1.0 beside "default" builds an unscaled RoPE): the same
        # here, with a warning. (The op refuses them: C++'s RopeScaling, whose rope_type
        # defaults to "default", would hide a forgotten type.)
        reads = ", ".join(TYPE_KEYS[rope_type]) or "no scaling key"
        warnings.warn(f"rope: rope_type {rope_type!r} reads {reads}; "
                      f"{', '.join(SCALING_KEYS[i] for i in unread)} ignored, as transformers ignores them",
                      stacklevel=3)
        for i in unread:
            values[i] = 0.0
            given.discard(i)
    orig = SCALING_KEYS.index("original_max_position_embeddings")
    if max_position_embeddings is not None and rope_type in ORIGINAL_FROM_MODEL_TYPES and orig not in given:
        values[orig] = float(max_position_embeddings)
        given.add(orig)
    factor = SCALING_KEYS.index("factor")
    if (max_position_embeddings is not None and rope_type in FACTOR_FROM_MODEL_TYPES
            and factor not in given and orig in given and values[orig] > 0):
        values[factor] = max_position_embeddings / values[orig]
        given.add(factor)
    values.insert(0, float(sum(1 << i for i in given)))
    lists = [scaling.get(key) for key in SCALING_LIST_KEYS]
    if rope_type not in LIST_KEY_TYPES:
        given = [key for key, value in zip(SCALING_LIST_KEYS, lists) if value is not None]
        if given:
            raise ValueError(f"rope: scaling key(s) {given} belong to rope_type "
                             f"{' or '.join(map(repr, LIST_KEY_TYPES))}, got {rope_type!r}")
        return rope_type, values
    for key, value in zip(SCALING_LIST_KEYS, lists):
        if value is None:
            raise ValueError(f"rope: rope_type {rope_type!r} needs the scaling key {key!r} (one factor per rotary "
                             f"pair), got none")
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value
        ):
            raise TypeError(f"rope: expected scaling key {key!r} to be a list of numbers, got {value!r}")
    if len({len(v) for v in lists}) != 1:
        raise ValueError(f"rope: expected scaling keys {' and '.join(map(repr, SCALING_LIST_KEYS))} of equal "
                         f"lengths, got {', '.join(str(len(v)) for v in lists)}")
    for value in lists:
        values.extend(float(v) for v in value)
    return rope_type, values


def _host_frequencies(rotary_dim: int, base: float, rope_type: str, values: Tuple[float, ...],
                      seq_len: int, sections: Tuple[int, ...] = (),
                      sections_mode: str = "axial") -> Tuple[List[float], float]:
    """(inverse frequencies, attention factor) of op ``rope_frequencies``, as Python numbers.

    Every argument is a Python constant, so the result is one too: under torch.compile and
    torch.export it is evaluated while tracing (tracing modes set aside) and enters the graph
    as a constant. The op itself cannot be in a graph: it has no tensor input to take a
    device from, and Inductor cannot run an op that returns a float.
    """
    def call() -> Tuple[List[float], float]:
        inv_freq, factor = torch.ops.posenc.rope_frequencies(rotary_dim, base, rope_type, list(values), seq_len,
                                                             list(sections), sections_mode)
        return inv_freq.tolist(), float(factor)

    if not torch.jit.is_tracing() and not torch._C._len_torch_dispatch_stack():
        return call()  # eager: nothing to set aside (that costs tens of microseconds a call)
    with _untraced(), _disable_current_modes():  # torch.jit.trace would record the op (float output)
        return call()


# torch.compiler.assume_constant_result(_host_frequencies) sets this one attribute; it is
# set by hand because that call imports torch._dynamo, and `import posenc` stays light
# (tests/python/test_distributed.py). test_deploy.py's compile and export tests cover it.
_host_frequencies._dynamo_marked_constant = True


def rope_frequencies(
    rotary_dim: int,
    *,
    base: Optional[float] = None,
    scaling: Optional[Mapping] = None,
    seq_len: int = 0,
    sections: Optional[Sequence[int]] = None,
    sections_mode: Optional[str] = None,
) -> Tuple[Tensor, float]:
    """``(inv_freq, attention_factor)`` of a RoPE configuration: float64 inverse
    frequencies of the ``rotary_dim // 2`` pairs (Hugging Face's ``inv_freq``, unrounded) and
    the factor cos and sin are multiplied by (yarn's or longrope's attention factor, else 1).
    ``seq_len`` (longest position + 1) matters for "dynamic" and "longrope" only. With ``sections`` (see
    :func:`apply_rope`), each pair's frequency as multi-axis RoPE computes it. A scaling
    dict's ``partial_rotary_factor`` applies to ``rotary_dim`` as to a head_dim (as
    :func:`rope_cos_sin` and transformers' rotary classes apply it): ``rotary_dim *
    factor`` features rotate."""
    fn = "rope_frequencies"
    rotary_dim = _int_arg(fn, "rotary_dim", rotary_dim)
    scaling, base, partial, sections, sections_mode = resolve_config_keys(
        scaling, base=base, rotary_dim=None, head_dim=rotary_dim, sections=sections, sections_mode=sections_mode,
        fn=fn)
    rope_type, values = scaling_arguments(scaling)
    seq_len = _int_arg(fn, "seq_len", seq_len)  # (a traced size refused: it would be a constant of the graph)
    rotary_dim = rotary_dim if partial is None else partial
    base = _SCHEMA_DEFAULTS["base"] if base is None else _float_arg(fn, "base", base)
    if torch.compiler.is_compiling():
        # Numbers torch.compile made symbols (a size, or an argument that changed between calls,
        # or dynamic=True) are specialised to their values, as rope_cos_sin's are: the host
        # call takes constants (a graph per value). seq_len only for the types that read it
        # ("dynamic", "longrope"); 0 for the others (one graph for every length).
        rotary_dim, base = _specialised_int(rotary_dim), _specialised(base)
        values = [_specialised(v) for v in values]
        if rope_type in LENGTH_SCALED_TYPES or seq_len < 0:  # a negative one: the op's ValueError
            seq_len = _specialised_int(seq_len)
        else:
            seq_len = 0
    # The op's answer as constants (_host_frequencies), eager and under torch.compile alike:
    # the op cannot be in a graph (no tensor input to take a device from).
    inv_freq, factor = _host_frequencies(rotary_dim, base, rope_type, tuple(values), seq_len,
                                         tuple(_sections(sections)), sections_mode)
    return torch.tensor(inv_freq, dtype=torch.float64, device="cpu"), factor


def _sections(sections: Optional[Sequence[int]]) -> List[int]:
    """sections as a list of ints (the op checks their values)."""
    if sections is None:
        return []
    if isinstance(sections, (str, bytes)) or not isinstance(sections, Sequence) or not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in sections
    ):
        raise TypeError(f"apply_rope: expected sections to be a list of ints (rotary pairs per axis), got {sections!r}")
    return [_in_int64("apply_rope", "each of sections", int(s)) for s in sections]


def grid_positions(
    *grid: int, num_prefix_tokens: int = 0, device: Optional[Union[str, torch.device]] = None
) -> Tensor:
    """Multi-axis RoPE positions of a grid of patches: int64 ``(len(grid),
    num_prefix_tokens + prod(grid))``, e.g. ``grid_positions(h, w)`` for an image of h x w
    patches (axis 0 the row, axis 1 the column; patches in row-major order), ``(t, h, w)`` for
    a video. ``num_prefix_tokens`` prefix (class, register) tokens come first, at position 0
    on every axis, which leaves them unrotated."""
    if len(grid) == 1 and isinstance(grid[0], (tuple, list)):
        grid = tuple(grid[0])
    fn = "grid_positions"
    return torch.ops.posenc.rope_grid_positions([_int_arg(fn, "grid", n) for n in grid],
                                                _int_arg(fn, "num_prefix_tokens", num_prefix_tokens), device)


def _canonical(x: Tensor, layout: str) -> Tensor:
    """x as (batch, seq, heads, head_dim) (LAYOUT_AXES)."""
    batch, seq, heads = LAYOUT_AXES[layout]
    return x.unsqueeze(0) if batch is None else x.permute(batch, seq, heads, 3)


def check_cu_seqlens(cu_seqlens: Tensor, tokens: int) -> None:
    """Values of CUDA cu_seqlens on the host, for a ValueError naming them (CPU ones are
    checked in the op; the CUDA kernel asserts on the device): one device sync."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() == 0:
        return  # the op raises with the shape
    ok = int(cu[0]) == 0 and int(cu[-1]) == tokens and bool((cu[1:] >= cu[:-1]).all())
    if not ok:
        raise ValueError(
            f"posenc: expected cu_seqlens to start at 0, never decrease and end at the number of "
            f"tokens {tokens}, got {cu.tolist()[:16]}"
        )


# The defaults of rope's schema (kRopeSchemaArguments, shared by every RoPE op), read from
# the schema itself: arguments equal to them need not be passed.
_SCHEMA_DEFAULTS = {a.name: a.default_value for a in torch.ops.posenc.rope.default._schema.arguments
                    if a.default_value is not None or a.name in ("positions", "offsets", "cu_seqlens")}

# apply_rope's configuration keywords (RopeConfig.parse's), stated once. Their default is
# None (not given), so that any keyword passed beside config= is seen and refused; None
# means: base 10000 (or the dict's rope_theta), interleaved False, rotary_dim head_dim,
# no scaling, layout "bshd", no sections, sections_mode "axial".
# The table holds each keyword's annotation; every RoPE function and module takes them
# through ``with_rope_settings`` (its signature lists them), none spells them out again.
_CONFIG_KEYWORDS: Dict[str, Any] = dict(
    base=Optional[float], interleaved=Optional[bool], rotary_dim=Optional[int], scaling=Optional[Mapping[str, Any]],
    layout=Optional[str], sections=Optional[Sequence[int]], sections_mode=Optional[str])
_CONFIG_DEFAULTS = dict.fromkeys(_CONFIG_KEYWORDS)
# The plain settings (POSENC_ROPE_SETTINGS in posenc/math/rope.h, each declared once there):
# the schema's arguments after sections_mode, with their schema types' names ("int", "float":
# strings, which torch.compile traces; torch 2.15's cannot trace str() of a schema type).
# Every RoPE function and module takes each as a keyword (``with_rope_settings``; default
# None: the schema's).
_ROPE_ARGUMENTS = torch.ops.posenc.rope.default._schema.arguments
PLAIN_SETTINGS = {a.name: str(a.type) for a in
                  _ROPE_ARGUMENTS[[a.name for a in _ROPE_ARGUMENTS].index("sections_mode") + 1:]}
_CONFIG_KEYWORDS.update({name: Optional[int] if t == "int" else Optional[float]
                         for name, t in PLAIN_SETTINGS.items()})
_CONFIG_DEFAULTS.update(dict.fromkeys(PLAIN_SETTINGS))


def _plain_setting(fn: str, name: str, value: Any) -> Any:
    """A plain setting's value by its schema type (int or float); the op checks the value."""
    want = PLAIN_SETTINGS[name]
    if want == "int" and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{fn}: expected {name} to be an int, got {value!r}")
    if want == "float" and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{fn}: expected {name} to be a real number, got {value!r}")
    return _in_int64(fn, name, int(value)) if want == "int" else float(value)


def with_rope_settings(fn: Any) -> Any:
    """Lists RoPE's configuration keywords (``_CONFIG_KEYWORDS``: base, interleaved,
    rotary_dim, scaling, layout, sections, sections_mode and the plain settings) as
    keyword-only parameters of ``fn`` (a function, or a module class: its ``__init__``),
    which takes them as ``**rope`` and hands them to :meth:`RopeConfig.parse` (help(),
    inspect and IDEs list them by name). A keyword ``fn`` names itself (the module's
    positional ``base``) stays where it is."""
    target = fn.__init__ if isinstance(fn, type) else fn
    signature = inspect.signature(target)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    where = next((i for i, p in enumerate(params) if p.name in ("config", "seq_len")), len(params))
    own = {p.name for p in params}
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
             for name, annotation in _CONFIG_KEYWORDS.items() if name not in own]
    target.__signature__ = signature.replace(parameters=params[:where] + extra + params[where:])
    return fn


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """A RoPE configuration, parsed once: the settings the RoPE ops take beside the tensors
    and their positions (``rope``'s schema tail from ``base`` on, without ``seq_len``).

    Build it with :meth:`parse` from :func:`apply_rope`'s keywords (a Hugging Face dict's
    ``rope_theta``, ``partial_rotary_factor`` and ``mrope_section`` resolved, the scaling
    dict flattened to the op's list); the modules build theirs in ``__init__`` and pass it on
    (``apply_rope(q, k, config=...)``), so a call does not parse it again. The op checks the
    values on every call (cheap, in C++); ``RotaryPositionalEncoding`` also checks them once
    when it is built."""

    base: float
    rope_type: str
    scaling: Tuple[float, ...]
    rotary_dim: int  # -1: head_dim (or 2 * sum(sections))
    interleaved: bool
    layout: str
    sections: Tuple[int, ...]
    sections_mode: str
    head_dim: int  # the heads it was parsed for (partial_rotary_factor gave rotary_dim from it)
    # The plain settings given, (name, value) in schema order (PLAIN_SETTINGS).
    settings: Tuple[Tuple[str, Any], ...] = ()
    # The op's keyword arguments for these settings, those that differ from the schema's
    # defaults only (each keyword torch.ops parses costs about half a microsecond).
    op_kwargs: Tuple[Tuple[str, Any], ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        settings = dict(base=self.base, rope_type=self.rope_type, scaling=list(self.scaling),
                        rotary_dim=self.rotary_dim, interleaved=self.interleaved, layout=self.layout,
                        sections=list(self.sections), sections_mode=self.sections_mode, **dict(self.settings))
        kwargs = tuple((k, v) for k, v in settings.items() if v != _SCHEMA_DEFAULTS[k])
        object.__setattr__(self, "op_kwargs", kwargs)

    @classmethod
    def parse(
        cls,
        *,
        head_dim: int,
        max_position_embeddings: Optional[int] = None,
        fn: str = "apply_rope",
        **settings: Any,
    ) -> "RopeConfig":
        """The configuration of :func:`apply_rope`'s configuration keywords (``base``,
        ``interleaved``, ``rotary_dim``, ``scaling``, ``layout``, ``sections``,
        ``sections_mode`` and the plain settings: the keys of ``_CONFIG_KEYWORDS``, stated once) for heads of
        ``head_dim`` features. ``max_position_embeddings``: the model's (the module's
        ``max_position_embeddings=``, default its max_len), for the keys transformers fills from
        the config (``scaling_arguments``)."""
        if not settings and _DEFAULT_STATE:  # no keyword: the defaults, parsed once below the class
            # (empty while that first parse runs): that parse's state with this head_dim, without
            # running __init__ and __post_init__ again on the same values (~5 us of a decoding
            # step). Dynamo does not trace a __dict__ update: a traced call (once) constructs it.
            if torch.compiler.is_compiling():
                return cls(**{name: _DEFAULT_STATE[name] for name in _INIT_FIELDS}, head_dim=head_dim)
            config = object.__new__(cls)
            config.__dict__.update(_DEFAULT_STATE, head_dim=head_dim)
            return config
        unknown = sorted(set(settings) - set(_CONFIG_DEFAULTS))
        if unknown:
            raise TypeError(f"{fn}: unknown RoPE setting(s) {unknown}; expected {', '.join(_CONFIG_DEFAULTS)}")
        settings = {**_CONFIG_DEFAULTS, **settings}
        base, interleaved, rotary_dim, scaling, layout, sections, sections_mode = (
            settings[name] for name in _CONFIG_DEFAULTS if name not in PLAIN_SETTINGS)
        interleaved = False if interleaved is None else _bool_arg(fn, "interleaved", interleaved)
        if base is not None and not isinstance(base, torch.SymFloat):
            base = _float_arg(fn, "base", base)
        layout = _SCHEMA_DEFAULTS["layout"] if layout is None else layout
        if not isinstance(layout, str):
            raise TypeError(f"{fn}: expected layout to be a str, one of {', '.join(LAYOUTS)}; got {layout!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"{fn}: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        if rotary_dim is not None:
            if (number := _integer(rotary_dim)) is None:
                raise TypeError(f"{fn}: expected rotary_dim to be an int or None, got {rotary_dim!r}")
            rotary_dim = _in_int64(fn, "rotary_dim", number)  # a numpy integer as an int
        scaling, base, rotary_dim, sections, sections_mode = resolve_config_keys(
            scaling, base=base, rotary_dim=rotary_dim, head_dim=head_dim, sections=sections,
            sections_mode=sections_mode, fn=fn)
        rope_type, values = scaling_arguments(scaling, max_position_embeddings)
        plain = tuple((name, _plain_setting(fn, name, settings[name])) for name in PLAIN_SETTINGS
                      if settings[name] is not None)
        return cls(base=float(_SCHEMA_DEFAULTS["base"] if base is None else base), rope_type=rope_type,
                   scaling=tuple(values),
                   rotary_dim=_SCHEMA_DEFAULTS["rotary_dim"] if rotary_dim is None else rotary_dim,
                   interleaved=bool(interleaved),
                   layout=layout, sections=tuple(_sections(sections)), sections_mode=sections_mode,
                   head_dim=head_dim, settings=plain)


# The state of the configuration without keywords (the path through RopeConfig.parse with
# none given is a decoding step's common call): parsed once here by the code above, so that
# parse returns it without parsing again; an immutable constant (tuples, numbers and
# strings), not a cache.
_DEFAULT_STATE: Dict[str, Any] = {}
_DEFAULT_STATE.update({name: value for name, value in vars(RopeConfig.parse(head_dim=0)).items()
                       if name != "head_dim"})
_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(RopeConfig) if f.init and f.name != "head_dim")

def config_of(q: Tensor, config: Optional[RopeConfig], fn: str, **keywords: Any) -> RopeConfig:
    """``config`` when given (then every configuration keyword must be at its default),
    else the configuration parsed from the keywords for q's head_dim."""
    if config is None:
        if not isinstance(q, Tensor):
            raise TypeError(f"{fn}: expected q to be a Tensor, got {type(q).__name__}")
        return RopeConfig.parse(head_dim=_static_shape(q)[-1] if q.dim() else 0, fn=fn, **keywords)
    if not isinstance(config, RopeConfig):
        raise TypeError(f"{fn}: expected config to be a posenc RopeConfig or None, got {type(config).__name__}")
    given = [name for name, value in keywords.items() if value is not None]
    if given:
        raise ValueError(f"{fn}: got config and {', '.join(given)}; pass the configuration once (in config, "
                         f"or as keywords)")
    if isinstance(q, Tensor) and q.dim() and _static_shape(q)[-1] != config.head_dim:
        raise ValueError(f"{fn}: expected q with head_dim {config.head_dim} (the config's), got shape "
                         f"{tuple(_static_shape(q))}")
    return config


def per_sequence_offsets(
    q: Tensor, offset: Tensor, layout: str, cu_seqlens: Optional[Tensor], fn: str = "apply_rope"
) -> Tensor:
    """A tensor offset as the ops' per-sequence offsets: a 0-dim one is every sequence's (as an
    int offset is), expanded to one per sequence on q's device (under torch.jit.trace a size
    such as cache.shape[1] is a 0-dim CPU tensor, which the trace then records as an input);
    any other shape is the ops' to check."""
    if offset.dtype != torch.int64:  # named as the caller named it (the ops say "offsets")
        raise TypeError(f"{fn}: expected offset to be an int or an int64 tensor, got a tensor of dtype "
                        f"{offset.dtype}")
    if offset.dim() != 0:
        return offset
    if offset.is_meta and not q.is_meta:  # as the ops refuse a meta tensor among real ones
        raise RuntimeError(f"{fn}: got offset on the meta device but q on {q.device}; a meta tensor holds no "
                           f"value to copy")
    b = LAYOUT_AXES[layout][0]
    count = q.shape[b] if b is not None and q.dim() > b else (
        cu_seqlens.shape[0] - 1 if isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 1 else 1)
    if not isinstance(count, Tensor):  # traced, a size stays one (the graph takes any batch)
        count = max(count, 0)
    # A CPU offset is copied without a stream sync: pageable memory is staged at the call; a
    # pinned one would be read later by the DMA (a race with the caller's next `offset += 1`),
    # so that one is copied as before.
    # (torch.compile cannot trace is_pinned(): its graph copies as inductor does. Under a
    # torch.func transform the wrapper cannot tell, so the copy blocks.)
    pinned = not torch.compiler.is_compiling() and not is_dtensor(offset) and (
        torch._C._functorch.is_functorch_wrapped_tensor(offset) or offset.is_pinned())
    return offset.to(q.device, non_blocking=not pinned).reshape(1).expand(count).contiguous()


def rope_op_arguments(
    q: Tensor,
    config: RopeConfig,
    *,
    positions: Optional[Tensor],
    offset: Union[int, Tensor],
    cu_seqlens: Optional[Tensor],
    check_inputs: bool,
    seq_len: Optional[int],
    fn: str = "apply_rope",
) -> dict:
    """The RoPE arguments of the ops (rope's schema tail, shared by the fused ops that rotate
    as rope does: qk_norm_rope, rope_append_kv): the call's positions beside the parsed
    configuration, as keyword arguments; ``fn`` names the function in messages."""
    if not isinstance(q, Tensor):
        raise TypeError(f"{fn}: expected q to be a Tensor, got {type(q).__name__}")
    _optional_tensor_args(fn, positions=positions, cu_seqlens=cu_seqlens)
    check_inputs = _bool_arg(fn, "check_inputs", check_inputs)
    offsets = None
    if isinstance(offset, Tensor):
        offsets, offset = per_sequence_offsets(q, offset, config.layout, cu_seqlens, fn), 0
    elif (number := _integer(offset)) is None:
        raise TypeError(f"{fn}: expected offset to be an int or an int64 tensor, got {offset!r}")
    else:
        offset = _in_int64(fn, "offset", number)  # a numpy integer as an int
    if seq_len is not None:
        if (number := _integer(seq_len)) is None:
            hint = (" (under torch.jit.trace a size is a 0-dim tensor, and a traced seq_len would be a constant: "
                    "leave seq_len None and the op reads the call's longest position + 1 at run time)"
                    if isinstance(seq_len, Tensor) else "")
            raise TypeError(f"{fn}: expected seq_len to be an int or None, got {seq_len!r}{hint}")
        seq_len = _in_int64(fn, "seq_len", number)
    if seq_len is not None and seq_len < 0:
        raise ValueError(f"{fn}: expected seq_len >= 0 (the longest position + 1), got {seq_len}")
    # -1: the op reads the longest position from the call.
    seq_len = (-1 if seq_len is None else seq_len) if config.rope_type in LENGTH_SCALED_TYPES else 0
    if (
        check_inputs
        and cu_seqlens is not None
        and cu_seqlens.is_cuda
        and q.dim() == 3
        and not torch.compiler.is_compiling()
    ):
        check_cu_seqlens(cu_seqlens, q.shape[0])
    # A DTensor q with plain index tensors beside it: those are replicated on its mesh.
    positions, offsets, cu_seqlens = place_beside(q, positions, offsets, cu_seqlens)
    arguments = dict(config.op_kwargs)  # the call's arguments at the schema's defaults are left out
    for name, value in (("positions", positions), ("offsets", offsets), ("cu_seqlens", cu_seqlens)):
        if value is not None:
            arguments[name] = value
    # Under torch.compile an int may be a dynamic one: comparing it with 0 would guard on it
    # (a graph of its own for offset 0), so it is passed as it is.
    compiling = torch.compiler.is_compiling()
    if compiling or not (type(offset) is int and offset == 0):
        arguments["offset"] = offset
    if compiling or not (type(seq_len) is int and seq_len == 0):
        arguments["seq_len"] = seq_len
    if check_inputs and not compiling and (is_sharded(positions) or is_sharded(offsets)):
        # The kernel checks each rank's shard (positions and offsets within 2**53): one rank
        # alone would raise, the others going on to block in their next collective. The
        # bounds op gathers them (distributed.py) and raises on every rank: one gather and
        # one read-back per call, so asked for (check_inputs), as the cu_seqlens check is;
        # the module gathers its bounds for its own range check anyway.
        torch.ops.posenc.rope_position_bounds(q, **arguments)
    return arguments


@with_rope_settings
def apply_rope(
    q: Tensor,
    k: Optional[Tensor] = None,
    *,
    positions: Optional[Tensor] = None,
    offset: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    inplace: bool = False,
    inverse: bool = False,
    check_inputs: bool = False,
    seq_len: Optional[int] = None,
    config: Optional[RopeConfig] = None,
    **rope: Any,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Rotary position embedding of q (and k), fused in one kernel launch.

    Args:
        q, k: (batch, seq, heads, head_dim) for layout "bshd"; "bhsd" (Hugging Face),
            "sbhd" (Megatron) or "thd" (packed tokens, with ``cu_seqlens``). q and k may have
            different head counts (GQA/MQA) and any strides; float16, bfloat16, float32 or
            float64 (half precision is rotated in float32).
        positions: int64 (seq,) or (batch, seq) (or (1, seq), Hugging Face's position_ids of
            one sequence, shared by every row); default ``0 .. seq-1``. With ``sections``:
            one coordinate per axis, (n_axes, seq) or (n_axes, batch, seq) ((n_axes, tokens)
            for "thd", absolute per token); default ``0 .. seq-1`` on every axis.
        offset: added to every position: an int, or an int64 (batch,) tensor of
            per-sequence offsets (one per sequence of ``cu_seqlens`` for "thd"); a 0-dim
            int64 tensor is every sequence's offset (under ``torch.jit.trace`` a size such as
            ``cache.shape[1]`` is one, and the trace then reads it at run time).
        cu_seqlens: int32/int64 cumulative lengths ``[0, n0, n0+n1, ..., tokens]`` for "thd";
            positions restart at 0 at each sequence start.
        base, rotary_dim, interleaved: frequencies ``base**(-2i/rotary_dim)`` (base default
            10000, or the dict's ``rope_theta``) of the first ``rotary_dim`` features (default
            all; with ``sections``, ``2 * sum(sections)``); pairs are halves
            ``(i, i + rotary_dim/2)`` (GPT-NeoX, HF LLaMA) or adjacent ``(2i, 2i+1)`` when
            ``interleaved`` (GPT-J, Meta).
        rotary_offset: the first rotated feature (default 0): features ``[rotary_offset,
            rotary_offset + rotary_dim)`` rotate and the others pass through, ``rotary_dim``
            defaulting to ``head_dim - rotary_offset`` (DeepSeek's ``[nope | rope]`` heads:
            ``rotary_offset=qk_nope_head_dim``).
        scaling: None or a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (transformers
            4 or 5) of type "default", "linear", "dynamic", "yarn", "llama3", "longrope"
            (Phi-3: ``short_factor`` / ``long_factor`` lists, one factor per pair) or
            "proportional" (Gemma 4: its own ``partial_rotary_factor``); its
            ``rope_theta``, ``partial_rotary_factor`` and ``mrope_section`` /
            ``mrope_interleaved`` set base, rotary_dim and sections (an explicit argument
            that disagrees is an error). "dynamic" scales by the longest position of the call, and
            "longrope" switches to ``long_factor`` beyond ``original_max_position_embeddings``
            by it (read from the tensors when positions/offsets/cu_seqlens are given: a device
            sync; or pass ``seq_len``). "longrope" needs ``factor`` (max_position_embeddings /
            original; the module fills it from its ``max_position_embeddings=``, default
            max_len) or ``attention_factor``.
        sections: multi-axis RoPE (M-RoPE, axial 2-D/3-D RoPE): the number of rotary pairs
            each position axis turns, summing to ``rotary_dim // 2``. ``offset`` is added on
            every axis.
        sections_mode: how the pairs are split. "axial" (default): contiguous sections of
            pairs, each with the frequencies of its own 1-D RoPE of width ``2 * sections[a]``
            (a pair is features (i, i + rotary_dim / 2) as in 1-D RoPE, or (2i, 2i + 1) with
            ``interleaved``) (FLUX ``axes_dim // 2``,
            EVA-02 / timm, torchtune vision); "mrope": contiguous sections of one frequency
            list over ``rotary_dim`` (Qwen2-VL / Qwen2.5-VL ``mrope_section``);
            "mrope_interleaved": the same frequencies, pair p on axis ``p % n_axes`` within
            the first ``n_axes * sections[a]`` pairs, else axis 0 (Qwen3-VL); each axis
            a >= 1 must get all its ``sections[a]`` pairs.
        inplace: rotate q and k in their own storage (inference; no autograd) and return them.
        inverse: rotate by minus each angle (the transpose of the rotation), undoing the
            same call without it: ``apply_rope(apply_rope(x, ...), ..., inverse=True)`` is x
            to rounding (times the attention factor squared for yarn / longrope, which both
            calls apply, as transformers' cos and -sin tables carry it). DeepSeek V4 turns its
            attention output back so before the output projection (transformers'
            ``apply_rotary_pos_emb(attn_output, cos, -sin)``). Differentiable: its gradient is
            the forward rotation.
        check_inputs: also check CUDA ``cu_seqlens`` values on the host in eager mode, for a
            ``ValueError`` naming them (one device sync, so no CUDA graph capture). By
            default the kernel checks them on the device, as ATen's indexing checks its
            indices: a bad ``cu_seqlens`` (or a position or offset outside [-2**53, 2**53])
            stops it with a device-side assert, a ``RuntimeError`` at the next
            synchronisation (not run: no GPU here). CPU index tensors are always checked by
            the op. DTensor positions or offsets sharded over ranks: also their gathered bounds, so an
            out-of-range one raises on every rank (docs/distributed.md).
        seq_len: for "dynamic" and "longrope" scaling, the length they scale for (longest position + 1);
            default: read from the call. Pass the global length when the call sees a shard
            of the sequence (context parallel; see docs/distributed.md), or
            to avoid the device sync of reading it. Ignored by the other scaling types.
        config: a :class:`RopeConfig` parsed once (``RopeConfig.parse`` takes the keywords
            above, from ``base`` to ``sections_mode``), instead of those keywords: what the
            modules pass, so a call does not parse the configuration again.

    Returns the rotated q, or (q, k) when k is given. Positions have no table and no max_len;
    positions, offsets and ``offset`` must each lie in [-2**53, 2**53] (so their sum cannot
    overflow int64; a summed position within that range is exact in the float64 angle, which
    is reduced exactly, so accuracy holds there). An
    int ``offset`` and CPU index tensors are checked by the op; CUDA index tensors by the
    kernel, on the device (see ``check_inputs``).
    """
    _optional_tensor_args("apply_rope", k=k)
    config = config_of(q, config, "apply_rope", **rope)
    arguments = rope_op_arguments(q, config, positions=positions, offset=offset, cu_seqlens=cu_seqlens,
                                  check_inputs=check_inputs, seq_len=seq_len)
    if _bool_arg("apply_rope", "inverse", inverse):
        arguments["inverse"] = True
    if _bool_arg("apply_rope", "inplace", inplace):
        _refuse_captured_writes("apply_rope", q=q, k=k)
        torch.ops.posenc.rope_(q, k, **arguments)
        return q if k is None else (q, k)
    out_q, out_k = torch.ops.posenc.rope(q, k, **arguments)
    if is_dtensor(q):  # in q's and k's placements, as add_position keeps x's
        out_q, out_k = placed_as(out_q, q), (out_k if k is None else placed_as(out_k, k))
    return out_q if k is None else (out_q, out_k)


def rotary_width(config: RopeConfig) -> int:
    """How many features of a head ``config`` rotates (``rotary_dim``, by default the rest of
    the head from ``rotary_offset``, or ``2 * sum(sections)``), after the op's checks of every
    value for heads of ``config.head_dim`` features: the op's rule (rope_rotary_width), asked
    on an empty q."""
    if config.layout == "thd":
        q, extra = torch.empty(0, 1, config.head_dim), dict(cu_seqlens=torch.zeros(1, dtype=torch.int64))
    else:
        q, extra = torch.empty(0, 0, 1, config.head_dim), {}
    return torch.ops.posenc.rope_rotary_width(q, **dict(config.op_kwargs), **extra)


def check_one_baseline(fn: str, rope_type: str, scaling: Any, max_position_embeddings: Optional[int]) -> None:
    """A type that scales beyond one length ("dynamic"): transformers' rule scales by the
    config's max_position_embeddings and ignores the dict's original_max_position_embeddings,
    posenc reads the key. Both given and different are two readings: refused (rope_cos_sin
    and RotaryPositionalEncoding alike)."""
    given = scaling.get("original_max_position_embeddings") if isinstance(scaling, Mapping) else None
    if (rope_type in LENGTH_BASELINE_TYPES and given is not None
            and max_position_embeddings is not None and given != max_position_embeddings):
        raise ValueError(f"{fn}: rope_type {rope_type!r} scales beyond one length: transformers reads the "
                         f"config's max_position_embeddings ({max_position_embeddings}) and ignores the dict's "
                         f"original_max_position_embeddings ({given}); pass one of them, or equal ones")


def _check_length_baseline(scaling: dict, rope_type: str, max_len: int, model_len: Optional[int]) -> None:
    """A type that scales by length with original_max_position_embeddings defaulting to the
    model's ("dynamic") rescales only when a call's positions pass that baseline (the dict's,
    else ``model_len``: max_position_embeddings when given apart from max_len), and the module
    refuses positions at or beyond max_len: a baseline at or above max_len (or the default,
    max_len) would make the scaling a silent no-op."""
    orig = scaling.get("original_max_position_embeddings")  # a key given as None is not given
    orig = model_len if orig is None else orig
    if orig is None:
        raise ValueError(
            f"RotaryPositionalEncoding: {rope_type!r} scaling needs 'original_max_position_embeddings' "
            f"(the context length the model was trained on, Hugging Face's max_position_embeddings), "
            f"below max_len={max_len}: positions beyond it are what it rescales"
        )
    if orig >= max_len:
        raise ValueError(
            f"RotaryPositionalEncoding: {rope_type!r} scaling with original_max_position_embeddings={orig} "
            f">= max_len={max_len} would never apply (positions stop below max_len); expected it below max_len"
        )


class _ParsedOnce:
    """Modules built from a parsed RoPE configuration (``rope_config``, set once): the
    frequencies, attention factor, rotary width and weights derived from it at construction
    would go stale under a reassigned one (the module rotated with the new settings and checked
    and reported the old ones), so it is read-only, as the settings read from it are."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "rope_config" and "rope_config" in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: rope_config is read-only (the module was built from it); "
                                 f"build a new module with the new settings")
        super().__setattr__(name, value)


@with_rope_settings
class RotaryPositionalEncoding(_ParsedOnce, nn.Module):
    r"""Rotary position embedding (RoPE, Su et al.) of queries and keys, fused for q and k.

    ``q, k = rope(q, k)`` returns rotated copies (one kernel launch for both); ``x =
    rope(x)`` rotates one tensor (torchtune's ``RotaryPositionalEmbeddings`` call form).
    Positions are ``0 .. seq-1`` plus ``offset`` (an int, or an int64 (batch,) tensor of
    per-sequence KV-cache lengths, or a 0-dim one for every sequence), or ``positions``
    (int64 (seq,) or (batch, seq)).

    Args:
        dim: head_dim of q and k.
        max_len: positions must lie in ``[0, max_len)``; an IndexError is raised otherwise
            (the functional :func:`posenc.functional.apply_rope` has no limit). Position
            tensors are read for it in eager mode; under torch.compile and torch.export
            (an AOTInductor package too) their bounds stay on the device and a position
            outside the range is a RuntimeError (a device-side assert on CUDA), with no
            host sync. A module traced by torch.jit.trace (or on CUDA with
            ``check_positions`` False) rotates at the positions given, beyond ``max_len``
            too, as the function does. An int ``offset`` is checked in eager mode, under
            torch.compile and by an exported program's ``module()``, not in a traced
            module or an AOTInductor package: docs/deploy.md.
        base: RoPE base ("rope_theta"; default 10000, or the scaling dict's ``rope_theta``).
        interleaved: rotate adjacent pairs (GPT-J, Meta LLaMA, torchtune) instead of halves
            (GPT-NeoX, Hugging Face ``rotate_half``).
        rotary_dim: rotate only the first ``rotary_dim`` features (partial rotary);
            default ``dim`` (``2 * sum(sections)`` with sections).
        rotary_offset: rotate the ``rotary_dim`` features from this one on instead of the
            first (default 0; ``rotary_dim`` then defaults to ``dim - rotary_offset``), as in
            :func:`posenc.functional.apply_rope` (DeepSeek's ``[nope | rope]`` heads).
        scaling: None or a Hugging Face ``rope_scaling`` dict ("linear", "dynamic", "yarn",
            "llama3", "longrope" or "proportional"). "dynamic" needs
            ``original_max_position_embeddings`` (in the dict, or ``max_position_embeddings``
            below) below ``max_len`` (the trained context,
            Hugging Face's ``max_position_embeddings``: positions beyond it are what it
            rescales); for "yarn" it defaults to ``max_position_embeddings``, and
            "longrope"'s ``factor`` to ``max_position_embeddings /
            original_max_position_embeddings``.
        max_position_embeddings: the model's length those defaults come from, as
            transformers fills them from its config (keyword only; default ``max_len``).
            Give it when ``max_len`` (the range check) is not the model's length: a Phi-3
            dict without ``factor`` would otherwise take its attention factor from
            ``max_len``.
        device: ``inv_freq``'s device (keyword only; default the default device), as Hugging
            Face's rotary embeddings take it.
        layout: "bshd" (default), "bhsd", "sbhd" or "thd" (packed, with ``cu_seqlens``).
        sections, sections_mode: multi-axis RoPE (Qwen2-VL M-RoPE, axial 2-D/3-D RoPE), as
            in :func:`posenc.functional.apply_rope`; positions are then (n_axes, ...) and
            every coordinate must lie in ``[0, max_len)``.

    ``inv_freq`` is a non-persistent buffer (Hugging Face's name and convention, so
    state_dicts stay clean), float32 until a dtype cast of the module converts it, holding the
    frequencies for inspection; the kernel evaluates them itself in float64 from the
    configuration, so a dtype cast of the module does not change the numbers, and an edit
    of ``inv_freq`` changes nothing: eager calls warn when a CPU ``inv_freq`` differs from
    the configuration's (beyond a dtype cast's rounding; on other devices it is not read, as
    that would sync; build a module with the base or scaling you want).
    ``attention_scaling`` is yarn's or longrope's factor on cos and sin (1 for the other
    types).

    ``check_positions`` (attribute, default True): positions given as CUDA tensors
    (``positions``, a tensor ``offset`` such as a decode step's cache lengths, ``cu_seqlens``)
    are range-checked on the host in eager mode, one device sync per call; set it to False in
    a hot loop whose positions are known to be valid (compiled or exported, the check is a
    few small kernels per call and a device-side assert: False drops them for CUDA index
    tensors; CPU ones are always checked).
    """

    inv_freq: Tensor
    check_positions: bool = True

    def __init__(
        self,
        dim: int,
        max_len: int = 4096,
        base: Optional[float] = None,
        *,
        max_position_embeddings: Optional[int] = None,
        device: Optional[Union[torch.device, str, int]] = None,
        **rope: Any,
    ) -> None:
        super().__init__()
        fn = "RotaryPositionalEncoding"
        dim = _check_positive_int(fn, "dim", dim)
        self._max_len = _check_positive_int(fn, "max_len", max_len)
        model_len = self._max_len if max_position_embeddings is None else _check_positive_int(
            fn, "max_position_embeddings", max_position_embeddings)
        scaling = _scaling_mapping(fn, rope.get("scaling"))
        self._scaling = None if scaling is None else dict(scaling)
        # The configuration, parsed once (a transformers dict's rope_theta,
        # partial_rotary_factor and mrope_section resolved; the model defaults
        # max_position_embeddings gives the scaling keys) and passed on at every call; the
        # settings below read it (read-only: a changed setting would have to be parsed again:
        # build a new module).
        self.rope_config = RopeConfig.parse(
            head_dim=dim, base=base, max_position_embeddings=model_len, fn="RotaryPositionalEncoding",
            **rope)
        c = self.rope_config
        self._rotary_width = rotary_width(c)
        check_one_baseline(fn, c.rope_type, self._scaling, max_position_embeddings)
        if c.rope_type in LENGTH_BASELINE_TYPES:
            _check_length_baseline(self._scaling, c.rope_type, self.max_len,
                                   None if max_position_embeddings is None else model_len)
        # The frequencies (rope_frequencies checks what an empty call does not reach).
        inv_freq, factor = self._frequencies()
        self._attention_scaling = float(factor)
        # On `device`, else the default device (`with torch.device("meta")`,
        # torch.set_default_device), as the module's other tensors would be: the op, which
        # takes no tensor, returns a CPU one.
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device() if device is None else device,
                                                     torch.float32), persistent=False)

    def _frequencies(self) -> Tuple[Tensor, float]:
        c = self.rope_config
        return torch.ops.posenc.rope_frequencies(
            self._rotary_width, c.base, c.rope_type, list(c.scaling), 0, list(c.sections), c.sections_mode)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``inv_freq`` computed again, in its dtype and on its device (after ``to_empty``;
        forward never reads it: the kernels evaluate the frequencies themselves)."""
        self.inv_freq.copy_(self._frequencies()[0])

    def forward(
        self,
        q: Tensor,
        k: Optional[Tensor] = None,
        *,
        positions: Optional[Tensor] = None,
        offset: Union[int, Tensor] = 0,
        cu_seqlens: Optional[Tensor] = None,
        input_pos: Optional[Tensor] = None,
        seq_len: Optional[int] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Rotated q, or (q, k) when k is given. ``input_pos`` is torchtune's name for
        ``positions`` ((batch, seq) or (seq,)), so the module can serve as a torchtune
        attention's ``pos_embeddings``. ``seq_len``: as in :func:`posenc.functional.apply_rope`
        ("dynamic" scaling's length; the global one for a shard of the sequence), default the
        longest position of the call."""
        _tensor_arg("RotaryPositionalEncoding", "q", q)
        _optional_tensor_args("RotaryPositionalEncoding", k=k)
        if input_pos is not None:
            if positions is not None:
                raise ValueError("RotaryPositionalEncoding: got both positions and input_pos (torchtune's name "
                                 "for positions); pass one")
            positions = input_pos
        # The module's dim is q's and k's head_dim (its frequencies are for it), as in C++.
        for name, t in (("q", q), ("k", k)):
            if isinstance(t, Tensor) and (t.dim() == 0 or _static_shape(t)[-1] != self.dim):
                raise ValueError(f"RotaryPositionalEncoding: expected {name} with head_dim {self.dim} (the module's "
                                 f"dim), got shape {tuple(_static_shape(t))}")
        if isinstance(offset, Tensor):  # a 0-dim offset as per-sequence offsets, once for the check and the op
            offset = per_sequence_offsets(q, offset, self.layout, cu_seqlens, "RotaryPositionalEncoding")
        longest = self._check_range(q, positions, offset, cu_seqlens)
        self._check_inv_freq()
        return apply_rope(
            q, k, positions=positions, offset=offset, cu_seqlens=cu_seqlens, config=self.rope_config,
            seq_len=seq_len if seq_len is not None or longest is None else max(longest + 1, 0),
        )

    def _check_inv_freq(self) -> None:
        """``inv_freq`` is for inspection (the kernels evaluate the frequencies from the
        configuration): an edit of it (in place, or a replacement, as Hugging Face users patch
        theirs) would be silently ignored, so a CPU buffer is compared with the configuration's
        frequencies when its version or identity changed (eager mode; rotary_dim / 2 values)
        and a difference beyond a dtype cast's rounding is a warning, once per change. A
        buffer on another device is not compared: reading it would sync, and DDP's buffer
        broadcast moves its version every step (DataParallel replaces it). An ``inv_freq``
        made a trainable Parameter is a warning too (once per Parameter): it gets no
        gradient."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return  # traced: the version is not the run's (the transformers path asserts instead)
        buf = self._buffers.get("inv_freq")
        if buf is None and torch.nn.utils.parametrize.is_parametrized(self, "inv_freq"):
            # A parametrization's output is not read either. Once per module.
            if self.__dict__.get("_inv_freq_seen") != "parametrized":
                self._inv_freq_seen = "parametrized"
                warnings.warn(
                    "RotaryPositionalEncoding: inv_freq is parametrized, but forward does not read it (the kernels "
                    "evaluate the frequencies from the configuration): the parametrization changes nothing",
                    UserWarning, stacklevel=2)
            return
        if buf is None:
            buf = self._parameters.get("inv_freq")
            if type(buf) is nn.Parameter and buf.requires_grad:
                # Learnable frequencies: no gradient would reach it, and its optimizer steps
                # would change nothing, whatever its device. Once per Parameter.
                seen = self.__dict__.get("_inv_freq_seen")
                if seen is None or seen[0] is not buf:
                    self._inv_freq_seen = (buf, None)
                    warnings.warn(
                        "RotaryPositionalEncoding: inv_freq is a Parameter, but forward does not read it (the "
                        "kernels evaluate the frequencies from the configuration): it gets no gradient and training "
                        "it changes nothing. posenc has no learnable RoPE frequencies", UserWarning, stacklevel=2)
                return
        if (type(buf) not in (Tensor, nn.Parameter) or buf.device.type != "cpu"
                or torch._C._functorch.is_functorch_wrapped_tensor(buf)):
            return  # a subclass (DTensor), another device (or meta), or under a torch.func transform
        version = None if buf.is_inference() else buf._version  # inference tensors have none
        seen = self.__dict__.get("_inv_freq_seen")
        if seen is not None and seen[0] is buf and seen[1] == version:
            return
        self._inv_freq_seen = (buf, version)
        want = self._frequencies()[0].double()
        # Within casts' rounding (module.half() then .to(torch.bfloat16) keeps both roundings):
        # twice bfloat16's relative 2**-8, float16's subnormal spacing 2**-24.
        if buf.shape != want.shape or not torch.allclose(buf.double(), want, rtol=2**-7, atol=2**-24):
            warnings.warn(
                "RotaryPositionalEncoding: inv_freq differs from the frequencies of the module's "
                f"configuration (base={self.base}, scaling={self._scaling}): it is not read by forward (the "
                "kernels evaluate the frequencies from the configuration), so an edit of it changes nothing. "
                "Build a module with the base or scaling you want; after to_empty(), reset_parameters() "
                "restores it", UserWarning, stacklevel=2)

    def __setstate__(self, state: dict) -> None:
        """A module pickled before its configuration was parsed once (posenc before
        2026-12-03: the settings as attributes) is rebuilt into a RopeConfig."""
        state = dict(state)
        # Before 2026-12-05 max_len and attention_scaling were plain (writable) attributes.
        for name in ("max_len", "attention_scaling"):
            if name in state:
                state[f"_{name}"] = state.pop(name)
        if "rope_config" not in state and "base" in state:
            settings = {name: state.pop(name, None) for name in
                        ("base", "interleaved", "rotary_dim", "layout", "sections", "sections_mode")}
            state["_scaling"] = state.pop("scaling", None)
            state["rope_config"] = RopeConfig.parse(
                head_dim=state.pop("dim"), scaling=state["_scaling"], max_position_embeddings=state["_max_len"],
                fn="RotaryPositionalEncoding", **settings)
        state.setdefault("_rotary_width", rotary_width(state["rope_config"]))
        state.pop("dim", None)  # before 2026-12-07 a plain (writable) attribute: the config's head_dim
        super().__setstate__(state)

    # The settings, read from the parsed configuration (read-only: the scaling's defaults
    # and attention factor were derived from them once; build a new module to change one).
    @property
    def dim(self) -> int:
        return self.rope_config.head_dim

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def attention_scaling(self) -> float:
        return self._attention_scaling

    @property
    def base(self) -> float:
        return self.rope_config.base

    @property
    def interleaved(self) -> bool:
        return self.rope_config.interleaved

    @property
    def rotary_dim(self) -> int:
        return self._rotary_width  # resolved by the op (rope_rotary_width)

    @property
    def layout(self) -> str:
        return self.rope_config.layout

    @property
    def sections(self) -> Optional[Tuple[int, ...]]:
        return self.rope_config.sections or None  # a tuple: the setting cannot be edited in place

    @property
    def sections_mode(self) -> str:
        return self.rope_config.sections_mode

    @property
    def scaling(self) -> Optional[Mapping[str, Any]]:
        # A read-only view: an edit in place would not reach the parsed configuration.
        return None if self._scaling is None else types.MappingProxyType(self._scaling)

    def _check_range(
        self, q: Tensor, positions: Optional[Tensor], offset: Union[int, Tensor], cu_seqlens: Optional[Tensor]
    ) -> Optional[int]:
        """Positions must lie in [0, max_len). Free for an int offset; with index tensors
        the op posenc::rope_position_bounds reads them back (a sync on CUDA) in eager mode,
        only when check_positions is set (CUDA). Under torch.compile and torch.export the op
        posenc::rope_position_extremes keeps the bounds on the device and
        torch._assert_async refuses the call (a RuntimeError; a device-side assert on CUDA),
        with no host sync; torch.jit.trace keeps neither (the kernels' own checks remain).
        Returns the longest position when it was read from tensors (so "dynamic" need not
        read it again), not under vmap (each sample's own is read by the op)."""
        if q.dim() != (3 if self.layout == "thd" else 4):
            return  # the rope op raises for a wrong rank, with its own message
        offsets = offset if isinstance(offset, Tensor) else None
        if offsets is None and (isinstance(offset, bool) or not isinstance(offset, (int, torch.SymInt))):
            return  # apply_rope raises a TypeError naming offset
        if offsets is None:
            _in_int64("RotaryPositionalEncoding", "offset", offset)  # before offset + seq overflows int64
        if positions is None and offsets is None and cu_seqlens is None:
            # Positions offset .. offset + seq - 1: no tensor to read, traceable.
            b, s, _ = LAYOUT_AXES[self.layout]
            shape = _static_shape(q)
            batch, seq = (1 if b is None else shape[b]), shape[s]  # the op's rule: no token, no bound
            lo, hi = (offset, offset + seq - 1) if batch > 0 and seq > 0 else (0, -1)
            if hi >= lo and (lo < 0 or hi >= self.max_len):
                # The one IndexError (hi may lie past int64: the op takes the run's length).
                torch.ops.posenc.position_run_check(offset, seq, self.max_len)
            return None
        tensors = [t for t in (positions, offsets, cu_seqlens) if isinstance(t, Tensor)]
        # torch.jit.trace records neither an op that returns ints nor an assert (its graph
        # drops ops whose results are unused): a traced module keeps the kernels' checks.
        if (torch.jit.is_tracing() or (any(t.is_cuda for t in tensors) and not self.check_positions)
                or q.is_meta or any(t.is_meta for t in tensors)):
            return None  # traced, unchecked, or shapes only (meta)
        arguments = dict(
            positions=positions, offsets=offsets, offset=0 if offsets is not None else offset,
            cu_seqlens=cu_seqlens, rotary_dim=self.rotary_dim, layout=self.layout,
            sections=list(self.rope_config.sections), sections_mode=self.sections_mode,
        )
        if torch.compiler.is_compiling():
            # Bounds read to the host would break the graph (and sync): they stay a
            # tensor, and the call is refused on the device.
            lo, hi = torch.ops.posenc.rope_position_extremes(q, **arguments).unbind()
            torch._assert_async(
                (hi < lo) | ((lo >= 0) & (hi < self.max_len)),
                f"RotaryPositionalEncoding: expected positions in [0, max_len={self.max_len}) (a compiled or "
                f"exported module checks them on the device), got a position outside it, or index tensors "
                f"the op refuses (an offset or position beyond 2**53, cu_seqlens not from 0 to the number of "
                f"tokens)",
            )
            return None
        lo, hi = torch.ops.posenc.rope_position_bounds(q, **arguments)
        if hi >= lo and (lo < 0 or hi >= self.max_len):
            torch.ops.posenc.position_range_check(lo, hi, self.max_len)  # raises the one IndexError
        if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            # Under vmap the bounds are those of all samples together (the op's batch rule):
            # the range holds for each sample, but its longest position is its own, which the
            # op reads per sample ("dynamic" and "longrope" took every sample's frequencies
            # from the batch's longest: an audit).
            return None
        return hi

    def __prepare_scriptable__(self) -> nn.Module:
        """Its forward returns q alone or (q, k) depending on its arguments, a type
        TorchScript cannot give a caller: say what works instead."""
        raise RuntimeError(
            f"posenc: {type(self).__name__} cannot be compiled by torch.jit.script (its forward returns q "
            "or (q, k) depending on whether k is given, which TorchScript cannot type). Export the model "
            "instead: torch.jit.trace(model, example_inputs) for TorchScript, or torch.export.export + "
            "torch._inductor.aoti_compile_and_package for AOTInductor (docs/deploy.md); or call "
            "torch.ops.posenc.rope from scripted code"
        )

    def extra_repr(self) -> str:
        extra = f"dim={self.dim}, max_len={self.max_len}, base={self.base}, interleaved={self.interleaved}"
        if self.rotary_dim != self.dim:
            extra += f", rotary_dim={self.rotary_dim}"
        if self.scaling is not None:
            extra += f", scaling={self._scaling}"
        if self.sections is not None:
            extra += f", sections={list(self.sections)}, sections_mode={self.sections_mode!r}"
        return extra + f", layout={self.layout!r}"


def heads_batch_rule(op: Any, folded: Tuple[str, ...], heads_axis: Any, foldable: Any = None) -> Any:
    """A vmap rule for an op that treats every head of ``folded`` (q, k) alike: the vmapped
    dimension joins the heads, so a batch of samples (per-sample gradients: vmap(grad(...)),
    jacrev, hessian) is one fused call rather than one call per sample. Any other batched
    tensor (positions, tables, weights), or ``foldable(arguments)`` false, makes the samples
    differ beyond their heads: one call each. ``heads_axis(arguments)``: the heads dim of
    q and k. Outputs: one per folded input, in order (an empty tensor for an absent one)."""
    schema = op._schema.arguments
    names = [a.name for a in schema]
    defaults = [a.default_value for a in schema]

    def rule(info: Any, in_dims: Tuple[Optional[int], ...], *args: Any, **kwargs: Any) -> Any:
        # The dispatcher passes the arguments up to the last one not at its default.
        n = len(args)
        args = tuple(args) + tuple(kwargs.get(name, d) for name, d in zip(names[n:], defaults[n:]))
        # A list argument (float[] scaling, int[] sections) comes with a list of Nones.
        in_dims = tuple(d if isinstance(d, int) else None for d in in_dims) + (None,) * (len(args) - n)
        a = dict(zip(names, args))
        dims = dict(zip(names, in_dims))
        size = info.batch_size
        others = [name for name, d in dims.items() if d is not None and name not in folded]
        if others or (foldable is not None and not foldable(a)):
            if size == 0:  # no sample to call the op on: one of zeros gives the shapes
                sample = [x.new_zeros(x.shape[:d] + x.shape[d + 1:]) if d is not None else x
                          for x, d in zip(args, in_dims)]
                outs = [op(*sample)]
            else:
                outs = [op(*[x.select(d, i) if d is not None else x for x, d in zip(args, in_dims)])
                        for i in range(size)]
            results, out_dims = [], []
            for j, name in enumerate(folded):
                present = a[name] is not None
                stacked = (torch.stack([o[j] for o in outs]) if size > 0
                           else outs[0][j].new_empty((0, *outs[0][j].shape)))
                results.append(stacked if present else outs[0][j])
                out_dims.append(0 if present else None)
            return tuple(results), tuple(out_dims)
        heads = heads_axis(a)

        def fold(x: Tensor, d: Optional[int]) -> Tensor:  # (..., size * heads, ...), sample-major
            x = x.movedim(d, heads) if d is not None else x.unsqueeze(heads).expand(
                *x.shape[:heads], size, *x.shape[heads:])
            return x.flatten(heads, heads + 1)

        call = list(args)
        for name in folded:
            if a[name] is not None:
                call[names.index(name)] = fold(a[name], dims[name])
        outs = op(*call)
        results, out_dims = [], []
        for j, name in enumerate(folded):
            if a[name] is None:
                results.append(outs[j])
                out_dims.append(None)
            else:
                # (size, heads): -1 cannot be inferred from an empty output (a batch of 0).
                x, d = a[name], dims[name]
                sample_heads = (x.shape[:d] + x.shape[d + 1:] if d is not None else x.shape)[heads]
                results.append(outs[j].unflatten(heads, (size, sample_heads)).movedim(heads, 0))
                out_dims.append(0)
        return tuple(results), tuple(out_dims)

    return rule


# posenc::rope: the heads dim of the layout (every layout's, "thd" included).
torch.library.register_vmap("posenc::rope", heads_batch_rule(
    torch.ops.posenc.rope.default, ("q", "k"), lambda a: LAYOUT_AXES[a["layout"]][2]))


def bounds_batch_rule(op: Any) -> Any:
    """vmap rule of an op returning the (smallest, largest) position of its tensors (the
    modules' eager range checks: rope_position_bounds, position_bounds): the op on each
    vmapped slice, the extremes over those with tokens ((0, -1) when none has any)."""

    def rule(info: Any, in_dims: Tuple[Optional[int], ...], *args: Any, **kwargs: Any) -> Any:
        found = []
        for i in range(info.batch_size):
            sliced = [a.select(d, i) if isinstance(a, Tensor) and isinstance(d, int) else a
                      for a, d in zip(args, in_dims)]
            lo, hi = op(*sliced, **kwargs)
            if hi >= lo:
                found.append((lo, hi))
        lo, hi = (min(f[0] for f in found), max(f[1] for f in found)) if found else (0, -1)
        return (lo, hi), (None, None)

    return rule


for _name in ("rope_position_bounds", "position_bounds"):
    torch.library.register_vmap(f"posenc::{_name}", bounds_batch_rule(getattr(torch.ops.posenc, _name).default))


def _extremes_batch_rule(info: Any, in_dims: Tuple[Optional[int], ...], *args: Any, **kwargs: Any) -> Any:
    """vmap rule of posenc::rope_position_extremes: the op on each vmapped slice, the
    smallest low and the largest high, unbatched (as bounds_batch_rule: the module's assert,
    which has no batching rule, checks every sample at once). A slice without tokens is
    (int64 max, int64 min), so it drops out; an invalid one (int64 min, int64 max) wins."""
    op = torch.ops.posenc.rope_position_extremes.default
    parts = [op(*[a.select(d, i) if isinstance(a, Tensor) and isinstance(d, int) else a
                  for a, d in zip(args, in_dims)], **kwargs) for i in range(info.batch_size)]
    if not parts:
        info64 = torch.iinfo(torch.int64)
        return args[0].new_tensor([info64.max, info64.min], dtype=torch.int64), None
    stacked = torch.stack(parts)
    return torch.stack([stacked[:, 0].min(), stacked[:, 1].max()]), None


torch.library.register_vmap("posenc::rope_position_extremes", _extremes_batch_rule)
