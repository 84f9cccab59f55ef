"""What ``torch.jit.script`` compiles in place of posenc's modules.

TorchScript cannot compile the modules' Python front ends (``from __future__`` annotations,
``isinstance`` on ``numbers``, dicts of settings). ``torch.jit.script`` asks every module for
``__prepare_scriptable__()`` first and compiles what it returns, so each module hands over a
twin written in TorchScript's subset that shares its parameters and buffers (the same
tensors: a scripted model's ``state_dict`` keys and values are the module's) and calls the
same op. This file has no ``from __future__ import annotations`` on purpose: TorchScript
reads the annotations as types.

Checks the twins leave to the op: an out-of-range position raises the op's IndexError on the
CPU (and the device-side check on CUDA); the host-side range check of CUDA ``positions`` is
not made.
"""

from typing import Optional

import torch
from torch import Tensor, nn


class ScriptableAddPosition(nn.Module):
    """``PositionalEncoding`` / ``LearnedPositionalEncoding`` for TorchScript:
    ``forward(x, offset=0, positions=None) = dropout(x + pe[rows])``, one op call."""

    batch_first: bool

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        if isinstance(source.pe, nn.Parameter):
            self.pe = source.pe
        else:
            self.register_buffer("pe", source.pe)
        self.dropout = source.dropout  # the same nn.Dropout: train/eval and p as the module's
        self.batch_first = source.batch_first

    def forward(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        p = self.dropout.p if self.training else 0.0
        return torch.ops.posenc.add_position(x, self.pe, positions, offset, self.batch_first, p)


def rope_not_scriptable(module: nn.Module) -> None:
    """``RotaryPositionalEncoding`` returns q alone or (q, k) depending on its arguments, a
    type TorchScript cannot give a caller; say what works instead."""
    raise RuntimeError(
        f"posenc: {type(module).__name__} cannot be compiled by torch.jit.script (its forward returns q "
        "or (q, k) depending on whether k is given, which TorchScript cannot type). Export the model "
        "instead: torch.jit.trace(model, example_inputs) for TorchScript, or torch.export.export + "
        "torch._inductor.aoti_compile_and_package for AOTInductor (README, 'Deploy to C++'); or call "
        "torch.ops.posenc.rope from scripted code"
    )
