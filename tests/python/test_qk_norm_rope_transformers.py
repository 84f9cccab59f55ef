"""apply_posenc_rope(model, qk_norm=True) (issue 24): tiny random Qwen3, Qwen3-MoE, Gemma 3 and
OLMo 2 models give the logits and gradients of the unpatched model (rtol = atol = 1e-5,
float32: transformers' cos/sin tables are float32, posenc's angles float64), their weights
and state_dict are unchanged, the fused op really runs (counted), and revert restores
transformers' own path. Skips without transformers, or per model without its class."""

import pytest
import torch

import posenc

transformers = pytest.importorskip("transformers")
from posenc.integrations import transformers as integration  # noqa: E402

# The tiny models (configs, non-trivial norm weights) are the other qk-norm file's.
from test_integrations_transformers_qk_norm import COMMON, CONFIGS, tiny_model  # noqa: E402


def logits_and_grads(model, ids):
    model.zero_grad()
    out = model(ids).logits
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_fused_qk_norm_matches_unpatched(model_type, monkeypatch):
    model = tiny_model(model_type)
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads = logits_and_grads(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    original = posenc.functional.qk_norm_rope
    monkeypatch.setattr(posenc.functional, "qk_norm_rope", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        got_logits, got_grads = logits_and_grads(model, ids)
        assert len(calls) == model.config.num_hidden_layers
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        assert set(got_grads) == set(want_grads)
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        assert set(model.state_dict()) == set(state)
        with torch.no_grad():
            greedy = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    finally:
        integration.revert_posenc_qk_norm(model)
    with torch.no_grad():
        assert torch.equal(greedy, model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False))
    n = len(calls)
    back_logits, _ = logits_and_grads(model, ids)
    assert len(calls) == n  # reverted: transformers' own norms and RoPE
    torch.testing.assert_close(back_logits, want_logits, rtol=0, atol=0)


def test_unsupported_model_is_refused():
    config = transformers.LlamaConfig(**COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="qk_norm=True"):
        integration.apply_posenc_rope(model, qk_norm=True)
