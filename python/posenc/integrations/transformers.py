"""Hugging Face transformers: one call routes a model's RoPE through posenc.

    from posenc.integrations.transformers import apply_posenc_rope

    apply_posenc_rope(model)  # or apply_posenc_rope("llama") before loading

replaces the ``apply_rotary_pos_emb`` function of the model's modeling module
(``transformers.models.<type>.modeling_<type>``) with one that calls
:func:`posenc.functional.apply_rope_cos_sin` on the cos/sin tables the model computed, as
Liger-Kernel's ``apply_liger_kernel_to_llama(rope=True)`` does. The patch is per model type,
not per instance: every model of that type in the process uses it until
:func:`revert_posenc_rope`. :func:`posenc_rope` is the same as a context manager.

Supported model types: see ``SUPPORTED_MODEL_TYPES``. Llama, Mistral, Qwen2, Qwen3, Gemma and
GPT-NeoX share transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (halves
convention; GPT-NeoX's partial rotary included); GPT-J has its own
``apply_rotary_pos_emb(tensor, sin, cos)`` over adjacent pairs (``rotate_every_two``), routed
with ``interleaved=True``. Other model types raise ValueError rather than being patched with a
function whose convention was not checked.

Importing this module imports transformers (ImportError with the pip command when it is
missing); ``import posenc`` does not.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import torch
from torch import Tensor

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError(
        "posenc.integrations.transformers needs Hugging Face transformers, which is not installed: "
        "pip install transformers"
    ) from error

import posenc.functional

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "apply_posenc_rope",
    "apply_posenc_rope_to",
    "is_patched",
    "posenc_rope",
    "posenc_apply_rotary_pos_emb",
    "posenc_gptj_apply_rotary_pos_emb",
    "revert_posenc_rope",
    "revert_posenc_qk_norm",
    "QK_NORM_MODEL_TYPES",
]


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
    (batch, seq, heads, head_dim) with ``unsqueeze_dim=2``; cos, sin: (batch, seq, rotary_dim).
    ``position_ids`` is ignored, as in transformers 4.4x (the tables are already per position);
    transformers 5's signature has no ``position_ids``, so an int in that place is taken as
    ``unsqueeze_dim``.
    """
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim = position_ids
    if unsqueeze_dim == 1:
        layout = "bhsd"
    elif unsqueeze_dim == 2:
        layout = "bshd"
    else:
        raise ValueError(f"posenc apply_rotary_pos_emb: expected unsqueeze_dim 1 (q, k as (batch, heads, seq, "
                         f"head_dim)) or 2 ((batch, seq, heads, head_dim)), got {unsqueeze_dim!r}")
    return posenc.functional.apply_rope_cos_sin(q, k, cos, sin, layout=layout)


