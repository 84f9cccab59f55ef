"""apply_posenc_rope(model, qk_norm=True) on every call path (issue 34, items 2 and 3).

Tiny random float32 models built from configs (no downloads), with non-trivial norm weights:
a patched attention layer called without position_ids (and with them) gives the unpatched
layer's output; full forwards and greedy generations equal the unpatched model's; nothing a
patched layer computes with leaks out of its call: not after an exception inside it, not into
another model running in another thread, not after revert (revert leaves transformers' own
module untouched, so the plain patch works afterwards, and each of the two routes can be
reverted without breaking the other). Tolerance: rtol = atol = 1e-5 where posenc computes
(the fused op rounds once in float32 where transformers rounds after each step), exact where
transformers' own code runs on both sides. transformers is pinned (requirements-peers.txt):
every model here builds."""

import copy
import io
import importlib
import inspect
import pickle
import threading
import types
import warnings

import pytest
import torch

import posenc

transformers = pytest.importorskip("transformers")
from posenc.integrations import transformers as integration  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention",
                                                                                          "full_attention"])),
    "olmo2": ("Olmo2Config", {}),
}


def tiny_model(model_type="qwen3", seed=0, dtype=torch.float32, **overrides):
    name, extra = CONFIGS[model_type]
    config_class = getattr(transformers, name)
    torch.manual_seed(seed)
    config = config_class(**{**COMMON, **extra, **overrides})
    config.pad_token_id = 0
    # .eval(): the state from_pretrained leaves a model in (these random models stand in for
    # loaded ones, which no test can download); the training-mode runs are separate tests.
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # non-trivial norm weights (they start at 1, or at 0 for Gemma's 1 + w)
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(-0.5, 0.5) if model_type == "gemma3_text" else p.uniform_(0.5, 1.5)
    return model


def ids(batch, seq, seed=1):
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, tokens, **kwargs):
    return model(tokens, **kwargs).logits


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts posenc.functional.qk_norm_rope calls (the fused path)."""
    calls = []
    original = posenc.functional.qk_norm_rope
    monkeypatch.setattr(posenc.functional, "qk_norm_rope", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


@pytest.fixture(autouse=True)
def unpatched_after():
    yield
    integration.revert_posenc_rope()


def attention_inputs(model, seq, seed=2):
    """Layer 0's attention, hidden states (2, seq, hidden), position_ids (1, seq) offset by 3
    and the (cos, sin) the model computes from them."""
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(2, seq, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    positions = (torch.arange(seq) + 3).unsqueeze(0)
    rotary = model.model.rotary_emb
    extra = (attn.layer_type,) if "layer_type" in inspect.signature(rotary.forward).parameters else ()
    with torch.no_grad():
        cos_sin = rotary(hidden, positions, *extra)
    return attn, hidden, positions, cos_sin


def grads(attn, hidden, cos_sin, **kwargs):
    """The gradients of the layer's projections and norm weights for one call."""
    attn.zero_grad(set_to_none=True)
    out, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, **kwargs)
    out.square().mean().backward()
    return {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_layer_without_and_with_position_ids_matches_unpatched(model_type, fused_calls):
    """On 32923aa the call without position_ids skipped both norms (Qwen3: 0.02 off)."""
    model = tiny_model(model_type)
    attn, hidden, positions, cos_sin = attention_inputs(model, 9)
    with torch.no_grad():
        want, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None)
        want_with, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
    torch.testing.assert_close(want_with, want, rtol=0, atol=0)  # transformers ignores position_ids here
    want_grads = grads(attn, hidden, cos_sin)
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        with torch.no_grad():
            got, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None)
            assert not fused_calls  # no positions: the layer's own norms, then posenc's rotation
            got_with, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
            assert len(fused_calls) == 1
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_with, want, **TOL)
        for kwargs in ({}, dict(position_ids=positions)):
            got_grads = grads(attn, hidden, cos_sin, **kwargs)
            assert got_grads.keys() == want_grads.keys() and len(want_grads) == 6  # q, k, v, o, q_norm, k_norm
            for n in want_grads:
                torch.testing.assert_close(got_grads[n], want_grads[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
        assert len(fused_calls) == 2
    finally:
        integration.revert_posenc_qk_norm(model)
    with torch.no_grad():
        back, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None)
    torch.testing.assert_close(back, want, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_missing_position_embeddings_is_a_clear_error(model_type):
    """On 32923aa: a TypeError from unpacking None (or a missing positional argument)."""
    model = tiny_model(model_type)
    attn, hidden, positions, _ = attention_inputs(model, 5)
    integration.apply_posenc_rope(model, qk_norm=True)
    with pytest.raises(ValueError, match="missing argument position_embeddings"):
        attn(hidden, position_embeddings=None, attention_mask=None, position_ids=positions)


def test_model_forward_and_greedy_generate_match_unpatched(fused_calls):
    """Forward with and without explicit position_ids, left-padded batch, and generate with
    the KV cache. (A regression guard: 32923aa was right on these paths.)"""
    model = tiny_model("qwen3")
    tokens = ids(2, 11)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding: position_ids from the mask, not the cache positions
    explicit = (torch.arange(11) + 5).expand(2, 11)
    want = logits(model, tokens)
    want_explicit = logits(model, tokens, position_ids=explicit)
    generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want_tokens = model.generate(tokens, attention_mask=mask, **generate)
    integration.apply_posenc_rope(model, qk_norm=True)
    got = logits(model, tokens)
    assert len(fused_calls) == model.config.num_hidden_layers
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(logits(model, tokens, position_ids=explicit), want_explicit, **TOL)
    del fused_calls[:]
    with torch.no_grad():
        got_tokens = model.generate(tokens, attention_mask=mask, **generate)
    assert len(fused_calls) >= 6 * model.config.num_hidden_layers  # prefill + one call per new token
    assert torch.equal(got_tokens, want_tokens)


def test_an_exception_inside_a_patched_layer_leaks_nothing():
    """On 32923aa the failed call left _CURRENT set: the second, unpatched model then ran
    with the first model's norm weights and positions (its logits off by ~0.07)."""
    first, second = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
    tokens = ids(1, 10)
    want_first, want_second = logits(first, tokens), logits(second, tokens)
    integration.apply_posenc_rope(first, qk_norm=True)

    def fail(module, args, output):
        raise RuntimeError("raised inside the patched attention")

    handle = first.model.layers[0].self_attn.k_proj.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="raised inside the patched attention"):
        logits(first, tokens)
    handle.remove()
    torch.testing.assert_close(logits(second, tokens), want_second, rtol=0, atol=0)
    torch.testing.assert_close(logits(first, tokens), want_first, **TOL)


def test_two_patched_models_in_two_threads():
    """Both threads meet inside their layer 0 attention (a barrier in a q_proj hook), after
    the layer's pre-hooks ran and before its rotation. On 32923aa each read the positions and
    norms the other thread had put in _CURRENT: a shape error (7 vs 12 tokens) or wrong numbers."""
    models = [tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)]
    inputs = [ids(2, 7, seed=3), ids(1, 12, seed=4)]
    wants = [logits(m, x) for m, x in zip(models, inputs)]
    for model in models:
        integration.apply_posenc_rope(model, qk_norm=True)
    rounds = 4
    barrier = threading.Barrier(2, timeout=60)

    def meet(module, args, output):
        barrier.wait()

    for model in models:
        model.model.layers[0].self_attn.q_proj.register_forward_hook(meet)
    results = [[], []]
    errors = []

    def run(i):
        try:
            for _ in range(rounds):
                results[i].append(logits(models[i], inputs[i]))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "the threads did not finish in 120 s"
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == rounds
        for got in results[i]:
            torch.testing.assert_close(got, wants[i], **TOL)


