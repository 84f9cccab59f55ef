"""A one-layer attention classifier learns an order task with RoPE and stays near chance
without it (the C++ example app examples/cpp/rope_order.cpp runs the same task)."""

import torch

import posenc

V, S, D, H = 16, 12, 32, 2


def batch(n):
    tokens = torch.randint(2, V, (n, S))
    places = torch.rand(n, S).argsort(-1)[:, :2]
    rows = torch.arange(n)
    tokens[rows, places[:, 0]] = 0
    tokens[rows, places[:, 1]] = 1
    return tokens, (places[:, 0] < places[:, 1]).long()  # does marker 0 come first?


class AttentionClassifier(torch.nn.Module):
    def __init__(self, use_rope):
        super().__init__()
        self.use_rope = use_rope
        self.embed = torch.nn.Embedding(V, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.head = torch.nn.Linear(D, 2)
        self.rope = posenc.RotaryPositionalEncoding(D // H, max_len=64)

    def forward(self, tokens):
        n = tokens.shape[0]
        q, k, v = self.qkv(self.embed(tokens)).view(n, S, 3, H, D // H).unbind(2)
        if self.use_rope:
            q, k = self.rope(q, k)  # strided slices of the fused projection
        att = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / (D // H) ** 0.5, -1)
        return self.head(torch.einsum("bhst,bthd->bshd", att, v).reshape(n, S, D).mean(1))


def train(use_rope):
    torch.manual_seed(0)
    model = AttentionClassifier(use_rope)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(300):
        tokens, labels = batch(64)
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    tokens, labels = batch(1000)
    with torch.no_grad():
        return (model(tokens).argmax(-1) == labels).float().mean().item()


def test_rope_learns_marker_order():
    with_rope, without = train(True), train(False)
    assert with_rope > 0.95, with_rope
    assert without < 0.65, without
