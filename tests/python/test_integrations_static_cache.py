"""apply_posenc_rope(model, qk_norm=True) with a transformers StaticCache (issue 39, item 2):
each full-attention layer's q_norm / k_norm, RoPE and cache write run as one
posenc.functional.rope_append_kv (q_weight / k_weight), the rows StaticLayer.update writes
(its cumulative_length + s). A tiny random Qwen3 generates the unpatched model's greedy tokens
and leaves the same cache contents; the fused road is counted; a DynamicCache keeps
qk_norm_rope + the cache's update.

Tolerance of the cache contents: float32, rtol = atol = 1e-5 (a fused kernel rounds once where
transformers' norm and rotation round per operation)."""

import pytest
import torch

import posenc

transformers = pytest.importorskip("transformers")
from posenc.integrations import transformers as integration  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
PROMPT, NEW = 5, 8


def tiny_qwen3(**extra):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, pad_token_id=0, **extra)
    # from_config leaves the model in training mode (from_pretrained calls eval()): generate runs
    # under no_grad and the config's dropouts are 0, so the mode changes nothing here.
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.fixture
def counted(monkeypatch):
    """Calls of the public functions the patched layers must reach, by name."""
    calls = {"rope_append_kv": 0, "qk_norm_rope": 0}
    for name in calls:
        original = getattr(posenc.functional, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(posenc.functional, name, spy)
    return calls


def generate(model, ids, cache, **kwargs):
    """Greedy tokens and the cache; ``cache="static"``: generate's own StaticCache."""
    how = dict(cache_implementation=cache) if isinstance(cache, str) else dict(cache=cache)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         **how, **kwargs)
    return out.sequences, out.cache


def static_cache(model):
    return transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW + 3)


@pytest.mark.parametrize("batch, cache, padded", [(1, "explicit", False), (2, "explicit", False),
                                                  (2, "static", False), (2, "explicit", True)])
def test_static_cache_written_by_rope_append_kv(batch, cache, padded, counted):
    """``padded``: the first row left-padded by 2, so its positions (from the attention mask)
    differ from its cache rows."""
    model = tiny_qwen3()
    ids = torch.randint(2, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :2], mask[0, :2] = 0, 0
    make = (lambda: static_cache(model)) if cache == "explicit" else (lambda: cache)
    tokens, want_cache = generate(model, ids, make(), attention_mask=mask)
    assert counted == {"rope_append_kv": 0, "qk_norm_rope": 0}

    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        got_tokens, got_cache = generate(model, ids, make(), attention_mask=mask)
    finally:
        integration.revert_posenc_qk_norm(model)
    layers = model.config.num_hidden_layers
    # the prefill and every step but the last (whose token needs no forward), in each layer
    assert counted == {"rope_append_kv": NEW * layers, "qk_norm_rope": 0}
    assert got_tokens.shape == (batch, PROMPT + NEW) and torch.equal(got_tokens, tokens)
    assert type(got_cache) is transformers.StaticCache
    for got, want in zip(got_cache.layers, want_cache.layers):
        assert type(got) is transformers.cache_utils.StaticLayer
        assert int(got.cumulative_length) == int(want.cumulative_length) == PROMPT + NEW - 1
        torch.testing.assert_close(got.keys, want.keys, **TOL)
        torch.testing.assert_close(got.values, want.values, **TOL)


def test_compiled_forward_writes_the_static_cache():
    """A StaticCache is what torch.compile'd decoding uses: the patched model's forward compiled
    (left-padded batch of 2) generates the unpatched model's greedy tokens and cache contents,
    each layer's step through one rope_append_kv in every graph dynamo captured (the prefill's
    and the steps'), and the profiler counting them in a second, already compiled generation
    (the prefill and 7 steps, 2 layers). Backend aot_eager, as the qk_norm compile test says why."""
    model = tiny_qwen3()
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    tokens, want_cache = generate(model, ids, static_cache(model), attention_mask=mask, disable_compile=True)
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")  # the graphs dynamo captured
        model.forward = torch.compile(model.forward, backend=counter)
        generate(model, ids, static_cache(model), attention_mask=mask, disable_compile=True)  # compiles
        in_graphs = [sum("posenc.rope_append_kv" in str(n.target) for n in g.graph.nodes) for g in counter.graphs]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got_tokens, got_cache = generate(model, ids, static_cache(model), attention_mask=mask, disable_compile=True)
    finally:
        del model.forward
        integration.revert_posenc_qk_norm(model)
    layers = model.config.num_hidden_layers
    assert in_graphs and all(n == layers for n in in_graphs), in_graphs  # prefill and step graphs: every layer
    names = [e.name for e in prof.events()]
    assert names.count("posenc::rope_append_kv") == NEW * layers
    assert not any(n.startswith("posenc::qk_norm_rope") for n in names)
    assert torch.equal(got_tokens, tokens)
    for got, want in zip(got_cache.layers, want_cache.layers):
        assert int(got.cumulative_length) == int(want.cumulative_length) == PROMPT + NEW - 1
        torch.testing.assert_close(got.keys, want.keys, **TOL)
        torch.testing.assert_close(got.values, want.values, **TOL)


def test_sliding_layers_keep_their_path(counted):
    """A StaticSlidingWindowLayer keeps qk_norm_rope + its own update; the full layer beside
    it takes rope_append_kv."""
    model = tiny_qwen3(use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"])
    ids = torch.randint(2, 128, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    tokens, want_cache = generate(model, ids, static_cache(model))
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        got_tokens, got_cache = generate(model, ids, static_cache(model))
    finally:
        integration.revert_posenc_qk_norm(model)
    assert [type(layer).__name__ for layer in got_cache.layers] == ["StaticLayer", "StaticSlidingWindowLayer"]
    assert counted == {"rope_append_kv": NEW, "qk_norm_rope": NEW}
    assert torch.equal(got_tokens, tokens)
    for got, want in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(got.keys, want.keys, **TOL)
        torch.testing.assert_close(got.values, want.values, **TOL)


def test_dynamic_cache_keeps_its_path(counted):
    model = tiny_qwen3()
    ids = torch.randint(2, 128, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    tokens, _ = generate(model, ids, transformers.DynamicCache(config=model.config))
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        got_tokens, got_cache = generate(model, ids, transformers.DynamicCache(config=model.config))
    finally:
        integration.revert_posenc_qk_norm(model)
    assert type(got_cache) is transformers.DynamicCache
    assert counted["rope_append_kv"] == 0 and counted["qk_norm_rope"] == NEW * model.config.num_hidden_layers
    assert torch.equal(got_tokens, tokens)


def test_static_cache_under_autograd_keeps_its_path(counted):
    """rope_append_kv has no autograd: a forward that records gradients takes qk_norm_rope and
    the cache's own update, with the same cache rows."""
    model = tiny_qwen3()
    ids = torch.randint(2, 128, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    want_cache = static_cache(model)
    with torch.no_grad():
        want = model(ids, cache=want_cache).logits
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        cache = static_cache(model)
        got = model(ids, cache=cache).logits
    finally:
        integration.revert_posenc_qk_norm(model)
    assert got.requires_grad and counted == {"rope_append_kv": 0, "qk_norm_rope": model.config.num_hidden_layers}
    torch.testing.assert_close(got.detach(), want, **TOL)
    for got_layer, want_layer in zip(cache.layers, want_cache.layers):
        torch.testing.assert_close(got_layer.keys.detach(), want_layer.keys, **TOL)