def test_revert_while_a_patched_layer_runs():
    """revert_posenc_qk_norm gives the layer its class back while a call is inside it (another
    thread's revert; here a q_proj hook): the call finishes with the settings it started with
    (it read them through self: AttributeError '_posenc_norm'), and a call of the patched
    forward on a reverted layer runs the layer's own."""
    model = tiny_model("qwen3")
    tokens = ids(2, 7)
    want = logits(model, tokens)
    integration.apply_posenc_rope(model, qk_norm=True)
    attn = model.model.layers[0].self_attn
    reverted = []

    def revert_once(module, args, output):
        if not reverted:
            integration.revert_posenc_qk_norm(model)
            reverted.append(True)

    handle = attn.q_proj.register_forward_hook(revert_once)
    got = logits(model, tokens)
    handle.remove()
    assert reverted and not isinstance(attn, integration._PosencQKNormAttention)
    torch.testing.assert_close(got, want, **TOL)
    attn, hidden, positions, cos_sin = attention_inputs(model, 5)
    with torch.no_grad():
        plain, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
        late, _ = integration._PosencQKNormAttention.forward(attn, hidden, cos_sin, None, position_ids=positions)
    assert torch.equal(late, plain)


def test_revert_then_the_plain_patch(monkeypatch):
    """On 32923aa revert_posenc_qk_norm left the modeling module's wrapper installed, and
    apply_posenc_rope(model) then raised RuntimeError ("routed through qk_norm_rope")."""
    model = tiny_model("qwen3")
    attn = model.model.layers[0].self_attn
    module = importlib.import_module(type(attn).__module__)
    original_function, original_class = module.apply_rotary_pos_emb, type(attn)
    tokens = ids(2, 9)
    want = logits(model, tokens)
    integration.apply_posenc_rope(model, qk_norm=True)
    assert isinstance(attn, original_class)
    integration.revert_posenc_qk_norm(model)
    calls = []
    original = posenc.functional.apply_rope_cos_sin
    monkeypatch.setattr(posenc.functional, "apply_rope_cos_sin", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    assert integration.apply_posenc_rope(model) is model and integration.is_patched(model)
    got = logits(model, tokens)
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(got, want, **TOL)
    integration.revert_posenc_rope(model)
    assert module.apply_rotary_pos_emb is original_function and type(attn) is original_class
    torch.testing.assert_close(logits(model, tokens), want, rtol=0, atol=0)


def test_revert_then_qk_norm_again(fused_calls):
    model = tiny_model("qwen3")
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    original_function = module.apply_rotary_pos_emb
    tokens = ids(2, 9)
    want = logits(model, tokens)
    for _ in range(2):
        integration.apply_posenc_rope(model, qk_norm=True)
        integration.apply_posenc_rope(model, qk_norm=True)  # twice: a no-op
        assert module.apply_rotary_pos_emb is original_function  # the qk-norm route leaves the module alone
        del fused_calls[:]
        torch.testing.assert_close(logits(model, tokens), want, **TOL)
        assert len(fused_calls) == model.config.num_hidden_layers
        integration.revert_posenc_qk_norm(model)
        del fused_calls[:]
        torch.testing.assert_close(logits(model, tokens), want, rtol=0, atol=0)
        assert not fused_calls


def test_the_plain_patch_reverted_under_a_qk_norm_model(fused_calls):
    """The per-type patch, then the qk-norm patch of one model, then the per-type patch
    reverted. On 32923aa that revert put transformers' function back over the qk-norm wrapper:
    the qk-norm model then ran with identity norms (wrong logits, no error)."""
    model, other = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    tokens = ids(2, 9)
    want, want_other = logits(model, tokens), logits(other, tokens)
    integration.apply_posenc_rope("qwen3")
    integration.apply_posenc_rope(model, qk_norm=True)
    del fused_calls[:]
    torch.testing.assert_close(logits(model, tokens), want, **TOL)
    assert len(fused_calls) == model.config.num_hidden_layers  # both patches on: still fused
    torch.testing.assert_close(logits(other, tokens), want_other, **TOL)  # through the per-type patch
    integration.revert_posenc_rope("qwen3")
    del fused_calls[:]
    torch.testing.assert_close(logits(model, tokens), want, **TOL)
    assert len(fused_calls) == model.config.num_hidden_layers
    torch.testing.assert_close(logits(other, tokens), want_other, rtol=0, atol=0)
    integration.revert_posenc_qk_norm(model)
    torch.testing.assert_close(logits(model, tokens), want, rtol=0, atol=0)


def test_copies_and_pickles_stay_patched(fused_calls):
    model = tiny_model("qwen3")
    tokens = ids(1, 8)
    want = logits(model, tokens)
    integration.apply_posenc_rope(model, qk_norm=True)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        del fused_calls[:]
        torch.testing.assert_close(logits(twin, tokens), want, **TOL)
        assert len(fused_calls) == model.config.num_hidden_layers
        integration.revert_posenc_qk_norm(twin)
        assert type(twin.model.layers[0].self_attn) is type(tiny_model("qwen3").model.layers[0].self_attn)
        torch.testing.assert_close(logits(twin, tokens), want, rtol=0, atol=0)
    # A layer pickled by posenc before 2026-12-06 holds its settings as a plain tuple, without
    # the buffer's copy: it runs its own path, as an unfusable layer does, instead of failing.
    old = pickle.loads(pickle.dumps(model))
    for layer in old.model.layers:
        settings = tuple(layer.self_attn._posenc_fused)
        layer.self_attn._posenc_fused = settings[:6] + settings[7:]
    del fused_calls[:]
    torch.testing.assert_close(logits(old, tokens), want, **TOL)
    assert not fused_calls
    # The buffer edited in place after patching, then the model copied: the copies' buffers
    # start new version counters, and they fused with the frequencies checked at patching (0.23
    # off). They see the edit as the model does: their layers run their own path.
    edited = copy.deepcopy(model)
    integration.revert_posenc_qk_norm(edited)
    with torch.no_grad():
        for m in (model, edited):
            m.model.rotary_emb.inv_freq.mul_(0.25)
    want_edited = logits(edited, tokens)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (model, copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        del fused_calls[:]
        torch.testing.assert_close(logits(twin, tokens), want_edited, **TOL)
        assert not fused_calls


@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=16),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    dict(rope_type="yarn", factor=None, original_max_position_embeddings=8),  # factor from the config: 32 / 8
    dict(rope_type="dynamic", factor=2.0),
    dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=16),
], ids=["linear", "llama3", "yarn", "yarn_factor_from_config", "dynamic", "longrope"])
def test_rope_scaling_types(rope, fused_calls):
    """The fused path for tables that depend on positions and config only; "dynamic" and
    "longrope" (transformers' tables change with the call's length and the rotary module's
    history) rotate with the model's own (cos, sin)."""
    model = tiny_model("qwen3", rope_parameters=dict(rope, rope_theta=10000.0), max_position_embeddings=32)
    tokens = ids(2, 40)  # beyond max_position_embeddings
    want_long, want_short = logits(model, tokens), logits(model, tokens[:, :6])
    integration.apply_posenc_rope(model, qk_norm=True)
    got_long, got_short = logits(model, tokens), logits(model, tokens[:, :6])
    fused = rope["rope_type"] not in ("dynamic", "longrope")
    assert len(fused_calls) == (2 * model.config.num_hidden_layers if fused else 0)
    torch.testing.assert_close(got_long, want_long, **TOL)
    torch.testing.assert_close(got_short, want_short, **TOL)


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2"])
def test_training_mode_with_attention_dropout_matches_unpatched(model_type, fused_calls):
    """A fine-tuning user's state: train mode, attention dropout on. The same seed gives the
    same dropout masks on both sides, so logits and every gradient agree."""
    model = tiny_model(model_type, attention_dropout=0.1)
    model.train()
    tokens = ids(2, 9)

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        out = model(tokens, labels=tokens)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_logits, want_grads = step()
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        got_logits, got_grads = step()
    finally:
        integration.revert_posenc_qk_norm(model)
    assert len(fused_calls) == model.config.num_hidden_layers
    torch.testing.assert_close(got_logits, want_logits, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    # Dropout was on: the same seed again gives the same logits, another seed others.
    torch.manual_seed(8)
    assert not torch.equal(model(tokens).logits.detach(), want_logits)


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2"])
def test_autocast_training_matches_unpatched(model_type, fused_calls):
    """Mixed precision (torch.autocast to bfloat16, float32 weights). Qwen3's norms multiply by
    float32 weights and its rotation by float32 tables, so its q and k are float32: the fused
    op returned bfloat16 (logits 5e-3 off, gradients 9e-3); such a call now takes the layer's
    own norms and the given tables, cast as transformers casts them. OLMo 2's norm and rotation
    cast back to q's dtype: it fuses (its rotary's tables are float32 for any model dtype, which
    the first version took for a promotion: a bfloat16 OLMo 2 never fused), to bfloat16
    rounding, its cache in transformers' dtype."""
    model = tiny_model(model_type).train()
    tokens = ids(2, 9)
    layers = model.config.num_hidden_layers

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            out = model(tokens, labels=tokens, use_cache=True)
        out.loss.backward()
        cached = [layer.keys.dtype for layer in out.past_key_values.layers]
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, cached

    want_logits, want_grads, want_cached = step()
    integration.apply_posenc_rope(model, qk_norm=True)
    try:
        got_logits, got_grads, got_cached = step()
        assert len(fused_calls) == (layers if model_type == "olmo2" else 0)
        # The cache holds keys in transformers' dtype (OLMo 2's rotation casts back to
        # bfloat16: a float32 cache took twice the memory; Qwen3's promotes to float32).
        assert got_cached == want_cached, (got_cached, want_cached)
        del fused_calls[:]
        model(tokens)  # without autocast: fused
        assert len(fused_calls) == layers
    finally:
        integration.revert_posenc_qk_norm(model)
    if model_type == "olmo2":  # a bfloat16 model (its checkpoints' dtype) fuses too
        bf16 = tiny_model(model_type, dtype=torch.bfloat16)  # as from_pretrained(dtype=...) loads it
        integration.apply_posenc_rope(bf16, qk_norm=True)
        try:
            del fused_calls[:]
            bf16(tokens)
            assert len(fused_calls) == layers
        finally:
            integration.revert_posenc_qk_norm(bf16)
    if model_type == "olmo2":
        # Fused: one rounding to bfloat16 where transformers rounds after the norm and after
        # the rotation (the gradients differ likewise).
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-2)
        # Gradients: within 8 bfloat16 ulps (2**-7 relative each) of each one's largest value
        # (seen: up to 2.3 here; oneDNN's bfloat16 matmuls differ between CPUs: the margin).
        assert got_grads.keys() == want_grads.keys()
        for n in want_grads:
            bound = 8 * 2**-7 * float(want_grads[n].abs().max())
            torch.testing.assert_close(got_grads[n], want_grads[n], rtol=0, atol=bound, msg=lambda m, n=n: f"{n}: {m}")
        return
    torch.testing.assert_close(got_logits, want_logits, **TOL)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_gemma3_multimodal(fused_calls):
    """model_type "gemma3" (Gemma3ForConditionalGeneration): the text model's attention is
    patched (the vision tower's has no q_norm), text-only and with an image."""
    text = dict(COMMON, vocab_size=300, **CONFIGS["gemma3_text"][1])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()  # as from_pretrained leaves it
    assert model.config.model_type == "gemma3"
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(-0.5, 0.5)
    text_ids = ids(2, 9)
    image_ids = torch.tensor([[5, 297] + [299] * 4 + [298, 7, 8]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(5))
    want_text, want_image = logits(model, text_ids), logits(model, image_ids, pixel_values=pixels)
    integration.apply_posenc_rope(model, qk_norm=True)
    torch.testing.assert_close(logits(model, text_ids), want_text, **TOL)
    torch.testing.assert_close(logits(model, image_ids, pixel_values=pixels), want_image, **TOL)
    assert len(fused_calls) == 2 * config.text_config.num_hidden_layers
    integration.revert_posenc_qk_norm(model)
    torch.testing.assert_close(logits(model, text_ids), want_text, rtol=0, atol=0)


def test_int32_position_ids_fall_back_to_the_layers_own_path(fused_calls):
    """transformers' attention takes position_ids of any integer dtype; the fused op takes
    int64, so int32 ones take the layer's norms and posenc's rotation of the given (cos, sin)."""
    model = tiny_model("qwen3")
    attn, hidden, positions, cos_sin = attention_inputs(model, 6)
    with torch.no_grad():
        want, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None)
    integration.apply_posenc_rope(model, qk_norm=True)
    with torch.no_grad():
        got, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions.int())
    assert not fused_calls
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "gemma3_text"])
def test_a_config_key_the_models_rotary_ignores(model_type, fused_calls):
    """partial_rotary_factor with the default RoPE: Qwen3's, OLMo 2's and Gemma 3's rotary
    embeddings turn the whole head_dim whatever it says. The fused path used to turn half of
    it (logits 0.25 off, other greedy tokens); the patch now checks the config it parsed
    against the model's own inv_freq, and fuses the configuration that matches it."""
    if model_type == "gemma3_text":
        rope = dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                    full_attention=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5))
    else:
        rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    model = tiny_model(model_type, rope_parameters=rope)
    tokens = ids(2, 12)
    want = logits(model, tokens)
    integration.apply_posenc_rope(model, qk_norm=True)
    torch.testing.assert_close(logits(model, tokens), want, **TOL)
    assert len(fused_calls) == model.config.num_hidden_layers


