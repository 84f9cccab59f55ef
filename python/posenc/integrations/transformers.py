"""Hugging Face transformers: one call routes a model's RoPE through posenc.

    from posenc.integrations.transformers import apply_posenc_rope

    apply_posenc_rope(model)  # or apply_posenc_rope("llama") before loading

replaces the ``apply_rotary_pos_emb`` function of the model's modeling module
(``transformers.models.<type>.modeling_<type>``; ``_MODULES`` names the types that share
another's) with one that calls
:func:`posenc.functional.apply_rope_cos_sin` on the cos/sin tables the model computed, as
Liger-Kernel's ``apply_liger_kernel_to_llama(rope=True)`` does. The patch is per model type,
not per instance: every model of that type in the process uses it until
:func:`revert_posenc_rope`. :func:`posenc_rope` is the same as a context manager. With the
``kernels`` package (which transformers 5.25 requires), transformers' function is an
``nn.Module`` (``use_kernel_forward_from_hub``): the patch sets posenc's function as that
module's own ``forward``, so the call stays a module call (module hooks fire; the kernels
package still finds the module's class by name; compiled code sees the change and
recompiles), and revert puts its forward back; while patched, the module does not hand the
call on to each layer's private copy (``attn._kernel_funcs``): hooks on a copy do not fire.

Supported model types: see ``SUPPORTED_MODEL_TYPES`` (``_PATCHES``). Llama and the types that
carry its rotation share transformers' ``apply_rotary_pos_emb(q, k, cos, sin,
unsqueeze_dim=1)`` (halves convention, tables as wide as the head); GPT-NeoX's has the same
signature and also turns the leading features of a head with narrower tables (its partial
rotary), each with its replacement, which refuses (ValueError) tables of other shapes
(where transformers' broadcast raises, or pairs a 2-D table's rows with q's heads); GPT-J has its own
``apply_rotary_pos_emb(tensor, sin, cos)`` over adjacent pairs (``rotate_every_two``), routed
with ``interleaved=True``. DeepSeek V3 (MLA) also has ``apply_rotary_pos_emb_interleave``
(adjacent pairs of the rotary part, returned de-interleaved), DeepSeek V4 a single-tensor
``apply_rotary_pos_emb(x, cos, sin)`` on the trailing rope slice (called with ``-sin`` to turn the
attention output back): each has its replacement. Other model types raise ValueError rather
than being patched with a function whose convention was not checked.

``apply_posenc_rope(model, qk_norm=True)`` (Qwen3, Qwen3-MoE, Gemma 3, OLMo 2) is per
instance instead: each attention layer of ``model`` runs its q_norm / k_norm and RoPE as one
:func:`posenc.functional.qk_norm_rope`, until :func:`revert_posenc_qk_norm`. How: the layer's
class becomes a posenc subclass of its own class (``attn.__class__ = ...``; one subclass per
attention class, created once and kept), whose ``forward`` is transformers 5's attention
forward for these models with the norm + rotation step replaced. Everything that step needs
comes from the layer itself and from the call's own arguments: with ``position_ids`` (which
the decoder layers pass: the positions the model computed ``position_embeddings`` from), the
fused op at those positions with the config's RoPE parameters, when they are the ones the
model's rotary module turns by (checked when the layer is patched: ``_fused_settings``);
without them (a layer called on its own, any caller that passes only
``position_embeddings``), for RoPE types whose transformers tables depend on the call
("dynamic", "longrope"), or when the rotary module's frequencies are not (or no longer)
posenc's (a bfloat16 cast, an edited buffer), or while a norm or the rotary module is hooked,
replaced or given another ``forward`` (a hook would miss its call; another module or forward
computes something else), the layer's own norms and
then :func:`posenc.functional.apply_rope_cos_sin` on the given (cos, sin), so every call path
computes what the unpatched layer computes (compiled code, which cannot see a buffer edited in
place, raises instead: docs/integrations.md); no ``position_embeddings`` is a ValueError naming
it. With the ``kernels`` package (its rotation a module), a call that does not fuse runs the
class's own forward instead, whose rotation kernels routes through module calls a hook sees.
With a ``transformers.StaticCache`` (``generate(..., cache_implementation="static")``), a
fused layer whose cache layer is a plain ``StaticLayer`` also writes its keys and values there
in the same call, :func:`posenc.functional.rope_append_kv` with ``q_weight`` / ``k_weight``, at
the rows the layer's ``update`` would (its ``cumulative_length`` onwards, read on the device:
no sync), and attends over the layer's keys and values as ``update`` returns them; other
caches and layers (DynamicCache, sliding-window or quantized layers, offloading) and calls
that record gradients go through the cache's ``update``. Nothing is stored between calls and
no module-level function is replaced, so threads, exceptions and revert (which restores the
class) cannot carry one call's state into another, and the per-type patch above works
independently of it. The weights, hooks and state_dict stay where they are (a norm's hooks
fire: a hooked norm is called); copies and pickles keep the patch.

Extension point: the class swap, per instance. transformers 5's ``register_patch_mapping``
(transformers.monkey_patching) also replaces classes, but through a process-wide registry
applied when a model is created (``from_pretrained`` / ``from_config`` / ``apply_patches``):
it cannot patch a model already loaded, and it would patch every later model of that class,
not the one given. Its attention-interface registry (``AttentionInterface.register``) is
called after the norms and the rotation, too late to fuse them; and the kernels-hub hook on
these classes (``use_kernelized_func(apply_rotary_pos_emb)``, active when the ``kernels``
package is installed before transformers is imported) replaces the rotation only, not the
norms, and routes each instance's call through a context variable that kernels (0.19)
turns into a module-level global under torch.compile (its ``CompileableContextVar``):
process-wide state of its own. (That hook is also why the plain ``apply_posenc_rope(model)``
stays per model type: transformers' attention forwards call their modeling module's
``apply_rotary_pos_emb`` by name, and no other per-instance hook reaches that call.) The subclass keeps the
class's name and passes ``isinstance`` checks (output recording, ``_can_record_outputs``).
Before patching, each attention class's forward is checked against what the rewrite assumes
(its parameters, and that it uses q_norm, k_norm, apply_rotary_pos_emb, the cache's update
and the attention interface): a transformers whose forward differs is a RuntimeError.

Importing this module imports transformers (ImportError with the pip command when it is
missing); ``import posenc`` does not.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import copyreg
import importlib
import inspect
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError(
        "posenc.integrations.transformers needs Hugging Face transformers, which is not installed: "
        "pip install transformers"
    ) from error

import transformers.cache_utils

import posenc.functional
from posenc._common import _own_hooks, _runs_as_written, _written_forward
from posenc._rope import LENGTH_SCALED_TYPES, ROPE_TYPES, RopeConfig, unread_scaling_key

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "apply_posenc_rope",
    "apply_posenc_rope_to",
    "is_patched",
    "posenc_rope",
    "posenc_apply_rotary_pos_emb",
    "posenc_deepseek_apply_rotary_pos_emb_interleave",
    "posenc_deepseek_v4_apply_rotary_pos_emb",
    "posenc_gpt_neox_apply_rotary_pos_emb",
    "posenc_gptj_apply_rotary_pos_emb",
    "revert_posenc_rope",
    "revert_posenc_qk_norm",
    "QK_NORM_MODEL_TYPES",
]


def _promoted(x: Optional[Tensor], *others: Tensor) -> Optional[Tensor]:
    """x in the dtype transformers' arithmetic gives it: its rotation ``x * cos +
    rotate_half(x) * sin`` (and a norm's ``weight * x``) is in torch's promotion of the
    operands' dtypes (float32 for bfloat16 q and k under autocast, whose rotary tables and
    norm weights stay float32), where posenc's ops return x's own dtype: x is cast first, as
    the peer's arithmetic casts it. Without autocast the model casts its tables to x's dtype:
    x as it is."""
    if x is None:
        return None
    dtype = _promoted_dtype(x, *others)
    return x if dtype == x.dtype else x.to(dtype)


def _promoted_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for other in tensors[1:]:
        dtype = torch.promote_types(dtype, other.dtype)
    return dtype


def posenc_apply_rotary_pos_emb(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Optional[Tensor] = None,
    unsqueeze_dim: int = 1,
) -> Tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (Llama family) through posenc.

    q, k: (batch, heads, seq, head_dim) with ``unsqueeze_dim=1`` (transformers' layout) or
    (batch, seq, heads, head_dim) with ``unsqueeze_dim=2``; cos, sin: (batch or 1, seq,
    head_dim), as the model's rotary module returns them. Other table shapes raise
    ValueError: Llama's function broadcasts ``cos.unsqueeze(unsqueeze_dim)`` against q, which
    raises for tables narrower than the head (transformers' partial rotary is GPT-NeoX's:
    :func:`posenc_gpt_neox_apply_rotary_pos_emb`) and pairs the dimensions of other shapes
    differently from the tokens. ``position_ids`` is ignored, as in transformers 4.4x (the
    tables are already per position); transformers 5's signature has no ``position_ids``, so
    an int in that place is taken as ``unsqueeze_dim``.
    """
    return _rotate_llama_style(q, k, cos, sin, position_ids, unsqueeze_dim, "apply_rotary_pos_emb", partial=False)


