"""examples/torch_func_examples.py, the docs' torch.func examples: per-sample gradients through
a tiny Transformer (vmap(grad) with functional_call) and a jvp through a tiny DiT block
with 2-D RoPE and a timestep embedding, each against the same transform of plain PyTorch."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import torch_func_examples  # noqa: E402


def test_per_sample_gradients_equal_a_loop_of_backward_passes():
    assert torch_func_examples.per_sample_gradients() < 1e-6


def test_dit_block_jvp_equals_the_plain_pytorch_twins():
    assert torch_func_examples.dit_jvp() < 1e-5