def test_a_nested_yarn_dict_read_as_transformers_reads_it(fused_calls):
    """Gemma 3 with a yarn dict per layer type and truncate=False: transformers reads truncate
    from the outer dict (True), so the model's frequencies are truncate=True's (posenc's from
    the layer's dict were 19% off: logits 0.017 off). Not the configuration the model turns
    by: the layer rotates with its given tables."""
    rope = dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64,
                                    truncate=False))
    model = tiny_model("gemma3_text", rope_parameters=rope, head_dim=64)
    tokens = ids(2, 40)
    want = logits(model, tokens)
    integration.apply_posenc_rope(model, qk_norm=True)
    torch.testing.assert_close(logits(model, tokens), want, **TOL)


def test_rotary_buffers_cast_replaced_or_edited_after_patching(fused_calls):
    """transformers turns by the rotary module's inv_freq as it is: rounded to bfloat16 by
    model.to(torch.bfloat16), edited in place, replaced. The fused path (frequencies from the
    config) used to ignore that: 0.95 off in a bfloat16 layer's output at positions 2000+, logits
    0.2 off after an edit. Now a layer fuses only while its rotary module holds the buffer that
    was checked when it was patched, unedited; otherwise it rotates with the given tables."""
    model = tiny_model("qwen3", max_position_embeddings=4096)
    unpatched = copy.deepcopy(model)
    integration.apply_posenc_rope(model, qk_norm=True)
    tokens = ids(2, 8)
    torch.testing.assert_close(logits(model, tokens), logits(unpatched, tokens), **TOL)
    assert len(fused_calls) == 2
    # A bfloat16 cast after patching: the rounded frequencies, as the unpatched model.
    model.to(torch.bfloat16), unpatched.to(torch.bfloat16)
    attn, hidden, _, _ = attention_inputs(model, 8)
    hidden = hidden.to(torch.bfloat16)
    positions = (torch.arange(8) + 2000).unsqueeze(0)
    cos_sin = model.model.rotary_emb(hidden, positions)
    with torch.no_grad():
        got, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
        want, _ = unpatched.model.layers[0].self_attn(hidden, position_embeddings=cos_sin, attention_mask=None,
                                                      position_ids=positions)
    assert len(fused_calls) == 2
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)  # bfloat16 roundings; the bug: 0.95
    # A float32 model whose inv_freq is edited in place, or replaced, or whose attention
    # scaling is set, after patching (the last was fused with the checked one: logits 0.26 off).
    for edit in ("in place", "replaced", "attention_scaling"):
        model = tiny_model("qwen3")
        integration.apply_posenc_rope(model, qk_norm=True)
        rotary = model.model.rotary_emb
        if edit == "in place":
            rotary.inv_freq.mul_(0.25)
        elif edit == "replaced":
            rotary.inv_freq = rotary.inv_freq * 0.25
        else:
            rotary.attention_scaling = 2.0
        fused_calls.clear()
        got = logits(model, tokens)
        integration.revert_posenc_qk_norm(model)
        torch.testing.assert_close(got, logits(model, tokens), **TOL)
        assert not fused_calls, edit
    # Patched when already bfloat16: nothing to fuse (the model's frequencies are not posenc's).
    model = tiny_model("qwen3").to(torch.bfloat16)
    want = logits(model, tokens)
    integration.apply_posenc_rope(model, qk_norm=True)
    torch.testing.assert_close(logits(model, tokens), want, rtol=0.02, atol=0.02)
    assert not fused_calls


