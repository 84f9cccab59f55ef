"""Train in Python, run in C++: export a small model that uses posenc's three encodings.

The model: token embedding, the fixed sinusoidal PositionalEncoding (at explicit
positions), the LearnedPositionalEncoding (at an offset), a qkv projection, RoPE twice on q and k (a yarn
scaling dict at the same positions, then M-RoPE-style multi-axis sections), attention,
a linear head. It is exported two ways, for C++ (examples/cpp/deploy_model.cpp):

    python examples/deploy/export_model.py OUT_DIR

writes
    OUT_DIR/model.pt2          torch.export + AOTInductor package, dynamic batch and sequence
    OUT_DIR/model_traced.pt    torch.jit.trace (TorchScript)
    OUT_DIR/reference.pt       inputs and Python's outputs at two sizes, for the C++ check
and checks that both artefacts, loaded back in Python, give the eager outputs.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import posenc

VOCAB, D_MODEL, HEADS, MAX_LEN = 64, 64, 4, 1024
HEAD_DIM = D_MODEL // HEADS


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.fixed = posenc.PositionalEncoding(D_MODEL, 0.1, MAX_LEN)
        self.learned = posenc.LearnedPositionalEncoding(D_MODEL, 0.1, MAX_LEN)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.rope = posenc.RotaryPositionalEncoding(
            HEAD_DIM, MAX_LEN, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
        # Multi-axis RoPE (Qwen2-VL's M-RoPE sections: pairs per (t, h, w) axis).
        self.rope_axes = posenc.RotaryPositionalEncoding(HEAD_DIM, MAX_LEN, sections=[2, 3, 3], sections_mode="mrope")
        self.out = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        batch, seq = tokens.shape
        x = self.fixed(self.embed(tokens), positions=positions)
        # Rows 2 .. seq + 1 of the learned table (an int offset; a traced model records ints
        # as constants, so no arithmetic on sizes here).
        x = self.learned(x, offset=2)
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, HEAD_DIM).unbind(2)
        q, k = self.rope(q, k, positions=positions)
        # (t, h, w) coordinates of a 4-wide grid of patches, one (3, batch, seq) tensor.
        grid = torch.stack([positions, positions // 4, positions % 4])
        q, k = self.rope_axes(q, k, positions=grid)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(att.transpose(1, 2).reshape(batch, seq, D_MODEL))


def make_inputs(batch: int, seq: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    # Positions with a different start per row (as after left padding), all < MAX_LEN.
    start = torch.randint(0, 16, (batch, 1), generator=g)
    return tokens, start + torch.arange(seq)


class Tensors(nn.Module):
    """A TorchScript container of named tensors: what C++ reads with torch::jit::load."""

    def __init__(self, tensors: dict) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


def export(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyLM().eval()
    example = make_inputs(2, 24, seed=1)

    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=MAX_LEN // 2)
    program = torch.export.export(model, example, dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    start = time.perf_counter()
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(out_dir / "model.pt2"))
    print(f"export_model: AOTInductor package {package} compiled in {time.perf_counter() - start:.0f} s")
    traced = torch.jit.trace(model, example)
    traced.save(str(out_dir / "model_traced.pt"))

    # Python's outputs at two sizes (neither is the traced one); the C++ app makes the bad call.
    compiled = torch._inductor.aoti_load_package(package)
    loaded = torch.jit.load(str(out_dir / "model_traced.pt"))
    reference = {}
    with torch.no_grad():
        for name, (b, s) in {"a": (3, 40), "b": (1, 7)}.items():
            tokens, positions = make_inputs(b, s, seed=b * 100 + s)
            want = model(tokens, positions)
            for what, got in (("AOTInductor", compiled(tokens, positions)), ("TorchScript", loaded(tokens, positions))):
                err = (got - want).abs().max().item()
                print(f"export_model: {what} at ({b}, {s}) vs eager: max |diff| {err:.3g}")
                if err > 1e-5:
                    sys.exit(f"export_model: {what} output differs from eager by {err}")
            reference.update({f"tokens_{name}": tokens, f"positions_{name}": positions, f"out_{name}": want})
    torch.jit.script(Tensors(reference)).save(str(out_dir / "reference.pt"))
    print(f"export_model: wrote {out_dir}/model.pt2, model_traced.pt, reference.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    export(parser.parse_args().out_dir)
