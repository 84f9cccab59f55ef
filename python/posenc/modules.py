"""nn.Module front ends of the posenc ops.

Each module's forward calls the function users call (:mod:`posenc.functional`), which calls
the op: one road, through ``nn.Module.__call__`` (hooks, profiler, module traces see every
call). The add-position modules' forward is also what ``torch.jit.script`` compiles: under
``torch.jit.is_scripting()`` it calls the op the function calls (the host-side checks and
DTensor placement are eager-only), so a scripted module computes what the eager one does, in
train and eval mode, and scripting leaves the Python model as it was (no twin). No ``from __future__ import
annotations`` here: TorchScript reads the annotations as types.
"""

from posenc._add_position import LearnedPositionalEncoding, PositionalEncoding
from posenc._helpers import Timesteps
from posenc._rope import RotaryPositionalEncoding

__all__ = ["PositionalEncoding", "LearnedPositionalEncoding", "RotaryPositionalEncoding", "Timesteps"]