def posenc_gpt_neox_apply_rotary_pos_emb(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Optional[Tensor] = None,
    unsqueeze_dim: int = 1,
) -> Tuple[Tensor, Tensor]:
    """GPT-NeoX's ``apply_rotary_pos_emb`` through posenc: as
    :func:`posenc_apply_rotary_pos_emb`, with tables (batch or 1, seq, rotary_dim) that may be
    narrower than the head (``partial_rotary_factor``): the leading rotary_dim features of each
    head turn, the rest pass through."""
    return _rotate_llama_style(q, k, cos, sin, position_ids, unsqueeze_dim, "GPT-NeoX apply_rotary_pos_emb",
                               partial=True)


def _rotate_llama_style(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Any, unsqueeze_dim: Any,
                        fn: str, partial: bool) -> Tuple[Tensor, Tensor]:
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim = position_ids
    # True == 1 and 1.0 == 1 would be taken for the int.
    layout = None if isinstance(unsqueeze_dim, (bool, float)) else {1: "bhsd", 2: "bshd"}.get(unsqueeze_dim)
    if layout is None:
        raise ValueError(f"posenc {fn}: expected unsqueeze_dim 1 (q, k as (batch, heads, seq, "
                         f"head_dim)) or 2 ((batch, seq, heads, head_dim)), got {unsqueeze_dim!r}")
    # The tables transformers' rotary modules give, which its broadcast pairs with q's batch
    # rows and tokens as posenc does; any other shape it pairs otherwise (a 2-D table's rows
    # with q's heads) or refuses (a narrower table, but for GPT-NeoX's partial rotary).
    if q.dim() == 4 and cos.dim() == 3 and tuple(sin.shape) == tuple(cos.shape):
        batch, seq, head_dim = q.shape[0], q.shape[2 if layout == "bhsd" else 1], q.shape[3]
        rotary = cos.shape[2]
        if (cos.shape[0] in (1, batch) and cos.shape[1] == seq
                and (rotary == head_dim or (partial and 0 < rotary < head_dim))):
            return posenc.functional.apply_rope_cos_sin(_promoted(q, cos, sin), _promoted(k, cos, sin), cos, sin,
                                                        layout=layout)
    want = "rotary_dim <= head_dim" if partial else "head_dim"
    raise ValueError(f"posenc {fn}: expected cos and sin of shape (1 or batch, seq, {want}) for q of shape "
                     f"{tuple(q.shape)} with unsqueeze_dim={unsqueeze_dim} (as transformers' rotary module "
                     f"returns them), got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")


