"""posenc: positional encodings for Transformers as fused LibTorch ops.

``import posenc`` loads the compiled library that registers ``torch.ops.posenc.*``.
"""

from posenc import _library  # noqa: F401  (registers torch.ops.posenc)
from posenc import functional
from posenc.modules import LearnedPositionalEncoding, PositionalEncoding, RotaryPositionalEncoding, Timesteps
from posenc._qk_norm_rope import QKNormRotary

__all__ = ["LearnedPositionalEncoding", "PositionalEncoding", "QKNormRotary", "RotaryPositionalEncoding", "Timesteps",
           "functional"]
__version__ = "0.1.0"
