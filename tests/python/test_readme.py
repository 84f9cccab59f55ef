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
    assert len(blocks) == 6, "update the stand-ins below when README examples are added"
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
    # Block 3: multi-axis RoPE.
    from multi_axis_reference import eva_timm_rope, flux_rope, qwen2vl_mrope

    H, seq = 4, 10
    ids = torch.stack([torch.zeros(seq, dtype=torch.long), torch.randint(0, 8, (seq,)), torch.randint(0, 8, (seq,))], 1)
    third = dict(
        posenc=posenc, q_hf=torch.randn(B, H, seq, 128, dtype=torch.float64), k_hf=torch.randn(B, 2, seq, 128, dtype=torch.float64),
        position_ids=torch.randint(0, 50, (3, B, seq)), q_vit=torch.randn(B, H, 257, 64, dtype=torch.float64),
        k_vit=torch.randn(B, H, 257, 64, dtype=torch.float64), ids=ids, x_flux=torch.randn(1, H, seq, 128, dtype=torch.float64),
    )
    exec(compile(blocks[2], "README.md (block 3)", "exec"), third)
    # The last assignments of q, k and x are the ViT's and FLUX's: their peers' formulas.
    torch.testing.assert_close(third["q"], eva_timm_rope(third["q_vit"], 16, 16, 1))
    torch.testing.assert_close(third["x"], flux_rope(third["x_flux"], ids, (16, 56, 56), 10000))
    want, _ = qwen2vl_mrope(third["q_hf"], third["k_hf"], third["position_ids"], [16, 24, 24], 1e6)
    got = posenc.functional.apply_rope(third["q_hf"], positions=third["position_ids"], sections=[16, 24, 24],
                                       sections_mode="mrope", base=1e6, layout="bhsd")
    torch.testing.assert_close(got, want)
    assert list(third["rope"].sections) == [16, 24, 24]
    # Block 4: RoPE into the KV cache (rope_append_kv), a decode loop and a paged call.
    Hq, Hkv, hd, new = 4, 2, 32, 1
    g = torch.Generator().manual_seed(0)
    steps_qkv = [tuple(torch.randn(2, h, new, hd, generator=g) for h in (Hq, Hkv, Hkv)) for _ in range(3)]
    fourth = dict(
        torch=torch, batch=2, kv_heads=Hkv, max_len=16, head_dim=hd, steps=3, project=lambda step: steps_qkv[step],
        num_blocks=4, block_size=4, q_t=torch.randn(5, Hq, hd), k_t=torch.randn(5, Hkv, hd),
        v_t=torch.randn(5, Hkv, hd), pos_t=torch.tensor([0, 1, 2, 7, 8]), slots=torch.tensor([0, 1, 2, -1, 9]),
    )
    exec(compile(blocks[3], "README.md (block 4)", "exec"), fourth)
    assert fourth["lengths"].tolist() == [3, 3]
    for step, (_, _, v) in enumerate(steps_qkv):  # row `step` of the cache holds step's v
        assert torch.equal(fourth["v_cache"][:, :, step], v[:, :, 0])
    assert torch.equal(fourth["v_blocks"][2, 1], fourth["v_t"][4])
    # Block 5: fused QK-norm + RoPE (Qwen3), against RMSNorm written out then apply_rope.
    nh, nkv, hd = 4, 2, 32
    fifth = dict(
        posenc=posenc, hidden=torch.randn(B, S, 64), batch=B, seq=S, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        q_proj=torch.nn.Linear(64, nh * hd), k_proj=torch.nn.Linear(64, nkv * hd), q_norm_weight=torch.rand(hd) + 0.5,
        k_norm_weight=torch.rand(hd) + 0.5, position_ids=torch.randint(0, 4096, (B, S)),
    )
    exec(compile(blocks[4], "README.md (block 5)", "exec"), fifth)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    with torch.no_grad():
        q = fifth["q_proj"](fifth["hidden"]).view(B, S, nh, hd)
        k = fifth["k_proj"](fifth["hidden"]).view(B, S, nkv, hd)
        want = posenc.functional.apply_rope(rms(q, fifth["q_norm_weight"]), rms(k, fifth["k_norm_weight"]),
                                            base=1e6, positions=fifth["position_ids"])
        torch.testing.assert_close(fifth["q"], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fifth["k"], want[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fifth["q2"], posenc.functional.apply_rope(rms(q, 1.0), base=1e6,
                                   positions=fifth["position_ids"]), atol=1e-5, rtol=1e-5)
    # Block 6: torch.func (per-sample gradients, jvp), against plain autograd per sample.
    sixth: dict = {}
    exec(compile(blocks[5], "README.md (block 6)", "exec"), sixth)
    rope, q = sixth["rope"], sixth["q"]
    for i in (0, 7):
        x = q[i].clone().requires_grad_(True)
        rope(x).square().sum().backward()
        torch.testing.assert_close(sixth["per_sample"][i], x.grad)
    assert torch.equal(sixth["tangent"], rope(torch.ones_like(q[0])))
