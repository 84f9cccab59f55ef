"""nn.Module front ends of the posenc ops.

Each module's forward calls the function users call (:mod:`posenc.functional`), which calls
the op: one road, through ``nn.Module.__call__`` (hooks, profiler, module traces see every
call). The add-position modules' forward is also what ``torch.jit.script`` compiles: under
``torch.jit.is_scripting()`` it calls the op the function calls (the host-side checks and
DTensor placement are eager-only), so a scripted module computes what the eager one does, in
train and eval mode, and scripting leaves the Python model as it was (no twin). No ``from __future__ import
annotations`` here: TorchScript reads the annotations as types.
"""

import math
import numbers
import types
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from posenc import _rope
from posenc._add_position import LearnedPositionalEncoding, PositionalEncoding
from posenc._add_position import _AddPositionModule, _check_positions_on_host  # noqa: F401  (their old home)
from posenc._common import _check_positive_int
from posenc._helpers import Timesteps

__all__ = ["PositionalEncoding", "LearnedPositionalEncoding", "RotaryPositionalEncoding", "Timesteps"]


def _check_length_baseline(scaling: dict, rope_type: str, max_len: int) -> None:
    """A type that scales by length with original_max_position_embeddings defaulting to the
    model's ("dynamic") rescales only when a call's positions pass that baseline, and the
    module refuses positions at or beyond max_len: a baseline at or above max_len (or the
    default, max_len) would make the scaling a silent no-op."""
    orig = scaling.get("original_max_position_embeddings")
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


