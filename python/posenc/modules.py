"""nn.Module front ends of the posenc ops."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from posenc import functional

__all__ = ["PositionalEncoding", "LearnedPositionalEncoding"]


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"expected {name} to be a positive integer, got {value!r}")
    return int(value)


def _check_probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"expected {name} to be a probability in [0, 1], got {value!r}")
    return float(value)


def _check_positions_on_host(positions: Tensor, max_len: int) -> None:
    """Range-check CUDA positions (CPU ones are checked inside the kernel).

    This costs one device sync; the CUDA kernel never reads out of bounds, but could only
    mark bad rows with NaN, so eager mode checks here. Under torch.compile the check is
    left out (it would break the graph) and out-of-range rows come out as NaN.
    """
    if positions.is_cuda and positions.numel() > 0 and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(positions)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= max_len:
            raise IndexError(
                f"posenc: expected positions in [0, max_len={max_len}), got values from {lo} to {hi}"
            )


class _AddPositionModule(nn.Module):
    """Shared front end: ``forward(x, offset=0, positions=None) = dropout(x + pe[rows])``
    through the fused op, with the classic ``nn.Dropout`` child and argument checks.

    ``check_positions`` (attribute, default True): range-check CUDA ``positions`` on the
    host in eager mode, which costs one device sync. Set it to False in a hot loop whose
    positions are known to be valid; out-of-range rows then come out as NaN.
    """

    pe: Tensor
    check_positions: bool = True

    def __init__(self, d_model, dropout, max_len, batch_first) -> None:
        super().__init__()
        self.d_model = _check_positive_int("d_model", d_model)
        self.max_len = _check_positive_int("max_len", max_len)
        self.batch_first = bool(batch_first)
        # An nn.Dropout child as in the classic class: `module.dropout.p` stays settable.
        self.dropout = nn.Dropout(p=_check_probability("dropout", dropout))

    def forward(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        """``dropout(x + pe[0, offset:offset+S])``, or ``pe[0, positions]`` when given."""
        if positions is not None and self.check_positions:
            _check_positions_on_host(positions, self.pe.shape[1])
        p = self.dropout.p if self.training else 0.0
        return torch.ops.posenc.add_position(x, self.pe, positions, offset, self.batch_first, p)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}, batch_first={self.batch_first}"


class PositionalEncoding(_AddPositionModule):
    r"""Fixed sinusoidal positional encoding with fused dropout.

    A drop-in replacement for the classic ``PositionalEncoding(d_model, dropout,
    max_len=5000)`` of the Annotated Transformer: same arguments, a persistent float32
    buffer ``pe`` of shape (1, max_len, d_model) (so ``state_dict()`` holds exactly
    ``pe``), and ``forward(x) = dropout(x + pe[:, :S])``, computed in one pass.

    Args:
        d_model: embedding width. Odd values work: the last column is a sine.
        dropout: dropout probability applied in training mode.
        max_len: number of positions in ``pe``.
        batch_first: x is (batch, seq, d_model) if True (the classic layout), else
            (seq, batch, d_model) (the PyTorch-tutorial layout).
        base: wavelength base of the sinusoids (10000 in the paper).

    ``pe`` is built in float64 and rounded once: every entry is within 2**-25 of the
    exact value (the classic float32 construction is off by up to ~4e-4 at max_len 5000).
    The forward adds rows of ``pe`` as it is, so a loaded or edited table is honoured.
    """

    def __init__(
        self,
        d_model: int,
        dropout: float = 0.1,
        max_len: int = 5000,
        *,
        batch_first: bool = True,
        base: float = 10000.0,
    ) -> None:
        super().__init__(d_model, dropout, max_len, batch_first)
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 0 < base < math.inf:
            raise ValueError(f"expected base to be a positive finite number, got {base!r}")
        self.base = float(base)
        positions = torch.arange(self.max_len, dtype=torch.int64)
        table = functional.sinusoidal_table(positions, self.d_model, base=self.base)
        self.register_buffer("pe", table.unsqueeze(0))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}"


class LearnedPositionalEncoding(_AddPositionModule):
    r"""Learned absolute position embeddings (BERT, GPT-2, ViT) with fused dropout.

    Same arguments and forward as :class:`PositionalEncoding`, but ``pe`` is an
    ``nn.Parameter`` of shape (1, max_len, d_model), initialised from a normal distribution
    with std ``init_std`` truncated at +-2 std (the BERT/ViT convention). Its gradient is the
    sum over the batch of the gradient reaching x, for exactly the positions used.

    A ViT-style ``pos_embed`` of shape (1, N, d) loads directly through ``load_state_dict``
    (key ``pe``); a BERT/GPT-2 table of shape (max_len, d) (``position_embeddings.weight``,
    ``wpe.weight``) loads through :meth:`load_table`.
    """

    def __init__(
        self,
        d_model: int,
        dropout: float = 0.1,
        max_len: int = 5000,
        *,
        batch_first: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__(d_model, dropout, max_len, batch_first)
        if isinstance(init_std, bool) or not isinstance(init_std, numbers.Real) or not init_std >= 0:
            raise ValueError(f"expected init_std to be a non-negative number, got {init_std!r}")
        self.init_std = float(init_std)
        self.pe = nn.Parameter(torch.empty(1, self.max_len, self.d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pe, std=self.init_std, a=-2 * self.init_std, b=2 * self.init_std)

    @torch.no_grad()
    def load_table(self, table: Tensor) -> None:
        """Copy a (max_len, d_model) or (1, max_len, d_model) table into ``pe``."""
        if not isinstance(table, Tensor) or table.dim() not in (2, 3) or (
            table.dim() == 3 and table.shape[0] != 1
        ) or tuple(table.shape[-2:]) != tuple(self.pe.shape[1:]):
            shape = tuple(table.shape) if isinstance(table, Tensor) else type(table).__name__
            raise ValueError(
                f"load_table: expected a table of shape ({self.max_len}, {self.d_model}) or "
                f"(1, {self.max_len}, {self.d_model}), got {shape}"
            )
        self.pe.copy_(table.reshape(self.pe.shape))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init_std={self.init_std}"