def test_a_rotary_module_replaced_or_hooked_or_norm_eps_edited_after_patching(fused_calls):
    """The fused path checked the rotary module it found when patching, not the one the model
    holds at the call, and never the norms' eps again: a rotary module put in the model's
    place (another rope_theta: logits 0.15 off), a forward hook on it (tables halved: 0.36)
    and an edited variance_epsilon (0.49) were ignored (found by a review). Such layers now run
    their own path (the tables they are given, their own norms), as the unpatched model does."""
    tokens = ids(2, 8)
    for case in ("rotary replaced", "rotary hooked", "eps edited"):
        model = tiny_model("qwen3")
        unpatched = copy.deepcopy(model)
        integration.apply_posenc_rope(model, qk_norm=True)
        assert logits(model, tokens) is not None and len(fused_calls) == 2  # fused until the change
        for m in (model, unpatched):
            if case == "rotary replaced":
                config = copy.deepcopy(m.config)
                config.rope_parameters = dict(config.rope_parameters, rope_theta=1e6)
                m.model.rotary_emb = type(m.model.rotary_emb)(config)
            elif case == "rotary hooked":
                m.model.rotary_emb.register_forward_hook(lambda module, args, out: tuple(t * 0.5 for t in out))
            else:
                for layer in m.model.layers:
                    layer.self_attn.q_norm.variance_epsilon = layer.self_attn.k_norm.variance_epsilon = 0.5
        fused_calls.clear()
        got, want = logits(model, tokens), logits(unpatched, tokens)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, case=case: f"{case}: {m}")
        assert not fused_calls, case
    # The layer holds its model weakly: a copy of one layer alone points at the original model,
    # whose rotary module is not the copy's (it runs its own path), and the copy is the layer's
    # size, not the model's.
    model = tiny_model("qwen3")
    integration.apply_posenc_rope(model, qk_norm=True)
    layer = copy.deepcopy(model.model.layers[0])
    assert sum(p.numel() for p in layer.parameters()) == sum(p.numel() for p in model.model.layers[0].parameters())
    attn, hidden, positions, cos_sin = attention_inputs(model, 8)
    fused_calls.clear()
    with torch.no_grad():
        got, _ = layer.self_attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
        want, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
    torch.testing.assert_close(got, want, **TOL)
    assert len(fused_calls) == 1  # the model's own layer only


