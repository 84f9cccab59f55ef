"""torch.func through posenc: per-sample gradients of a tiny Transformer, and the jvp a
consistency model takes through a tiny DiT block (2-D RoPE and a timestep embedding).

The first compares vmap(grad) with a loop of backward passes through the same model (the
batching rules against autograd); the second runs jvp on a twin written in plain PyTorch
(the formulas of RoPE and of diffusers' timestep embedding). Each returns the largest
difference; run it with ``python examples/torch_func_examples.py``
(tests/python/test_examples_func.py checks both)."""

import math

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

import posenc
from posenc.functional import apply_rope, grid_positions, timestep_embedding


# ---- 1. Per-sample gradients (Opacus-style differential privacy) --------------------------

class TinyTransformer(nn.Module):
    """Token embeddings + the drop-in sinusoidal PositionalEncoding + one attention layer with
    RoPE + a classifier (dropout 0: vmap draws other masks than a loop would)."""

    def __init__(self, vocab=11, d=16, heads=2, dropout=0.0):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.embed = nn.Embedding(vocab, d)
        self.pe = posenc.PositionalEncoding(d, dropout, max_len=64)
        self.qkv = nn.Linear(d, 3 * d)
        self.rope = posenc.RotaryPositionalEncoding(self.head_dim, max_len=64)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens):  # tokens: (seq,) one sample
        x = self.pe(self.embed(tokens)[None])[0]  # PositionalEncoding is (batch, seq, d)
        q, k, v = self.qkv(x).view(1, -1, 3 * self.heads, self.head_dim).chunk(3, dim=2)
        q, k = self.rope(q, k)
        att = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(self.head_dim), -1)
        y = torch.einsum("bhst,bthd->bshd", att, v).flatten(2)[0]
        return self.out(y)


def per_sample_gradients(batch=4, seq=7):
    torch.manual_seed(0)
    model = TinyTransformer()
    params = {name: p.detach() for name, p in model.named_parameters()}
    tokens = torch.randint(0, 11, (batch, seq))
    labels = torch.randint(0, 11, (batch, seq))

    def loss(p, tokens, labels):
        return nn.functional.cross_entropy(functional_call(model, p, (tokens,)), labels)

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, tokens, labels)
    worst = 0.0
    for i in range(batch):  # the same gradients, one backward pass per sample
        model.zero_grad()
        loss(dict(model.named_parameters()), tokens[i], labels[i]).backward()
        for name, p in model.named_parameters():
            worst = max(worst, (per_sample[name][i] - p.grad).abs().max().item())
    return worst


# ---- 2. jvp through a DiT block (consistency-model training) ------------------------------

def rope_2d_reference(x, positions, sections, base=10000.0):
    """Axial 2-D RoPE in plain PyTorch: pair i of the head (features i and i + R/2, R = 2 *
    sum(sections)) belongs to axis a's section and turns by coordinate a times that
    section's own frequency base^(-j / sections[a]). x: (batch, seq, heads, head_dim)."""
    angles = []
    for axis, pairs in enumerate(sections):
        inv = base ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
        angles.append(positions[axis].to(torch.float64)[:, None] * inv)  # (seq, pairs)
    angle = torch.cat(angles, -1)
    rot = 2 * angle.shape[-1]
    cos = torch.cat([angle, angle], -1).cos().to(x.dtype)[None, :, None]
    sin = torch.cat([angle, angle], -1).sin().to(x.dtype)[None, :, None]
    xr = x[..., :rot]
    half = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return torch.cat([xr * cos + half * sin, x[..., rot:]], -1)


def timestep_reference(t, dim, max_period=10000.0):
    """diffusers' get_timestep_embedding (flip_sin_to_cos=False, shift 1)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / (half - 1))
    angle = t[:, None].float() * freqs
    return torch.cat([angle.sin(), angle.cos()], -1)


class TinyDiTBlock(nn.Module):
    """adaLN-modulated attention over a grid of patches with axial 2-D RoPE, conditioned on
    a timestep embedding."""

    def __init__(self, d=16, heads=2, grid=(3, 4), reference=False):
        super().__init__()
        self.heads, self.head_dim, self.grid, self.reference = heads, d // heads, grid, reference
        self.sections = [self.head_dim // 4, self.head_dim // 4]  # pairs per axis (h, w)
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 2 * d))
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, t):  # x: (batch, h * w, d); t: (batch,)
        d = x.shape[-1]
        temb = (timestep_reference(t, d) if self.reference else timestep_embedding(t, d)).to(x.dtype)
        shift, scale = self.t_mlp(temb)[:, None].chunk(2, -1)
        h = nn.functional.layer_norm(x, (d,)) * (1 + scale) + shift
        q, k, v = self.qkv(h).view(*x.shape[:2], 3 * self.heads, self.head_dim).chunk(3, dim=2)
        positions = grid_positions(*self.grid)  # (2, h * w)
        if self.reference:
            q, k = (rope_2d_reference(y, positions, self.sections) for y in (q, k))
        else:
            q, k = apply_rope(q, k, positions=positions, sections=self.sections)
        att = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(self.head_dim), -1)
        return x + self.proj(torch.einsum("bhst,bthd->bshd", att, v).flatten(2))


def dit_jvp(batch=2):
    """The consistency-model step: the network's output and its directional derivative
    along (dx/dt, 1) in one forward pass (torch.func.jvp), through posenc's RoPE and
    timestep ops; against the same jvp of the plain-PyTorch twin (float32)."""
    torch.manual_seed(1)
    block, twin = TinyDiTBlock(), TinyDiTBlock(reference=True)
    twin.load_state_dict(block.state_dict())
    x, t = torch.randn(batch, 12, 16), torch.rand(batch) * 1000
    dx, dt = torch.randn_like(x), torch.ones_like(t)
    out, tangent = jvp(block, (x, t), (dx, dt))
    out_ref, tangent_ref = jvp(twin, (x, t), (dx, dt))
    return max((out - out_ref).abs().max().item(), (tangent - tangent_ref).abs().max().item())


if __name__ == "__main__":
    print(f"per-sample gradients, largest difference from a loop of backward passes: {per_sample_gradients():.2e}")
    print(f"DiT block jvp, largest difference from the plain-PyTorch twin: {dit_jvp():.2e}")