def posenc_gptj_apply_rotary_pos_emb(tensor: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    """GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)`` through posenc: tensor (batch, seq,
    heads, rotary_dim), sin/cos (batch, seq, rotary_dim / 2) of its sincos table; adjacent
    pairs (``rotate_every_two``)."""
    cos = torch.repeat_interleave(cos, 2, dim=-1)
    sin = torch.repeat_interleave(sin, 2, dim=-1)
    return posenc.functional.apply_rope_cos_sin(_promoted(tensor, cos, sin), None, cos, sin, layout="bshd",
                                                interleaved=True)


def _layout(unsqueeze_dim: int, fn: str) -> str:
    if unsqueeze_dim == 1:
        return "bhsd"
    if unsqueeze_dim == 2:
        return "bshd"
    raise ValueError(f"posenc {fn}: expected unsqueeze_dim 1 (tensors as (batch, heads, seq, head_dim)) or 2 "
                     f"((batch, seq, heads, head_dim)), got {unsqueeze_dim!r}")


def posenc_deepseek_apply_rotary_pos_emb_interleave(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None, unsqueeze_dim: int = 1,
) -> Tuple[Tensor, Tensor]:
    """DeepSeek V3's ``apply_rotary_pos_emb_interleave`` through posenc: adjacent pairs
    ``(2i, 2i+1)`` turned by pair i's angle (the tables are transformers' ``cat(freqs,
    freqs)``), returned as transformers lays them out, the pairs' first elements then their
    second ones (``cat([x1', x2'])``)."""
    layout = _layout(unsqueeze_dim, "apply_rotary_pos_emb_interleave")
    half = cos.shape[-1] // 2
    cos2, sin2 = (t[..., :half].repeat_interleave(2, dim=-1) for t in (cos, sin))
    q, k = posenc.functional.apply_rope_cos_sin(_promoted(q, cos, sin), _promoted(k, cos, sin), cos2, sin2,
                                                layout=layout, interleaved=True)
    return (torch.cat([q[..., 0::2], q[..., 1::2]], dim=-1), torch.cat([k[..., 0::2], k[..., 1::2]], dim=-1))


def posenc_deepseek_v4_apply_rotary_pos_emb(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """DeepSeek V4's ``apply_rotary_pos_emb(x, cos, sin)`` through posenc: the trailing
    ``2 * cos.shape[-1]`` features of each head (``[nope | rope]``) turned in adjacent pairs,
    one table entry per pair. V4 also calls it with ``-sin`` to turn its attention output back
    (the inverse rotation): the same call."""
    layout = _layout(unsqueeze_dim, "apply_rotary_pos_emb")
    rope_dim = 2 * cos.shape[-1]
    cos2, sin2 = (t.repeat_interleave(2, dim=-1) for t in (cos, sin))
    # In x's dtype, as transformers' V4 rotation casts back (`.to(x.dtype)`): no promotion.
    rotated = posenc.functional.apply_rope_cos_sin(x[..., -rope_dim:], None, cos2, sin2, layout=layout,
                                                   interleaved=True)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)


# model_type -> the functions of its modeling module that posenc replaces: (name, the
# replacement, the parameter names transformers' function must start with).
_LLAMA_STYLE = ("apply_rotary_pos_emb", posenc_apply_rotary_pos_emb, ("q", "k", "cos", "sin"))
_PATCHES: Dict[str, Tuple[Tuple[str, Callable, Tuple[str, ...]], ...]] = {
    "llama": (_LLAMA_STYLE,),
    "mistral": (_LLAMA_STYLE,),
    "qwen2": (_LLAMA_STYLE,),
    "qwen3": (_LLAMA_STYLE,),
    "gemma": (_LLAMA_STYLE,),
    # Llama's apply_rotary_pos_emb and rotate_half verbatim in their modeling modules
    # (transformers 5.25; Phi rotates the leading partial_rotary_factor of each head, slicing
    # before the call), each checked against the unpatched model by the tests.
    "mixtral": (_LLAMA_STYLE,),
    "qwen2_moe": (_LLAMA_STYLE,),
    "qwen3_moe": (_LLAMA_STYLE,),
    "gemma2": (_LLAMA_STYLE,),
    # Gemma 3: Gemma3ForConditionalGeneration ("gemma3") and its text model alone,
    # Gemma3ForCausalLM ("gemma3_text"), share one modeling module (_MODULES): patching either
    # type patches both.
    "gemma3": (_LLAMA_STYLE,),
    "gemma3_text": (_LLAMA_STYLE,),
    "granite": (_LLAMA_STYLE,),
    "phi": (_LLAMA_STYLE,),
    "starcoder2": (_LLAMA_STYLE,),
    "olmoe": (_LLAMA_STYLE,),
    "smollm3": (_LLAMA_STYLE,),
    # GPT-NeoX's own function: tables narrower than the head (partial_rotary_factor) turn the
    # leading features.
    "gpt_neox": (("apply_rotary_pos_emb", posenc_gpt_neox_apply_rotary_pos_emb, ("q", "k", "cos", "sin")),),
    "gptj": (("apply_rotary_pos_emb", posenc_gptj_apply_rotary_pos_emb, ("tensor", "sin", "cos")),),
    # MLA: the rotary part q_rot / k_rot of each head; rope_interleave (the default) takes the
    # second function.
    "deepseek_v3": (_LLAMA_STYLE, ("apply_rotary_pos_emb_interleave", posenc_deepseek_apply_rotary_pos_emb_interleave,
                                   ("q", "k", "cos", "sin"))),
    "deepseek_v4": (("apply_rotary_pos_emb", posenc_deepseek_v4_apply_rotary_pos_emb, ("x", "cos", "sin")),),
}
SUPPORTED_MODEL_TYPES: Tuple[str, ...] = tuple(_PATCHES)
# The model types whose modeling module is another type's (transformers.models.<that>.modeling_<that>).
_MODULES: Dict[str, str] = {"gemma3_text": "gemma3"}

# (modeling module name, function name) -> what the patch replaced there (_Original), while patched.
_ORIGINALS: Dict[Tuple[str, str], "_Original"] = {}
_ORIGINALS_LOCK = threading.Lock()  # patch and revert from several threads: one at a time


def _model_type(model_or_type: Any) -> str:
    """The transformers model_type of a model, a config, or a model-type string."""
    if isinstance(model_or_type, str):
        return model_or_type
    config = getattr(model_or_type, "config", model_or_type)
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type:
        return model_type
    module = type(model_or_type).__module__  # transformers.models.<type>.modeling_<type>
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[3] == f"modeling_{parts[2]}":
        return parts[2]
    raise TypeError(f"apply_posenc_rope: expected a transformers model, config or model-type string, got "
                    f"{type(model_or_type).__name__} (module {module})")


def _modeling_module(model_type: str):
    if model_type not in _PATCHES:
        raise ValueError(f"apply_posenc_rope: model type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    package = _MODULES.get(model_type, model_type)
    return importlib.import_module(f"transformers.models.{package}.modeling_{package}")


def apply_posenc_rope_to(model_type: str) -> None:
    """Patch the modeling module of ``model_type`` (e.g. "llama", "gptj"): its
    ``apply_rotary_pos_emb`` (DeepSeek V3: also ``apply_rotary_pos_emb_interleave``) becomes
    posenc's. Patching twice is a no-op. Raises ValueError for unsupported types, RuntimeError
    if the installed transformers' function does not have the signature the replacement was
    written for (nothing is patched then)."""
    module = _modeling_module(model_type)
    with _ORIGINALS_LOCK:
        _patch(module, model_type)


def _runs(function: Any) -> Any:
    """What a call of a modeling module's rotation function runs: the function itself, or, where
    the ``kernels`` package (which transformers 5.25 installs) made it a module
    (``use_kernel_forward_from_hub``: an ``nn.Module`` whose forward calls the function), that
    module's forward (posenc's replacement once patched)."""
    if isinstance(function, torch.nn.Module):
        return function.__dict__.get("forward", function.forward)
    return function


_NO_FORWARD = object()  # a kernels module without a forward of its own (its class's runs)


@dataclasses.dataclass(frozen=True)
class _Original:
    """What a patch replaced, and how revert puts it back: transformers' function, set back on
    its modeling module; or the kernels package's module (``function``), which stays in place
    while its own ``forward`` is posenc's, with the forward it had of its own before
    (``_NO_FORWARD``: none, its class's ran)."""

    module_name: str
    name: str
    function: Any
    forward: Any = _NO_FORWARD

    def restore(self) -> None:
        if isinstance(self.function, torch.nn.Module):
            if self.forward is _NO_FORWARD:
                self.function.__dict__.pop("forward", None)
            else:
                self.function.forward = self.forward
        else:
            setattr(importlib.import_module(self.module_name), self.name, self.function)


def _patch(module: Any, model_type: str) -> None:
    todo = []
    for name, replacement, expected in _PATCHES[model_type]:
        current = getattr(module, name, None)
        if current is None:
            raise RuntimeError(f"apply_posenc_rope: {module.__name__} has no {name} to patch "
                               f"(transformers {transformers.__version__})")
        if _runs(current) is replacement:
            continue
        names = tuple(inspect.signature(_runs(current)).parameters)[: len(expected)]
        if names != expected:
            raise RuntimeError(f"apply_posenc_rope: {module.__name__}.{name} takes {names}, not {expected} as the "
                               f"posenc replacement expects (transformers {transformers.__version__})")
        todo.append((name, replacement, current))
    for name, replacement, current in todo:
        if isinstance(current, torch.nn.Module):
            # The kernels package's module (transformers 5.25 requires kernels): its own forward
            # becomes posenc's, the module stays in place. The call stays a module call (module
            # hooks fire), kernels finds the module's class where it looks it up by name
            # (unpickling a model), and compiled code recompiles: dynamo guards the forward
            # in that module's __dict__ (reached through kernels' wrapper of the attention's
            # forward), not the modeling module's name, so a copy put there was not seen by
            # code compiled before the patch.
            _ORIGINALS[(module.__name__, name)] = _Original(module.__name__, name, current,
                                                            current.__dict__.get("forward", _NO_FORWARD))
            current.forward = replacement
        else:
            _ORIGINALS[(module.__name__, name)] = _Original(module.__name__, name, current)
            setattr(module, name, replacement)


def apply_posenc_rope(model: Any, qk_norm: bool = False) -> Any:
    """Route a transformers model's RoPE through posenc; returns ``model``.

    ``model``: a loaded model (its ``config.model_type``, or the modeling module of its class),
    a config, or a model-type string. Patches the model type's modeling module (see the module
    docstring): every model of that type uses posenc's rotation until :func:`revert_posenc_rope`.

    ``qk_norm=True`` (a loaded model of a type in ``QK_NORM_MODEL_TYPES``): each attention
    layer's q_norm / k_norm and RoPE run as one fused
    :func:`posenc.functional.qk_norm_rope` at the positions the layer receives
    (``position_ids``) with the config's RoPE parameters (when the model's rotary module
    turns by them: checked against its ``inv_freq`` when patched); a call without them runs the
    layer's norms, then posenc's rotation with the given tables (the module docstring has
    the rules). With a ``transformers.StaticCache``, the fused call also writes the layer's
    cache rows (:func:`posenc.functional.rope_append_kv`). The weights stay where they are
    (``q_norm.weight``, ``k_norm.weight``). Per instance (the model type's modeling module is
    not touched), until :func:`revert_posenc_qk_norm`; patching twice is a no-op.
    """
    if qk_norm:
        _apply_qk_norm(model)
        return model
    apply_posenc_rope_to(_model_type(model))
    return model


# ---- qk_norm=True: the norms and RoPE of each attention layer fused.
#
# Each patched attention instance gets a posenc subclass of its own class as its class
# (``attn.__class__``); that subclass's forward is the model's attention forward with the
# q_norm / k_norm + RoPE step replaced, and everything it needs comes from the instance and
# from the call's own arguments. No module-level function is replaced and nothing is stored
# between calls, so threads, exceptions and revert cannot leak one call into another.

# model_type -> (norm, weight_offset): the attention's q_norm / k_norm convention.
_QK_NORM_TYPES: Dict[str, Tuple[str, float]] = {
    "qwen3": ("head", 0.0),
    "qwen3_moe": ("head", 0.0),
    "gemma3_text": ("head", 1.0),
    "gemma3": ("head", 1.0),
    "olmo2": ("hidden", 0.0),
}
QK_NORM_MODEL_TYPES: Tuple[str, ...] = tuple(_QK_NORM_TYPES)
# The modeling modules whose apply_rotary_pos_emb returns q's and k's own dtype (OLMo 2:
# `q_embed.to(q_type)`); the others' rotation promotes with the tables' dtype (_promoted).
_ROTATION_KEEPS_DTYPE = frozenset({"transformers.models.olmo2.modeling_olmo2"})

# What the rewritten forward assumes of transformers' attention forward (transformers 5.x):
# its leading parameters, and the attributes and functions it uses. Checked once per class.
_ATTENTION_PARAMETERS = ("self", "hidden_states", "position_embeddings", "attention_mask", "cache")
_ATTENTION_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "apply_rotary_pos_emb",
                              "update", "get_interface", "scaling", "layer_idx", "head_dim"})