def test_a_norm_or_rotary_forward_replaced_is_run(fused_calls, monkeypatch):
    """The fused path computes the norms and the tables itself: a forward set on a norm or on
    the rotary module (a common hack for context extension), or assigned to the norm class,
    was never called (logits 0.07-0.21 off the unpatched model with the same edit; found by
    an audit). Such layers now run their own path, as the unpatched model does; a class's
    forward replaced before patching leaves the layers unfused from the start."""
    tokens = ids(2, 8)
    norm_class = type(tiny_model("qwen3").model.layers[0].self_attn.q_norm)
    original_norm = norm_class.forward
    for case in ("norm instance", "rotary instance", "norm class"):
        model = tiny_model("qwen3")
        unpatched = copy.deepcopy(model)
        integration.apply_posenc_rope(model, qk_norm=True)
        fused_calls.clear()
        assert logits(model, tokens) is not None and len(fused_calls) == 2  # fused until the change
        for m in (model, unpatched):
            if case == "norm instance":
                norm = m.model.layers[0].self_attn.q_norm
                norm.forward = types.MethodType(lambda self, x: original_norm(self, x) * 2.0, norm)
            elif case == "rotary instance":
                rotary = m.model.rotary_emb
                rotary.forward = (lambda forward: lambda x, position_ids: forward(x, position_ids * 2))(rotary.forward)
        if case == "norm class":
            monkeypatch.setattr(norm_class, "forward", lambda self, x: original_norm(self, x) * 0.5)
        fused_calls.clear()
        got, want = logits(model, tokens), logits(unpatched, tokens)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, case=case: f"{case}: {m}")
        assert len(fused_calls) == (1 if case == "norm instance" else 0), case  # layer 1 keeps its own norm
        if case == "norm class":  # patched while the class's forward is not its own: never fused
            again = tiny_model("qwen3")
            integration.apply_posenc_rope(again, qk_norm=True)
            fused_calls.clear()
            logits(again, tokens)
            assert not fused_calls
            monkeypatch.undo()


