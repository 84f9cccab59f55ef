"""The README's Python examples run as written, against stand-ins for the names they take
from the reader's program (x, pos, bert, vit, q, k, ...): the documented calls and
argument names cannot drift from the code without this failing."""

import pathlib
import re
from types import SimpleNamespace

import torch

import posenc

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run():
    blocks = python_blocks()
    assert len(blocks) == 2, "update the stand-ins below when README examples are added"
    # Block 1: the additive encodings and helpers.
    d, B, S = 512, 2, 9
    first = dict(
        x=torch.randn(B, S, d), pos=torch.randint(0, 5000, (B, S)), tokens_768=torch.randn(B, 197, 768),
        bert=SimpleNamespace(embeddings=SimpleNamespace(position_embeddings=torch.nn.Embedding(197, 768))),
        vit=SimpleNamespace(pos_embed=torch.randn(1, 197, 768)),
        positions=torch.arange(7), tokens=torch.tensor([[5, 6, 1, 1], [7, 8, 9, 1]]), padding_idx=1,
        t=torch.tensor([0.0, 10.0, 999.0]), table=torch.randn(100, d),
    )
    exec(compile(blocks[0], "README.md (block 1)", "exec"), first)
    assert first["y"].shape == (B, 197, 768)
    # Block 2: RoPE.
    second = dict(
        posenc=posenc, q=torch.randn(B, S, 8, 128), k=torch.randn(B, S, 2, 128),
        pos=torch.randint(0, 4096, (S,)), past_len=17, x=torch.randn(B, S, 4, 128),
        cfg=SimpleNamespace(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    )
    exec(compile(blocks[1], "README.md (block 2)", "exec"), second)
    assert second["q"].shape == (B, S, 8, 128) and second["x"].shape == (B, S, 4, 128)