# (attention class, norm, weight_offset) -> its posenc subclass. Written once per key under
# the lock and never changed: memoisation, not state a call depends on.
_QK_NORM_CLASSES: Dict[Tuple[type, str, float], type] = {}
_QK_NORM_CLASSES_LOCK = threading.Lock()


def _rope_parameters(attn: Any) -> Optional[dict]:
    config = attn.config
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and getattr(attn, "layer_type", None) in params:
        params = params[attn.layer_type]  # Gemma 3: one dict per layer type
    if params is None:  # transformers 4: rope_theta and rope_scaling on the config
        params = dict(getattr(config, "rope_scaling", None) or {"rope_type": "default"})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return dict(params)


def _norm_eps(norm: Any) -> Optional[float]:
    # Qwen3 / OLMo 2, Gemma 3; read from the instance first (every call reads it: a missing
    # attribute through nn.Module.__getattr__ costs microseconds).
    attributes = norm.__dict__
    if "variance_epsilon" in attributes:
        eps = attributes["variance_epsilon"]
    else:  # as before: variance_epsilon wherever it lives (a class attribute, a property), else eps
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _rotary_source(rotaries: list, attn: Any) -> Optional[Tuple[Any, str, str, Any, str]]:
    """(module, buffer name, attention scaling's attribute name, the module holding it, its
    name there) of the rotary embedding whose tables ``attn`` receives: of the model's modules
    with an inv_freq buffer (``rotaries``: (holder, name, module) triples), the one holding
    ``<layer_type>_inv_freq`` (transformers 5's per-layer-type rotary, Gemma 3), else the one
    holding ``inv_freq``. None when there is no such module or more than one (then the layer
    rotates with the tables it is given)."""
    layer_type = getattr(attn, "layer_type", None)
    names = ([(f"{layer_type}_inv_freq", f"{layer_type}_attention_scaling")] if isinstance(layer_type, str) else [])
    for buffer, scaling in names + [("inv_freq", "attention_scaling")]:
        found = {id(m): (m, holder, name) for holder, name, m in rotaries if isinstance(m._buffers.get(buffer), Tensor)}
        if len(found) == 1:
            module, holder, name = next(iter(found.values()))
            return module, buffer, scaling, holder, name
        if found:
            return None
    return None