def test_a_hook_present_when_patched_stops_fusing_only_while_it_is_there(fused_calls):
    """Hooks are looked at per call: a norm hooked while the model is patched runs its own
    path until the hook goes, then fuses (the check of replaced forwards at patching must not
    take the hooks with it; found by a review of that change)."""
    model = tiny_model("qwen3")
    handle = model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda module, args, out: None)
    integration.apply_posenc_rope(model, qk_norm=True)
    fused_calls.clear()
    logits(model, ids(2, 8))
    assert len(fused_calls) == 1  # layer 0 runs its own norms while hooked
    handle.remove()
    fused_calls.clear()
    logits(model, ids(2, 8))
    assert len(fused_calls) == 2


def test_a_forward_set_on_an_instance_when_patched_stops_fusing_only_while_it_is_there(fused_calls):
    """As hooks: a forward set on a norm's or the rotary module's instance is looked at per call
    (one check, _fused_arguments): the layer runs its own path while it is there and fuses
    once it is deleted (the check at patching also left such a layer unfused for good)."""
    tokens = ids(2, 8)
    for which in ("norm", "rotary"):
        model = tiny_model("qwen3")
        unpatched = copy.deepcopy(model)
        module = model.model.layers[0].self_attn.q_norm if which == "norm" else model.model.rotary_emb
        module.forward = module.forward  # the class's forward, set on the instance
        integration.apply_posenc_rope(model, qk_norm=True)
        fused_calls.clear()
        torch.testing.assert_close(logits(model, tokens), logits(unpatched, tokens), **TOL)
        assert len(fused_calls) == (1 if which == "norm" else 0), which
        del module.forward
        fused_calls.clear()
        torch.testing.assert_close(logits(model, tokens), logits(unpatched, tokens), **TOL)
        assert len(fused_calls) == 2, which