def posenc_gptj_apply_rotary_pos_emb(tensor: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    """GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)`` through posenc: tensor (batch, seq,
    heads, rotary_dim), sin/cos (batch, seq, rotary_dim / 2) of its sincos table; adjacent
    pairs (``rotate_every_two``)."""
    cos = torch.repeat_interleave(cos, 2, dim=-1)
    sin = torch.repeat_interleave(sin, 2, dim=-1)
    return posenc.functional.apply_rope_cos_sin(tensor, None, cos, sin, layout="bshd", interleaved=True)


# model_type -> (the replacement, the parameter names transformers' function must start with).
_LLAMA_STYLE = (posenc_apply_rotary_pos_emb, ("q", "k", "cos", "sin"))
_PATCHES: Dict[str, Tuple[Callable, Tuple[str, ...]]] = {
    "llama": _LLAMA_STYLE,
    "mistral": _LLAMA_STYLE,
    "qwen2": _LLAMA_STYLE,
    "qwen3": _LLAMA_STYLE,
    "gemma": _LLAMA_STYLE,
    "gpt_neox": _LLAMA_STYLE,
    "gptj": (posenc_gptj_apply_rotary_pos_emb, ("tensor", "sin", "cos")),
}
SUPPORTED_MODEL_TYPES: Tuple[str, ...] = tuple(_PATCHES)

# modeling module name -> transformers' own apply_rotary_pos_emb, while patched.
_ORIGINALS: Dict[str, Callable] = {}


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
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def apply_posenc_rope_to(model_type: str) -> None:
    """Patch the modeling module of ``model_type`` (e.g. "llama", "gptj"): its
    ``apply_rotary_pos_emb`` becomes posenc's. Patching twice is a no-op. Raises ValueError for
    unsupported types, RuntimeError if the installed transformers' function does not have the
    signature the replacement was written for."""
    module = _modeling_module(model_type)
    replacement, expected = _PATCHES[model_type]
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is replacement:
        return
    if hasattr(current, "_posenc_original"):
        raise RuntimeError(f"apply_posenc_rope: {module.__name__} is routed through qk_norm_rope "
                           f"(apply_posenc_rope(model, qk_norm=True)), which already rotates with posenc")
    if current is None:
        raise RuntimeError(f"apply_posenc_rope: {module.__name__} has no apply_rotary_pos_emb to patch "
                           f"(transformers {transformers.__version__})")
    names = tuple(inspect.signature(current).parameters)[: len(expected)]
    if names != expected:
        raise RuntimeError(f"apply_posenc_rope: {module.__name__}.apply_rotary_pos_emb takes {names}, not "
                           f"{expected} as the posenc replacement expects (transformers {transformers.__version__})")
    _ORIGINALS[module.__name__] = current
    module.apply_rotary_pos_emb = replacement


def apply_posenc_rope(model: Any, qk_norm: bool = False) -> Any:
    """Route a transformers model's RoPE through posenc; returns ``model``.

    ``model``: a loaded model (its ``config.model_type``, or the modeling module of its class),
    a config, or a model-type string. Patches the model type's modeling module (see the module
    docstring): every model of that type uses posenc's rotation until :func:`revert_posenc_rope`.

    ``qk_norm=True`` (a loaded model of a type in ``QK_NORM_MODEL_TYPES``: Qwen3, Qwen3-MoE,
    Gemma 3, OLMo 2): each attention layer's q_norm / k_norm and RoPE run as one fused
    :func:`posenc.functional.qk_norm_rope` at the positions the layer receives
    (``position_ids``) with the config's RoPE parameters; the weights stay where they are
    (``q_norm.weight``, ``k_norm.weight``). Per instance, until :func:`revert_posenc_qk_norm`.
    """
    if qk_norm:
        _apply_qk_norm(model)
        return model
    apply_posenc_rope_to(_model_type(model))
    return model


# ---- qk_norm=True: the norms and RoPE of each attention layer fused.

# model_type -> (norm, weight_offset): the attention's q_norm / k_norm convention.
_QK_NORM_TYPES: Dict[str, Tuple[str, float]] = {
    "qwen3": ("head", 0.0),
    "qwen3_moe": ("head", 0.0),
    "gemma3_text": ("head", 1.0),
    "gemma3": ("head", 1.0),
    "olmo2": ("hidden", 0.0),
}
QK_NORM_MODEL_TYPES: Tuple[str, ...] = tuple(_QK_NORM_TYPES)

# The attention module now running (set by its forward pre-hook), for the patched
# apply_rotary_pos_emb of its modeling module; attention layers run one at a time.
_CURRENT: Dict[str, Any] = {}
_QK_ORIGINALS: Dict[str, Callable] = {}


def _identity(x: Tensor) -> Tensor:
    return x


def _rope_parameters(attn: Any) -> Optional[dict]:
    config = attn.config
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and getattr(attn, "layer_type", None) in params:
        params = params[attn.layer_type]  # Gemma 3: one dict per layer type
    if params is None:  # transformers 4: rope_theta and rope_scaling on the config
        params = dict(getattr(config, "rope_scaling", None) or {"rope_type": "default"})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return dict(params)


def _fused_rotary(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        attn = _CURRENT.get("attn")
        positions = _CURRENT.get("position_ids")
        if attn is None or positions is None:  # not a patched layer: transformers' own
            return original(q, k, cos, sin, *args, **kwargs)
        norm, offset = attn._posenc_qk_norm
        eps = getattr(attn.q_norm, "variance_epsilon", getattr(attn.q_norm, "eps", 1e-6))
        return posenc.functional.qk_norm_rope(
            q, k, attn.q_norm.weight, attn.k_norm.weight, eps=eps, weight_offset=offset, norm=norm,
            positions=positions, layout="bhsd", scaling=_rope_parameters(attn))

    apply_rotary_pos_emb._posenc_original = original
    return apply_rotary_pos_emb


def _apply_qk_norm(model: Any) -> None:
    model_type = _model_type(model)
    if model_type not in _QK_NORM_TYPES or not isinstance(model, torch.nn.Module):
        raise ValueError(f"apply_posenc_rope(qk_norm=True): expected a loaded model of type "
                         f"{', '.join(QK_NORM_MODEL_TYPES)}; got {model_type!r}")
    found = False
    for attn in model.modules():
        if not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm") and hasattr(attn, "q_proj")):
            continue
        if getattr(attn, "_posenc_qk_norm", None) is not None:
            found = True
            continue
        module = importlib.import_module(type(attn).__module__)
        current = module.apply_rotary_pos_emb
        if not hasattr(current, "_posenc_original"):
            module.apply_rotary_pos_emb = _fused_rotary(current)
            _QK_ORIGINALS[module.__name__] = current
        attn._posenc_qk_norm = _QK_NORM_TYPES[model_type]
        # The norms run inside the fused op: the modules keep their weights (state_dict
        # unchanged), their forward passes q and k through.
        attn.q_norm.forward = _identity
        attn.k_norm.forward = _identity

        def pre(mod, args, kwargs):
            _CURRENT["attn"], _CURRENT["position_ids"] = mod, kwargs.get("position_ids")

        def post(mod, args, kwargs, output):
            _CURRENT.clear()

        attn._posenc_hooks = (attn.register_forward_pre_hook(pre, with_kwargs=True),
                              attn.register_forward_hook(post, with_kwargs=True))
        found = True
    if not found:
        raise ValueError(f"apply_posenc_rope(qk_norm=True): no attention layer with q_norm and k_norm in "
                         f"{type(model).__name__}")


def revert_posenc_qk_norm(model: Any) -> None:
    """Undo ``apply_posenc_rope(model, qk_norm=True)`` for ``model`` (its layers run
    transformers' own norms and RoPE again)."""
    for attn in model.modules():
        if getattr(attn, "_posenc_qk_norm", None) is None:
            continue
        for handle in attn._posenc_hooks:
            handle.remove()
        del attn.q_norm.forward, attn.k_norm.forward
        attn._posenc_qk_norm = None


def revert_posenc_rope(model: Optional[Union[Any, str]] = None) -> None:
    """Restore transformers' own ``apply_rotary_pos_emb`` for ``model``'s type (a model,
    config or model-type string), or for every patched type when None."""
    if model is None:
        names = list(_ORIGINALS)
    else:
        model_type = _model_type(model)
        names = [_modeling_module(model_type).__name__]
    for name in names:
        original = _ORIGINALS.pop(name, None)
        if original is not None:
            importlib.import_module(name).apply_rotary_pos_emb = original


def is_patched(model: Union[Any, str]) -> bool:
    """Whether ``model``'s type (a model, config or model-type string) currently uses posenc."""
    model_type = _model_type(model)
    return getattr(_modeling_module(model_type), "apply_rotary_pos_emb", None) is _PATCHES[model_type][0]


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