class _HolderRef:
    """A weak reference to the module holding a layer's rotary module (_FusedSettings.holder):
    a strong one would make every patched layer keep its whole model alive (a reference cycle,
    freed only by the garbage collector) and copy it with the layer. A deepcopy of the model
    points at the copied holder; a pickle holds the holder itself (a model's pickle holds it
    anyway; a lone layer's pickle is the model's size, and once loaded, its holder gone, the
    layer runs its own path); a copy of a layer alone points at the original, whose rotary
    module is not the layer's copy: that layer runs its own path."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, module: Any) -> None:
        self._ref = weakref.ref(module) if module is not None else None

    def __call__(self) -> Any:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return _HolderRef, (self(),)

    def __deepcopy__(self, memo: dict) -> "_HolderRef":
        module = self()
        return _HolderRef(memo.get(id(module), module))


class _FusedSettings(NamedTuple):
    """What a fusable layer's calls check and use (_fused_settings). A layer pickled by an older
    posenc holds a plain tuple instead: it runs its own path (_fused_arguments)."""

    eps: float
    config: Any  # the parsed RopeConfig
    rotary: Any  # the rotary module whose tables the layer receives
    buffer: str  # its inv_freq buffer's name
    inv_freq: Tensor  # that buffer, as checked
    version: int  # its version then (eager calls compare it)
    checked: Tensor  # a copy of its values then (compiled calls compare them)
    scaling_name: str  # the rotary module's attention scaling attribute
    scaling: float  # and its value then
    norm_class: type  # the class of q_norm and k_norm
    # The module holding the rotary module and its attribute name there: a rotary module put in
    # its place after patching computes the tables the layer receives (None: pickled by an older
    # posenc, which did not look; such a layer runs its own path).
    holder: Optional[_HolderRef] = None
    attribute: str = ""
    # The forward functions the norms' class and the rotary module's class were written with
    # (_written_forward): a forward replaced since computes what the fused op does not (None:
    # pickled by an older posenc, which did not look; such a layer runs its own path).
    norm_forward: Any = None
    rotary_forward: Any = None

    # A copy (deepcopy, pickle, torch.save / torch.load) holds copied buffers whose version
    # counters start again: the version stored at patching would no longer see an edit made
    # before the copy (a copy fused with the checked frequencies, 0.23 off: an integration
    # audit). A copy's settings take its buffer's version where the buffer still holds the
    # checked values, and a version no buffer has (-1: the layer runs its own path) where not.
    def __deepcopy__(self, memo: dict) -> "_FusedSettings":
        return _rechecked_settings(*(copy.deepcopy(value, memo) for value in self))

    def __reduce__(self) -> Tuple[Any, tuple]:
        return _rechecked_settings, tuple(self)


def _rechecked_settings(*fields: Any) -> _FusedSettings:
    settings = _FusedSettings(*fields)
    inv_freq, checked = settings.inv_freq, settings.checked
    same = (isinstance(inv_freq, Tensor) and isinstance(checked, Tensor) and not inv_freq.is_meta
            and not checked.is_meta and inv_freq.dtype == checked.dtype and inv_freq.shape == checked.shape
            and torch.equal(inv_freq.detach().cpu(), checked.detach().cpu()))
    return settings._replace(version=inv_freq._version if same else -1)


def _fused_settings(attn: Any, source: Optional[Tuple[Any, str, str, Any, str]]) -> Optional[_FusedSettings]:
    """The settings (_FusedSettings) of a layer whose norms and RoPE the fused op provably
    computes as transformers does; computed once when the layer is patched. Provably: both norms
    are the model's own RMS norm (one class, defined beside the attention: a norm put in its
    place computes something else) and share one eps; the rotary module is the model's own class
    (defined there too); the model's tables depend on the positions
    and the config only (not "dynamic" or "longrope", whose transformers tables change with the
    call's length and the rotary module's history); and the rotary module's float32 ``inv_freq``
    and ``attention_scaling`` are the ones posenc computes from the parsed config (to 2**-17
    relative: transformers rounds float32 powers). That last check is what the config alone
    cannot tell: a model whose rotary ignores a key (Qwen3's default RoPE turns the whole
    head_dim whatever ``partial_rotary_factor`` says; a nested yarn dict's ``truncate`` read
    from the outer dict), a model cast to bfloat16 (its ``inv_freq`` rounded: transformers turns
    by the rounded frequencies), an edited buffer. A call is fused only while the module still
    holds that same buffer (``model.to(...)`` replaces it) at that version (in-place edits; read
    in eager mode: torch.compile cannot guard on versions: compiled code compares the buffer
    with a copy taken here and refuses an edit) and that attention scaling, while the model
    still holds that rotary module, unhooked, and both norms keep that eps. None otherwise: the
    layer then runs its own norms and rotates with the given (cos, sin). (An edit through
    ``.data`` moves no version, as autograd does not see it either: not followed.)"""
    eps = _norm_eps(attn.q_norm)
    norm_class = type(attn.q_norm)
    if (eps is None or eps != _norm_eps(attn.k_norm) or source is None or type(attn.k_norm) is not norm_class
            or norm_class.__module__ != attn._posenc_base.__module__):
        return None
    rotary, buffer, scaling_name, holder, attribute = source
    # The model's own rotary class (defined beside the attention, as the norms'): a subclass
    # or another class may compute other tables from the same buffer (a learnable temperature:
    # tables with a gradient of their own, which the fused op, turning by the buffer, would
    # drop; an audit).
    if type(rotary).__module__ != attn._posenc_base.__module__:
        return None
    # The forwards as the classes were written; whether a call runs them (and no hook) is
    # looked at per call (_fused_arguments), where a forward replaced before or after this runs
    # the layer's own path.
    norm_forward, rotary_forward = _written_forward(norm_class), _written_forward(type(rotary))
    inv_freq = rotary._buffers[buffer]
    scaling = getattr(rotary, scaling_name, None)
    if (inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or isinstance(scaling, bool)
            or not isinstance(scaling, (int, float))):
        return None
    params = _rope_parameters(attn)
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if "dynamic" in rope_type or rope_type in LENGTH_SCALED_TYPES:
        return None
    # The keys transformers fills from the config: the types' facts (RopeConfig.parse), and
    # yarn's factor for a dict's factor of None (transformers 5's _compute_yarn_parameters;
    # not a fact of the type: a dict without the key is refused by transformers, and by posenc).
    max_positions = getattr(attn.config, "max_position_embeddings", None)
    original = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and "factor" in params and params["factor"] is None and original and max_positions:
        params["factor"] = max_positions / original
    model_freq = inv_freq.detach().to("cpu", torch.float64)
    # Keys the type does not read dropped here, as transformers ignores them (the probe's parse
    # would warn, and a filter that raises warnings stopped the patching): the frequencies are
    # compared with the model's below.
    if rope_type in ROPE_TYPES:
        params = {k: v for k, v in params.items() if not unread_scaling_key(rope_type, k)}
    # The config as given, then without partial_rotary_factor (the rotary of Qwen3, OLMo 2
    # and Gemma 3 turns the whole head_dim whatever it says).
    candidates = [params]
    if "partial_rotary_factor" in params:
        candidates.append({k: v for k, v in params.items() if k != "partial_rotary_factor"})
    for candidate in candidates:
        try:
            config = RopeConfig.parse(head_dim=attn.head_dim, max_position_embeddings=max_positions,
                                      fn="qk_norm_rope", layout="bhsd", scaling=candidate)
            rotary_dim = attn.head_dim if config.rotary_dim == -1 else config.rotary_dim
            ours, factor = torch.ops.posenc.rope_frequencies(rotary_dim, config.base, config.rope_type,
                                                             list(config.scaling), 0, list(config.sections),
                                                             config.sections_mode)
        except (ValueError, TypeError, RuntimeError):
            continue
        if (ours.shape == model_freq.shape and torch.allclose(model_freq, ours, rtol=2.0**-17, atol=0.0)
                and abs(float(scaling) - factor) <= 2.0**-17 * abs(factor)):
            return _FusedSettings(eps, config, rotary, buffer, inv_freq, inv_freq._version,
                                  inv_freq.detach().clone(), scaling_name, scaling, norm_class, _HolderRef(holder),
                                  attribute, norm_forward, rotary_forward)
    return None


def _kernels_module_as_written(module: Any, guarded: bool = True) -> bool:
    """Whether a kernels rotation module (or a layer's private copy of it) runs its class's
    forward (kernelize may bind it on the instance) or posenc's, without hooks of its own.
    ``guarded``: ``module.forward`` is read first, so that torch.compile guards it (as
    _forward_as_written) and a forward set after compiling recompiles; not for the private
    copies, whose read sends dynamo into a recursion (a forward set on a private copy after
    compiling is not followed by compiled code)."""
    if not isinstance(module, torch.nn.Module):
        return True
    if _own_hooks(module):
        return False
    if guarded:
        module.forward  # noqa: B018 - read for torch.compile's guard on it
    forward = module.__dict__.get("forward")
    return (forward is None or forward is posenc_apply_rotary_pos_emb
            or getattr(forward, "__func__", None) is type(module).forward)


def _fused_arguments(attn: Any, rotation: Any, positions: Any, input_shape: torch.Size) -> Optional[dict]:
    """qk_norm_rope's keyword arguments when the layer is fusable (_fused_settings: its rotary
    module still holds the buffer that was checked, unchanged) and the call has position_ids
    for every token (the decoder layer passes the ones its model computed position_embeddings
    from); None otherwise."""
    settings = attn.__dict__.get("_posenc_fused")
    if not isinstance(settings, _FusedSettings):  # None, or a plain tuple pickled by an older posenc
        return None
    (eps, config, rotary, buffer, inv_freq, version, checked, scaling_name, scaling, norm_class, holder, attribute,
     norm_forward, rotary_forward) = settings
    # The norms the fused op computes: still the model's own class with the eps checked, its
    # forward as written, and no hook would miss their call (as PositionalEncoding calls a
    # hooked dropout child, or one whose forward was replaced).
    if any(type(n) is not norm_class or not _runs_as_written(n, norm_forward) or _norm_eps(n) != eps
           for n in (attn.q_norm, attn.k_norm)):
        return None
    # The tables the layer receives still come from the checked rotary module, as it computes
    # them: not one put in its place, no forward replaced, no hook changing its inputs or outputs.
    holder = holder() if isinstance(holder, _HolderRef) else None
    if holder is None or holder._modules.get(attribute) is not rotary or not _runs_as_written(rotary, rotary_forward):
        return None
    if rotary._buffers.get(buffer) is not inv_freq:  # replaced: model.to(dtype or device), reassigned
        return None
    if not torch.compiler.is_compiling() and inv_freq._version != version:  # edited in place
        return None
    if getattr(rotary, scaling_name, None) != scaling:  # reassigned (compiled code guards on it)
        return None
    # The modeling module's rotation, where the kernels package made it a module, and the
    # layer's private copies of it that kernels routes the call through: one whose call a hook
    # would see, or whose forward is neither its class's nor posenc's, runs.
    if isinstance(rotation, torch.nn.Module) and not (
            _kernels_module_as_written(rotation)
            and all(_kernels_module_as_written(f, False) for f in attn.__dict__.get("_kernel_funcs", {}).values())):
        return None
    if not isinstance(positions, Tensor) or positions.dtype != torch.int64:  # the op's dtype (int32 falls back)
        return None
    if positions.dim() not in (1, 2) or len(input_shape) != 2 or positions.shape[-1] != input_shape[1]:
        return None
    if positions.dim() == 2 and positions.shape[0] not in (1, input_shape[0]):
        return None
    if torch.compiler.is_compiling():
        # Compiled code can neither read the buffer's version nor leave the fused path on a
        # value without a host sync: a call that fuses refuses an in-place edit (a device-side
        # assert on CUDA, as torch's index checks) instead of turning by the checked frequencies.
        torch._assert_async((inv_freq == checked).all(),
                            f"posenc: the rotary module's {buffer} was edited in place after apply_posenc_rope("
                            "qk_norm=True), which compiled code cannot follow: replace the buffer instead, or "
                            "revert_posenc_qk_norm and patch again")
    return dict(eps=eps, positions=positions, config=config)


def _static_layer(attn: Any, cache: Any, tensors: Tuple[Tensor, ...]) -> Any:
    """The layer of a ``transformers.StaticCache`` whose rows the fused call writes through
    :func:`posenc.functional.rope_append_kv` (initialised as its ``update`` does), or None:
    another cache (DynamicCache, offloading) or layer kind (sliding window, quantized: their
    own ``update``), or autograd (rope_append_kv has none)."""
    if type(cache) is not getattr(transformers.cache_utils, "StaticCache", None) or getattr(cache, "offloading", False):
        return None
    layer = cache.layers[attn.layer_idx]
    if type(layer) is not getattr(transformers.cache_utils, "StaticLayer", None):  # exact: subclasses update otherwise
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if not layer.is_initialized:
        layer.lazy_initialization(tensors[1], tensors[2])  # k, v of the call: the shapes, dtype, device update uses
    return layer


class _PosencQKNormAttention:
    """Mixin placed before a transformers attention class (see _qk_norm_class): its forward
    is that class's forward (transformers 5) with the norms and RoPE through posenc."""

    _posenc_base: type
    _posenc_norm: str
    _posenc_weight_offset: float
    _posenc_eager: Callable
    _posenc_attention_functions: Any
    _posenc_sliding_window: bool
    _posenc_rotation_keeps_dtype: bool
    _posenc_modeling: Any  # the attention class's modeling module

    def forward(self, hidden_states: Tensor, position_embeddings: Optional[Tuple[Tensor, Tensor]] = None,
                attention_mask: Optional[Tensor] = None, cache: Any = None, **kwargs: Any):
        # The class's settings, read once: revert_posenc_qk_norm (in another thread) may give
        # the layer its own class back while this call runs; one reverted before it got here
        # runs the class's own forward.
        cls = type(self)
        if not issubclass(cls, _PosencQKNormAttention):
            return cls.forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        if "past_key_values" in kwargs:  # transformers 5's deprecated name of cache
            legacy = kwargs.pop("past_key_values")
            cache = legacy if cache is None else cache
        if position_embeddings is None:
            raise ValueError(f"{cls._posenc_base.__name__} patched by apply_posenc_rope(qk_norm=True): missing "
                             f"argument position_embeddings (the (cos, sin) tables of the model's rotary embedding); "
                             f"transformers' own forward needs it too")
        input_shape = hidden_states.shape[:-1]
        # The modeling module's rotation (read once a call): a function, or the kernels package's module.
        rotation = cls._posenc_modeling.apply_rotary_pos_emb
        fused = _fused_arguments(self, rotation, kwargs.get("position_ids"), input_shape)
        if isinstance(rotation, torch.nn.Module) and (
                fused is None or (torch.is_autocast_enabled(hidden_states.device.type)
                                  and not cls._posenc_rotation_keeps_dtype)):
            # The kernels package's module rotation (transformers 5.25 installs kernels): a call
            # that does not fuse (under autocast, the promotion below would stop it) runs the
            # class's own forward, which calls the rotation as kernels routes it (through the
            # instance's private copy: two module calls a hook sees).
            return cls._posenc_base.forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if (fused is not None and not cls._posenc_rotation_keeps_dtype
                and _promoted_dtype(query_states, self.q_norm.weight, self.k_norm.weight,
                                    *position_embeddings) != query_states.dtype):
            # transformers' norms and rotation promote (weights or tables in another dtype:
            # autocast): its numbers in its dtype are the unfused path's. (OLMo 2's cast back
            # to q's dtype, and its rotary returns float32 tables for any model dtype: it fuses.)
            fused = None
        layer = None
        if fused is not None:
            query_states = query_states.view(hidden_shape).transpose(1, 2)
            key_states = key_states.view(hidden_shape).transpose(1, 2)
            norm = dict(norm=cls._posenc_norm, weight_offset=cls._posenc_weight_offset, **fused)
            layer = _static_layer(self, cache, (query_states, key_states, value_states, self.q_norm.weight,
                                                self.k_norm.weight))
            if layer is not None:  # StaticLayer.update's rows (cumulative_length + s), written by the fused op
                query_states = posenc.functional.rope_append_kv(
                    query_states, key_states, value_states, layer.keys, layer.values,
                    offset=layer.cumulative_length.expand(input_shape[0]), q_weight=self.q_norm.weight,
                    k_weight=self.k_norm.weight, **norm)
                layer.cumulative_length.add_(input_shape[1])
                key_states, value_states = layer.keys, layer.values  # what update returns
            else:
                query_states, key_states = posenc.functional.qk_norm_rope(
                    query_states, key_states, self.q_norm.weight, self.k_norm.weight, **norm)
        else:  # the layer's own norms, then the given tables: transformers' numbers on every path
            if cls._posenc_norm == "hidden":  # OLMo 2: each token's whole projection
                query_states = self.q_norm(query_states).view(hidden_shape).transpose(1, 2)
                key_states = self.k_norm(key_states).view(hidden_shape).transpose(1, 2)
            else:
                query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
                key_states = self.k_norm(key_states.view(hidden_shape)).transpose(1, 2)
            cos, sin = position_embeddings
            if isinstance(rotation, torch.nn.Module):
                # The kernels package's module, where a fusable call's dtypes promote without
                # autocast (norm weights or tables of another dtype than q): called as the model
                # calls it (its forward posenc's while apply_posenc_rope(model) patches the
                # type, else transformers'); a hook sees it once, not also kernels' private copy.
                query_states, key_states = rotation(query_states, key_states, cos, sin)
            else:
                if not cls._posenc_rotation_keeps_dtype:  # the model's rotation promotes (not OLMo 2's)
                    query_states, key_states = _promoted(query_states, cos, sin), _promoted(key_states, cos, sin)
                query_states, key_states = posenc.functional.apply_rope_cos_sin(
                    query_states, key_states, cos, sin, layout="bhsd")

        if cache is not None and layer is None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface = cls._posenc_attention_functions.get_interface(
            self.config._attn_implementation, cls._posenc_eager)
        if cls._posenc_sliding_window:
            kwargs["sliding_window"] = self.sliding_window
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    def __reduce_ex__(self, protocol):
        # pickle / torch.save name the transformers class; loading patches the instance again.
        reduced = super().__reduce_ex__(protocol)
        if (isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[0] is copyreg.__newobj__
                and reduced[1][:1] == (type(self),)):
            key = (self._posenc_base, self._posenc_norm, self._posenc_weight_offset)
            return (_new_qk_norm_attention, key + tuple(reduced[1][1:])) + tuple(reduced[2:])
        return reduced