def test_a_hook_on_the_kernels_rotation_or_its_private_copy_is_seen(fused_calls):
    """With the kernels package (transformers 5.25 requires it), the model's rotation is a
    module call, routed through each attention layer's private copy of the module: a hook on
    either (changing the output here) runs as in the unpatched model, and the layer does not
    fuse while it is there (a hook on the private copy was missed by a first version)."""
    rotation = importlib.import_module("transformers.models.qwen3.modeling_qwen3").apply_rotary_pos_emb
    if not isinstance(rotation, torch.nn.Module):
        pytest.skip("transformers runs without the kernels package here: its rotation is a function")

    def scale(module, args, output):
        return tuple(t * 1.25 for t in output)

    tokens = ids(2, 8)
    for which in ("global", "private"):
        model = tiny_model("qwen3")
        unpatched = copy.deepcopy(model)
        integration.apply_posenc_rope(model, qk_norm=True)
        if which == "global":
            handles = [rotation.register_forward_hook(scale)]
        else:
            handles = [m.model.layers[0].self_attn._kernel_funcs["rotary_pos_emb"].register_forward_hook(scale)
                       for m in (model, unpatched)]
        fused_calls.clear()
        try:
            got, want = logits(model, tokens), logits(unpatched, tokens)
        finally:
            for h in handles:
                h.remove()
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, which=which: f"{which}: {m}")
        assert len(fused_calls) == (0 if which == "global" else 1), which
        fused_calls.clear()
        logits(model, tokens)
        assert len(fused_calls) == 2, which  # fused again once the hook is gone


def test_a_forward_set_on_the_kernels_rotation_after_compiling_is_followed():
    """A forward set on the kernels rotation module after torch.compile: compiled code follows
    it (it guards the module's forward; it kept fusing, 0.11 off the unpatched model, in a
    first version). No call-counting wrapper here: one around the op changes what dynamo
    traces and guards."""
    rotation = importlib.import_module("transformers.models.qwen3.modeling_qwen3").apply_rotary_pos_emb
    if not isinstance(rotation, torch.nn.Module):
        pytest.skip("transformers runs without the kernels package here: its rotation is a function")
    tokens = ids(2, 8)
    model = tiny_model("qwen3")
    unpatched = copy.deepcopy(model)
    integration.apply_posenc_rope(model, qk_norm=True)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        before = compiled(tokens).logits
        rotation.forward = lambda *args: tuple(t * 1.25 for t in type(rotation).forward(rotation, *args))
        try:
            got, want = compiled(tokens).logits, unpatched(tokens).logits
        finally:
            del rotation.forward
    torch.testing.assert_close(got, want, **TOL)
    assert (got - before).abs().max() > 0.01


def test_compiled_patched_model_fuses_and_refuses_an_in_place_edit():
    """torch.compile of a patched model: the unpatched model's logits, through the fused op.
    An in-place edit of inv_freq after patching, which eager calls see by the buffer's version
    and answer with the layer's own path, is invisible to compiled code: it kept fusing the
    checked frequencies (logits 0.2 off, silently). Compiled calls now compare the buffer
    with the copy checked at patching and raise; replacing the buffer recompiles. Backend
    aot_eager: dynamo's graphs through AOTAutograd, without inductor's code generation (65 s
    of a cold CI for these compiled-integration tests; the ops' inductor lowering is tested
    with the ops, and inductor keeps torch._assert_async on the CPU: checked by hand)."""
    model = tiny_model("qwen3")
    unpatched = copy.deepcopy(model)
    integration.apply_posenc_rope(model, qk_norm=True)
    tokens = ids(2, 8)
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(logits(compiled, tokens), logits(unpatched, tokens), **TOL)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits(compiled, tokens)  # compiled already: the profile holds the graph's calls alone
    assert sum(e.name == "posenc::qk_norm_rope" for e in prof.events()) == 2  # both layers fused
    rotary = model.model.rotary_emb
    rotary.inv_freq.mul_(0.25)
    with pytest.raises(RuntimeError, match="inv_freq was edited in place after apply_posenc_rope"):
        logits(compiled, tokens)
    # Replaced instead (as the docs advise): compiled code sees it and turns as the model does.
    rotary.inv_freq = rotary.inv_freq.clone()
    unpatched.model.rotary_emb.inv_freq.mul_(0.25)
    torch.testing.assert_close(logits(compiled, tokens), logits(unpatched, tokens), **TOL)


