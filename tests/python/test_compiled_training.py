"""Compiled training, as a user runs it: a tiny attention model with posenc's modules (the
fixed table with dropout in train mode, RoPE with "dynamic" scaling whose frequencies change
past the original length, checkpointed), compiled by Inductor with its default settings,
trained for a few SGD steps at changing lengths (a recompile with dynamic shapes), against
the same model in eager mode: losses, every gradient and every parameter after each step.
A review ran this and more (masks, autocast, accumulation, the transformers integration):
each agreed; this keeps the combination that exercises the recompiles and the masks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posenc

V, D, H = 32, 16, 2
HD = D // H


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pe = posenc.PositionalEncoding(D, 0.3, 64)
        self.qkv = nn.Linear(D, 3 * D)
        scaling = {"rope_type": "dynamic", "factor": 2.0}  # a Hugging Face dict: the baseline is the model's length
        self.rope = posenc.RotaryPositionalEncoding(HD, 64, scaling=scaling, max_position_embeddings=10)
        self.out = nn.Linear(D, V)

    def layer(self, h):
        h = self.pe(h)
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, H, HD).unbind(2)
        q, k = self.rope(q, k)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return a.transpose(1, 2).reshape(b, s, D)

    def forward(self, tokens):
        h = torch.utils.checkpoint.checkpoint(self.layer, self.emb(tokens), use_reentrant=False)
        return self.out(h)


def train(model, call, lengths):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for i, s in enumerate(lengths):
        opt.zero_grad(set_to_none=True)
        tokens = torch.randint(0, V, (2, s), generator=torch.Generator().manual_seed(1000 + i))
        torch.manual_seed(77 + i)  # the dropout masks
        loss = F.cross_entropy(call(tokens).reshape(-1, V), tokens.roll(-1, 1).reshape(-1))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        steps.append((loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return steps


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_training_matches_eager_across_recompiles():
    torch.manual_seed(0)
    eager = Tiny()
    compiled = copy.deepcopy(eager)
    lengths = (8, 12, 16)  # 12 recompiles with dynamic shapes; 12 and 16 scale past 10
    want = train(eager, eager, lengths)
    torch._dynamo.reset()
    got = train(compiled, torch.compile(compiled), lengths)
    for (wl, wg, wp), (gl, gg, gp) in zip(want, got):
        torch.testing.assert_close(gl, wl, atol=1e-6, rtol=1e-5)
        for name in wg:
            torch.testing.assert_close(gg[name], wg[name], atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(gp[name], wp[name], atol=1e-6, rtol=1e-5, msg=name)
    # The steps did train, and dropout did drop in the models as trained (train mode): the
    # masks agreed, not an inactive dropout.
    assert not torch.equal(want[0][2]["emb.weight"], want[-1][2]["emb.weight"])
    for model in (eager, compiled):
        dropped = (model.pe(torch.randn(2, 64, D) + 10) == 0).double().mean().item()
        assert 0.2 < dropped < 0.4, dropped


def test_compiled_autograd_needs_the_forward_compiled_too():
    """Compiled autograd (torch._dynamo.config.compiled_autograd) traces each autograd node of
    the graph it runs. A posenc op's node is C++ code torch's tracer cannot key (its settings
    are not listed to compiled autograd): a graph recorded in eager mode raises, naming the
    node, rather than run a graph cached for other settings. A compiled forward puts posenc's
    backward inside the compiled function, whose node compiled autograd takes: the
    gradients are eager's (docs/guide/func.md)."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    x = torch.randn(1, 4, 8, requires_grad=True)
    table = torch.randn(10, 8)

    def eager_loss():
        rotated = posenc.functional.apply_rope(q, base=500.0)
        return rotated.square().sum() + posenc.functional.add_position(x, table).square().sum()

    loss = eager_loss()
    with pytest.raises(NotImplementedError, match=r"compiled_args not implemented: posenc::"):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
    q.grad = x.grad = None
    eager_loss().backward()
    want = q.grad.clone(), x.grad.clone()
    q.grad = x.grad = None
    counters.clear()
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(lambda: eager_loss().backward(), backend="aot_eager")()
        assert counters["compiled_autograd"]["captures"] >= 1  # the backward went through compiled autograd
        torch.testing.assert_close((q.grad, x.grad), want, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