def _new_qk_norm_attention(base: type, norm: str, weight_offset: float, *args: Any) -> Any:
    cls = _qk_norm_class(base, norm, weight_offset)
    return cls.__new__(cls, *args)


def _qk_norm_class(base: type, norm: str, weight_offset: float) -> type:
    """The posenc subclass of the attention class ``base`` (created once per key). Raises
    RuntimeError when the installed transformers' forward is not the one it rewrites."""
    key = (base, norm, weight_offset)
    with _QK_NORM_CLASSES_LOCK:
        cls = _QK_NORM_CLASSES.get(key)
        if cls is not None:
            return cls
        forward = inspect.unwrap(base.forward)
        module = importlib.import_module(base.__module__)
        code = getattr(forward, "__code__", None)
        names = tuple(inspect.signature(forward).parameters)[: len(_ATTENTION_PARAMETERS)]
        missing = sorted(_ATTENTION_NAMES - set(code.co_names if code is not None else ()))
        eager = getattr(module, "eager_attention_forward", None)
        functions = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
        if names != _ATTENTION_PARAMETERS or missing or eager is None or functions is None:
            raise RuntimeError(
                f"apply_posenc_rope(qk_norm=True): {base.__module__}.{base.__qualname__}.forward is not the "
                f"attention forward posenc rewrites (transformers {transformers.__version__}: parameters "
                f"{names}, expected {_ATTENTION_PARAMETERS}; missing names {missing}; eager_attention_forward "
                f"{'found' if eager is not None else 'missing'})")
        cls = type(base.__name__, (_PosencQKNormAttention, base), {
            "__module__": __name__,
            "__qualname__": f"posenc_qk_norm[{base.__qualname__}]",
            "_posenc_base": base,
            "_posenc_norm": norm,
            "_posenc_weight_offset": weight_offset,
            "_posenc_eager": staticmethod(eager),
            "_posenc_attention_functions": functions,
            "_posenc_sliding_window": "sliding_window" in code.co_names,
            "_posenc_rotation_keeps_dtype": base.__module__ in _ROTATION_KEEPS_DTYPE,
            "_posenc_modeling": module,
        })
        _QK_NORM_CLASSES[key] = cls
        return cls