def test_hooked_or_replaced_norms_run_as_the_model_runs_them(fused_calls):
    """The fused path reads q_norm's and k_norm's weights and never calls them: a forward hook
    on a norm (added after patching) stopped firing (logits 0.022 off, found by a review), and
    a norm replaced by another module (here a LayerNorm with a weight of the same shape, before
    or after patching) was computed as the model's RMS norm. Such layers now call their own
    norms (as PositionalEncoding calls a hooked dropout child); the others stay fused."""
    tokens = ids(2, 8)

    def scale(module, args, output):
        return output * 1.5

    hook_calls = []

    def record(module, args, output):
        hook_calls.append(type(module).__name__)

    for case in ("hook after patching", "global hook", "replaced after patching", "replaced before patching"):
        model = tiny_model("qwen3")
        unpatched = copy.deepcopy(model)
        attn, attn_unpatched = model.model.layers[0].self_attn, unpatched.model.layers[0].self_attn
        handles = []
        if case == "replaced before patching":
            for m in (attn, attn_unpatched):
                m.k_norm = torch.nn.LayerNorm(16, eps=1e-6)
        integration.apply_posenc_rope(model, qk_norm=True)
        if case == "hook after patching":
            handles = [m.q_norm.register_forward_hook(scale) for m in (attn, attn_unpatched)]
        elif case == "replaced after patching":
            for m in (attn, attn_unpatched):
                m.q_norm = torch.nn.LayerNorm(16, eps=1e-6)
        fused_calls.clear()
        hook_calls.clear()
        try:
            if case == "global hook":
                handles = [torch.nn.modules.module.register_module_forward_hook(record)]
            got = logits(model, tokens)
            fired = list(hook_calls)
            want = logits(unpatched, tokens)
        finally:
            for h in handles:
                h.remove()
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, case=case: f"{case}: {m}")
        if case == "global hook":  # the modules' calls the unpatched model makes (projections first)
            assert sorted(fired) == sorted(hook_calls[len(fired):]) and fired.count("Qwen3RMSNorm") >= 4
            assert not fused_calls
        else:  # layer 0 runs its own norms; layer 1 stays fused
            assert len(fused_calls) == 1, case


def test_a_rotary_module_of_another_class_leaves_the_layers_unfused(fused_calls):
    """The fused op turns by the rotary module's checked buffer and drops the tables the layer
    receives: proven for the model's own rotary class only. A subclass with a learnable
    temperature (inv_freq unchanged, so the buffer check passed) fused: its parameter got no
    gradient, and once the temperature moved the logits differed by 0.06 (found by an audit).
    Now such a layer runs its norms and rotates with the tables it is given."""
    model = tiny_model("qwen3")
    base = type(model.model.rotary_emb)

    class LearnableTemperature(base):
        def __init__(self, config):
            super().__init__(config)
            self.temp = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, position_ids):  # differentiable tables (the parent's forward is no_grad)
            freqs = position_ids[..., None].float() * self.inv_freq * self.temp
            emb = torch.cat((freqs, freqs), -1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb = LearnableTemperature(model.config)
    tokens = ids(1, 6)

    def temp_grad():
        model.zero_grad(set_to_none=True)
        model(tokens).logits.square().sum().backward()
        return model.model.rotary_emb.temp.grad.clone()

    want = temp_grad()
    with torch.no_grad():
        model.model.rotary_emb.temp.fill_(1.5)
    want_logits = logits(model, tokens)
    with torch.no_grad():
        model.model.rotary_emb.temp.fill_(1.0)
    integration.apply_posenc_rope(model, qk_norm=True)
    torch.testing.assert_close(temp_grad(), want, **TOL)
    with torch.no_grad():
        model.model.rotary_emb.temp.fill_(1.5)
    torch.testing.assert_close(logits(model, tokens), want_logits, **TOL)
    assert not fused_calls


def test_a_key_the_type_does_not_read_patches_under_warnings_as_errors(fused_calls):
    """A stray scaling key beside the default RoPE (transformers ignores it): the patch's probe
    parse warned that it drops the key, and under a filter that raises warnings (-W error)
    apply_posenc_rope(qk_norm=True) raised at patching. The probe drops the keys the type does
    not read itself, as transformers does, and compares the frequencies with the model's."""
    model = tiny_model("qwen3", rope_parameters=dict(rope_type="default", rope_theta=10000.0, factor=1.0))
    tokens = ids(2, 12)
    want = logits(model, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.apply_posenc_rope(model, qk_norm=True)
    torch.testing.assert_close(logits(model, tokens), want, **TOL)
    assert len(fused_calls) == model.config.num_hidden_layers
