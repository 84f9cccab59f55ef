"""Drop-in integrations of posenc into other libraries.

Each integration is its own submodule and imports its library only when imported itself
(``import posenc`` imports none of them):

- :mod:`posenc.integrations.transformers`: route Hugging Face transformers models' RoPE
  (``apply_rotary_pos_emb``) through :func:`posenc.functional.apply_rope_cos_sin`.
"""

__all__ = ["transformers"]