def _apply_qk_norm(model: Any) -> None:
    model_type = _model_type(model)
    if model_type not in _QK_NORM_TYPES or not isinstance(model, torch.nn.Module):
        raise ValueError(f"apply_posenc_rope(qk_norm=True): expected a loaded model of type "
                         f"{', '.join(QK_NORM_MODEL_TYPES)}; got {model_type!r}")
    norm, weight_offset = _QK_NORM_TYPES[model_type]
    layers = [m for m in model.modules() if hasattr(m, "q_norm") and hasattr(m, "k_norm") and hasattr(m, "q_proj")]
    if not layers:
        raise ValueError(f"apply_posenc_rope(qk_norm=True): no attention layer with q_norm and k_norm in "
                         f"{type(model).__name__}")
    todo = []
    for attn in layers:  # check every layer before changing any
        if isinstance(attn, _PosencQKNormAttention):
            continue
        width = attn.head_dim * (attn.config.num_attention_heads if norm == "hidden" else 1)
        kv_width = attn.head_dim * (attn.config.num_key_value_heads if norm == "hidden" else 1)
        for name, want in (("q_norm", width), ("k_norm", kv_width)):
            weight = getattr(getattr(attn, name), "weight", None)
            if not isinstance(weight, Tensor) or tuple(weight.shape) != (want,):
                raise ValueError(f"apply_posenc_rope(qk_norm=True): {type(attn).__name__}.{name} has no weight of "
                                 f"shape ({want},) (norm {norm!r}); got {getattr(weight, 'shape', None)}")
        todo.append((attn, _qk_norm_class(type(attn), norm, weight_offset)))
    rotaries = [(holder, name, m) for holder in model.modules() for name, m in holder._modules.items()
                if m is not None and any(b.endswith("inv_freq") for b in m._buffers)]
    for attn, cls in todo:
        attn.__class__ = cls  # weights, buffers, hooks and state_dict stay as they are
        # parsed once (revert removes it)
        attn._posenc_fused = _fused_settings(attn, _rotary_source(rotaries, attn))