class RotaryPositionalEncoding(nn.Module):
    r"""Rotary position embedding (RoPE, Su et al.) of queries and keys, fused for q and k.

    ``q, k = rope(q, k)`` returns rotated copies (one kernel launch for both); ``x =
    rope(x)`` rotates one tensor (torchtune's ``RotaryPositionalEmbeddings`` call form).
    Positions are ``0 .. seq-1`` plus ``offset`` (an int, or an int64 (batch,) tensor of
    per-sequence KV-cache lengths), or ``positions`` (int64 (seq,) or (batch, seq)).

    Args:
        dim: head_dim of q and k.
        max_len: positions must lie in ``[0, max_len)``; a clear error is raised otherwise
            (the functional :func:`posenc.functional.apply_rope` has no limit).
        base: RoPE base ("rope_theta"; default 10000, or the scaling dict's ``rope_theta``).
        interleaved: rotate adjacent pairs (GPT-J, Meta LLaMA, torchtune) instead of halves
            (GPT-NeoX, Hugging Face ``rotate_half``).
        rotary_dim: rotate only the first ``rotary_dim`` features (partial rotary);
            default ``dim`` (``2 * sum(sections)`` with sections).
        scaling: None or a Hugging Face ``rope_scaling`` dict ("linear", "dynamic", "yarn",
            "llama3", "longrope" or "proportional"). "dynamic" needs
            ``original_max_position_embeddings`` below ``max_len`` (the trained context,
            Hugging Face's ``max_position_embeddings``: positions beyond it are what it
            rescales); for "yarn" it defaults to ``max_len``, and "longrope"'s ``factor`` to
            ``max_len / original_max_position_embeddings``.
        layout: "bshd" (default), "bhsd", "sbhd" or "thd" (packed, with ``cu_seqlens``).
        sections, sections_mode: multi-axis RoPE (Qwen2-VL M-RoPE, axial 2-D/3-D RoPE), as
            in :func:`posenc.functional.apply_rope`; positions are then (n_axes, ...) and
            every coordinate must lie in ``[0, max_len)``.

    ``inv_freq`` is a non-persistent float32 buffer (Hugging Face's name and convention, so
    state_dicts stay clean) holding the frequencies for inspection; the kernel evaluates them
    itself in float64 from the configuration, so a dtype cast of the module does not change
    the numbers. ``attention_scaling`` is yarn's factor on cos and sin (1 otherwise).

    ``check_positions`` (attribute, default True): positions given as CUDA tensors are
    range-checked on the host in eager mode, one device sync; set it to False in a hot loop
    whose positions are known to be valid.
    """

    inv_freq: Tensor
    check_positions: bool = True

    def __init__(
        self,
        dim: int,
        max_len: int = 4096,
        base: Optional[float] = None,
        *,
        interleaved: bool = False,
        rotary_dim: Optional[int] = None,
        scaling: Optional[Mapping[str, Any]] = None,
        layout: str = "bshd",
        sections: Optional[Sequence[int]] = None,
        sections_mode: str = "axial",
    ) -> None:
        super().__init__()
        self.dim = _check_positive_int("dim", dim)
        self.max_len = _check_positive_int("max_len", max_len)
        # A transformers 4/5 dict's rope_theta, partial_rotary_factor and mrope_section set
        # base, rotary_dim and sections (an explicit argument that disagrees is an error).
        scaling, base, rotary_dim, sections, sections_mode = _rope.resolve_config_keys(
            scaling, base=base, rotary_dim=rotary_dim, head_dim=self.dim, sections=sections,
            sections_mode=sections_mode, fn="RotaryPositionalEncoding")
        base = 10000.0 if base is None else base
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 1 < base < math.inf:
            raise ValueError(f"expected base to be a finite number > 1, got {base!r}")
        sections = None if sections is None else _rope._sections(sections)
        if rotary_dim is None:  # all of dim, or what the sections rotate
            rotary_dim = self.dim if sections is None else 2 * sum(max(s, 0) for s in sections)
        rotary_dim = _check_positive_int("rotary_dim", rotary_dim)
        if rotary_dim % 2 != 0 or rotary_dim > self.dim:
            raise ValueError(f"expected rotary_dim to be even and at most dim={self.dim}, got {rotary_dim}")
        if layout not in _rope.LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(_rope.LAYOUTS)}")
        self._scaling = None if scaling is None else dict(scaling)
        # The configuration, parsed once (with the model defaults max_len gives the scaling
        # keys) and passed on at every call; the settings below read it (read-only: a
        # changed setting would have to be parsed again: build a new module).
        self.rope_config = _rope.RopeConfig.parse(
            head_dim=self.dim, base=float(base), interleaved=interleaved, rotary_dim=rotary_dim,
            scaling=self._scaling, layout=layout, sections=sections, sections_mode=sections_mode,
            max_position_embeddings=self.max_len, fn="RotaryPositionalEncoding")
        c = self.rope_config
        if c.rope_type in _rope.LENGTH_SCALED_TYPES and c.rope_type in _rope.ORIGINAL_FROM_MODEL_TYPES:
            _check_length_baseline(self._scaling, c.rope_type, self.max_len)
        # Checks every value once (the op's own checks) and gives the frequencies.
        inv_freq, factor = torch.ops.posenc.rope_frequencies(
            c.rotary_dim, c.base, c.rope_type, list(c.scaling), 0, list(c.sections), c.sections_mode
        )
        self.attention_scaling = float(factor)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

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
        if input_pos is not None:
            if positions is not None:
                raise ValueError("RotaryPositionalEncoding: got both positions and input_pos (torchtune's name "
                                 "for positions); pass one")
            positions = input_pos
        if q.dim() >= 1 and q.shape[-1] != self.dim:
            raise ValueError(f"expected q with head_dim {self.dim} (the module's dim), got shape {tuple(q.shape)}")
        longest = self._check_range(q, positions, offset, cu_seqlens)
        return _rope.apply_rope(
            q, k, positions=positions, offset=offset, cu_seqlens=cu_seqlens, config=self.rope_config,
            seq_len=seq_len if seq_len is not None or longest is None else max(longest + 1, 0),
        )

    def __setstate__(self, state: dict) -> None:
        """A module pickled before its configuration was parsed once (posenc before
        2026-12-03: the settings as attributes) is rebuilt into a RopeConfig."""
        if "rope_config" not in state and "base" in state:
            state = dict(state)
            settings = {name: state.pop(name, None) for name in
                        ("base", "interleaved", "rotary_dim", "layout", "sections", "sections_mode")}
            state["_scaling"] = state.pop("scaling", None)
            state["rope_config"] = _rope.RopeConfig.parse(
                head_dim=state["dim"], scaling=state["_scaling"], max_position_embeddings=state["max_len"],
                fn="RotaryPositionalEncoding", **settings)
        super().__setstate__(state)

    # The settings, read from the parsed configuration.
    @property
    def base(self) -> float:
        return self.rope_config.base

    @property
    def interleaved(self) -> bool:
        return self.rope_config.interleaved

    @property
    def rotary_dim(self) -> int:
        return self.rope_config.rotary_dim

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
        the op posenc::rope_position_bounds reads them back (a sync on CUDA), only when
        check_positions is set (CUDA) and not under torch.compile. Returns the longest
        position when it was read from tensors (so "dynamic" need not read it again)."""
        if q.dim() != (3 if self.layout == "thd" else 4):
            return  # the rope op raises for a wrong rank, with its own message
        offsets = offset if isinstance(offset, Tensor) else None
        if offsets is None and (isinstance(offset, bool) or not isinstance(offset, (int, torch.SymInt))):
            return  # apply_rope raises a TypeError naming offset
        if positions is None and offsets is None and cu_seqlens is None:
            # Positions offset .. offset + seq - 1: no tensor to read, traceable.
            b, s, _ = _rope.LAYOUT_AXES[self.layout]
            batch, seq = (1 if b is None else q.shape[b]), q.shape[s]  # the op's rule: no token, no bound
            lo, hi = (offset, offset + seq - 1) if batch > 0 and seq > 0 else (0, -1)
        else:
            tensors = [t for t in (positions, offsets, cu_seqlens) if isinstance(t, Tensor)]
            on_cuda = any(t.is_cuda for t in tensors)
            # torch.jit.trace cannot record an op that returns ints: a traced module, like a
            # compiled one, keeps the kernels' own checks.
            if (torch.compiler.is_compiling() or torch.jit.is_tracing() or (on_cuda and not self.check_positions)
                    or q.is_meta or any(t.is_meta for t in tensors)):
                return None  # nothing to read: traced, unchecked, or shapes only (meta)
            lo, hi = torch.ops.posenc.rope_position_bounds(
                q, positions=positions, offsets=offsets, offset=0 if offsets is not None else offset,
                cu_seqlens=cu_seqlens, rotary_dim=self.rotary_dim, layout=self.layout,
                sections=list(self.rope_config.sections), sections_mode=self.sections_mode,
            )
        if hi >= lo and (lo < 0 or hi >= self.max_len):
            torch.ops.posenc.position_range_check(lo, hi, self.max_len)  # raises the one IndexError
        return hi if positions is not None or offsets is not None or cu_seqlens is not None else None

    def __prepare_scriptable__(self) -> nn.Module:
        """Its forward returns q alone or (q, k) depending on its arguments, a type
        TorchScript cannot give a caller: say what works instead."""
        raise RuntimeError(
            f"posenc: {type(self).__name__} cannot be compiled by torch.jit.script (its forward returns q "
            "or (q, k) depending on whether k is given, which TorchScript cannot type). Export the model "
            "instead: torch.jit.trace(model, example_inputs) for TorchScript, or torch.export.export + "
            "torch._inductor.aoti_compile_and_package for AOTInductor (README, 'Deploy to C++'); or call "
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