def revert_posenc_qk_norm(model: Any) -> None:
    """Undo ``apply_posenc_rope(model, qk_norm=True)`` for ``model`` (its layers run
    transformers' own norms and RoPE again)."""
    for attn in model.modules():
        if isinstance(attn, _PosencQKNormAttention):
            attn.__class__ = attn._posenc_base
            attn.__dict__.pop("_posenc_fused", None)


def revert_posenc_rope(model: Optional[Union[Any, str]] = None) -> None:
    """Restore transformers' own ``apply_rotary_pos_emb`` for ``model``'s type (a model,
    config or model-type string), or for every patched type when None."""
    module = None if model is None else _modeling_module(_model_type(model)).__name__
    with _ORIGINALS_LOCK:
        for key in [key for key in _ORIGINALS if module is None or key[0] == module]:
            _ORIGINALS.pop(key).restore()


def is_patched(model: Union[Any, str]) -> bool:
    """Whether ``model``'s type (a model, config or model-type string) currently uses posenc."""
    model_type = _model_type(model)
    module = _modeling_module(model_type)
    return all(_runs(getattr(module, name, None)) is replacement for name, replacement, _ in _PATCHES[model_type])


@contextlib.contextmanager
def posenc_rope(model: Union[Any, str]) -> Iterator[Any]:
    """``with posenc_rope(model): ...``: patched inside the block, restored after (unless it
    was patched before the block). Yields ``model``."""
    already = is_patched(model)
    apply_posenc_rope(model)
    try:
        yield model
    finally:
        if not already:
            revert_posenc_rope(model)
