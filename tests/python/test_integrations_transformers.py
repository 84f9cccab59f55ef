"""posenc.integrations.transformers: tiny random models of each supported family give the same
logits, gradients and greedy generations with their apply_rotary_pos_emb routed through
posenc.functional.apply_rope_cos_sin as with transformers' own, and the patched models really
call posenc (counted). Without transformers, the integration's ImportError says what to install
(the tests skip without transformers).

Tolerance: the logits and gradients of a 2-layer float32 model, rtol = atol = 1e-5 (float32
rounding: the composite reproduces transformers' operations, a fused kernel rounds once).
test_integrations_no_transformers.py checks the ImportError without transformers."""

import importlib
import pathlib

import pytest
import torch

import posenc

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-5, atol=1e-5)

transformers = pytest.importorskip("transformers")
from posenc.integrations import transformers as integration  # noqa: E402

# Whether transformers runs with the kernels package (transformers 5.25 requires it): its
# rotation functions are then nn.Module instances (use_kernel_forward_from_hub). The suite runs
# as installed; test_the_integration_without_the_kernels_package runs its core again without.
KERNELS = isinstance(importlib.import_module("transformers.models.llama.modeling_llama").apply_rotary_pos_emb,
                     torch.nn.Module)
if __import__("os").environ.get("POSENC_TEST_HIDE_KERNELS") == "1":
    assert not KERNELS, "conftest's POSENC_TEST_HIDE_KERNELS did not hide the kernels package"

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=16),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16),
    # Gemma3ForCausalLM: sliding-window and global layers, each with its own rotary tables
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention"]),
    # Gemma3ForConditionalGeneration (text-only calls here), whose modeling module is gemma3_text's
    "gemma3": lambda: transformers.Gemma3Config(
        text_config=dict(COMMON, vocab_size=300, head_dim=16, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298),
    "granite": lambda: transformers.GraniteConfig(**COMMON),
    # partial rotary: the leading half of each 16-wide head (sliced before the call)
    "phi": lambda: transformers.PhiConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256,
                                          partial_rotary_factor=0.5),
    "starcoder2": lambda: transformers.Starcoder2Config(**COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
    "smollm3": lambda: transformers.SmolLM3Config(**COMMON),
    # partial rotary: 1/4 of each 16-wide head
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=256, rotary_pct=0.25),
    # partial rotary, adjacent pairs
    "gptj": lambda: transformers.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                            n_positions=256, bos_token_id=0, eos_token_id=1),
    # MLA (issue 39, item 4): the rotary part of each head (qk_rope_head_dim), adjacent pairs
    # (rope_interleave, the default) through apply_rotary_pos_emb_interleave.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256),
    # Single-tensor calls on the trailing rope slice of [nope | rope] heads, and the attention
    # output turned back with -sin; the compressors' RoPE at their window positions (rates small
    # enough to fire within the test's 13 tokens).
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        head_dim=32, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=8,
        partial_rotary_factor=0.5,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
}
# posenc calls per layer and forward: GPT-J rotates q and k in separate calls; DeepSeek V4
# rotates q, kv and the attention output (3), and its compressors more (at least 3: None).
CALLS_PER_LAYER = {"gptj": 2, "deepseek_v4": None}


def calls_match(count, layers, model_type, at_least=False):
    per_layer = CALLS_PER_LAYER.get(model_type, 1)
    if per_layer is None:
        return count >= 3 * layers
    return count >= layers * per_layer if at_least else count == layers * per_layer


def test_supported_model_types():
    assert set(integration.SUPPORTED_MODEL_TYPES) == set(CONFIGS)


def tiny_model(model_type):
    torch.manual_seed(0)
    config = CONFIGS[model_type]()
    config.pad_token_id = 0
    # Left in the training mode from_config gives (a user fine-tuning; the configs' dropouts
    # are 0, so generate's greedy tokens are deterministic too).
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.training
    assert model.config.model_type == model_type
    return model


@pytest.fixture
def count_posenc_calls(monkeypatch):
    """Counts calls of posenc.functional.apply_rope_cos_sin (what the patch must call)."""
    calls = []
    original = posenc.functional.apply_rope_cos_sin

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(posenc.functional, "apply_rope_cos_sin", counted)
    return calls


@pytest.fixture(autouse=True)
def unpatched_after():
    yield
    integration.revert_posenc_rope()


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_logits_gradients_and_generation_match(model_type, count_posenc_calls):
    model = tiny_model(model_type)
    ids = torch.randint(2, 128, (2, 13), generator=torch.Generator().manual_seed(1))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), out.loss.detach(), grads

    def generate():
        return model.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)

    logits, loss, grads = forward_backward()
    tokens = generate()
    assert not count_posenc_calls and not integration.is_patched(model)

    assert integration.apply_posenc_rope(model) is model
    assert integration.is_patched(model) and integration.is_patched(model_type)
    got_logits, got_loss, got_grads = forward_backward()
    layers = model.config.get_text_config().num_hidden_layers  # (gemma3: its text model's)
    assert calls_match(len(count_posenc_calls), layers, model_type), len(count_posenc_calls)
    torch.testing.assert_close(got_logits, logits, **TOL)
    torch.testing.assert_close(got_loss, loss, **TOL)
    assert got_grads.keys() == grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")

    del count_posenc_calls[:]
    got_tokens = generate()  # with the KV cache: prefill, then one token per step
    assert calls_match(len(count_posenc_calls), 8 * layers, model_type, at_least=True)
    assert got_tokens.shape == (1, 13)
    assert torch.equal(got_tokens, tokens)

    integration.revert_posenc_rope(model)
    assert not integration.is_patched(model_type)
    del count_posenc_calls[:]
    model(input_ids=ids)
    assert not count_posenc_calls


@pytest.mark.parametrize("model_type", ["llama", "gptj", "deepseek_v3", "deepseek_v4"])
def test_autocast_outputs_in_transformers_promoted_dtype(model_type):
    """Under torch.autocast q and k are bfloat16 and the rotary tables float32: transformers'
    rotation gives float32 (type promotion), posenc's op gave q's bfloat16. The replacements
    now cast first, so the patched model computes what the unpatched one does: the logits
    and loss agree to float32 rounding. (The gradients agree to bfloat16 rounding only:
    transformers' autograd rounds each of the rotation's two gradient terms to bfloat16 and
    sums them there; posenc sums in float32 and rounds once.)"""
    model = tiny_model(model_type)
    ids = torch.randint(2, 128, (2, 13), generator=torch.Generator().manual_seed(1))

    def forward():
        with torch.autocast("cpu", torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        return out.logits.detach().float(), out.loss.detach()

    logits, loss = forward()
    integration.apply_posenc_rope(model)
    got_logits, got_loss = forward()
    torch.testing.assert_close(got_logits, logits, **TOL)
    torch.testing.assert_close(got_loss, loss, **TOL)
    q = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    for out in integration.posenc_apply_rotary_pos_emb(q, q, cos, sin):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, q.float() * cos[:, None] + torch.cat([-q[..., 4:], q[..., :4]], -1) * sin[:, None],
                                   **TOL)
    # Each replacement returns the dtype transformers' own function does (DeepSeek V4's casts
    # back to x's: it was given float32, and the cat made the whole head float32).
    integration.revert_posenc_rope()
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    for name, replacement, _ in integration._PATCHES[model_type]:
        theirs = getattr(module, name)
        if model_type == "gptj":
            x, tables = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16), (torch.randn(1, 5, 4), torch.randn(1, 5, 4))
            args = (x, *tables)
        elif model_type == "deepseek_v4":
            x = torch.randn(1, 2, 5, 16, dtype=torch.bfloat16)
            args = (x, torch.randn(1, 5, 4), torch.randn(1, 5, 4))
        else:
            args = (q, q, cos, sin)
        want, got = theirs(*args), replacement(*args)
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert g.dtype == w.dtype, (name, g.dtype, w.dtype)


def test_compiled_patched_model_trains_as_the_unpatched_one():
    """torch.compile of a patched Llama (training mode, as fine-tuning runs it): the unpatched
    model's loss and gradients, with each layer's rotation inside a graph dynamo captured and
    the profiler counting posenc's op in a second, already compiled step. Backend aot_eager
    (test_integrations_transformers_qk_norm.py's compile test says why)."""
    model = tiny_model("llama")
    ids = torch.randint(2, 128, (2, 13), generator=torch.Generator().manual_seed(1))

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(model)
    integration.apply_posenc_rope(model)
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # the graphs dynamo captured
    compiled = torch.compile(model, backend=counter)
    step(compiled)  # compiles
    in_graphs = [sum("posenc.apply_rope_cos_sin" in str(n.target) for n in g.graph.nodes) for g in counter.graphs]
    assert sum(in_graphs) == model.config.num_hidden_layers, in_graphs  # each layer's rotation compiled
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got_loss, got_grads = step(compiled)
    # per layer, the forward and the backward (the same op with transpose=True)
    assert sum(e.name == "posenc::apply_rope_cos_sin" for e in prof.events()) == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(got_loss, loss, **TOL)
    assert got_grads.keys() == grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_patch_is_per_type_idempotent_and_reversible():
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    gptj = importlib.import_module("transformers.models.gptj.modeling_gptj")
    original, original_gptj = llama.apply_rotary_pos_emb, gptj.apply_rotary_pos_emb
    integration.apply_posenc_rope_to("llama")
    integration.apply_posenc_rope("llama")  # twice: still one saved original
    integration.apply_posenc_rope(transformers.GPTJConfig())
    # What the modeling module's call runs; with the kernels package (which transformers 5.25
    # installs) the functions are modules, and the patched ones stay modules of their class.
    assert integration._runs(llama.apply_rotary_pos_emb) is integration.posenc_apply_rotary_pos_emb
    assert integration._runs(gptj.apply_rotary_pos_emb) is integration.posenc_gptj_apply_rotary_pos_emb
    assert (llama.apply_rotary_pos_emb is original) == KERNELS  # kernels: the module stays, its forward changes
    integration.revert_posenc_rope("llama")
    assert llama.apply_rotary_pos_emb is original and integration.is_patched("gptj")
    integration.revert_posenc_rope()
    assert gptj.apply_rotary_pos_emb is original_gptj
    with integration.posenc_rope("qwen2") as handle:
        assert handle == "qwen2" and integration.is_patched("qwen2")
    assert not integration.is_patched("qwen2")
    integration.apply_posenc_rope("qwen2")
    with integration.posenc_rope("qwen2"):
        pass
    assert integration.is_patched("qwen2")  # patched before the block: left patched
    integration.apply_posenc_rope("gemma3_text")
    assert integration.is_patched("gemma3")  # one modeling module for both Gemma 3 types
    integration.revert_posenc_rope("gemma3")
    assert not integration.is_patched("gemma3_text")


def test_the_integration_without_the_kernels_package():
    """transformers without the kernels package (5.24 and earlier, or a --no-deps install):
    plain functions where 5.25 has modules. With kernels installed, the core tests again in a
    process that hides it (conftest's POSENC_TEST_HIDE_KERNELS); without it, this suite is that
    run already."""
    import os
    import subprocess
    import sys

    if not KERNELS:
        pytest.skip("transformers runs without the kernels package here: the suite itself covers it")
    env = dict(os.environ, POSENC_TEST_HIDE_KERNELS="1", OMP_NUM_THREADS="1")
    hidden = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['kernels'] = None; import torch; "
         "import transformers.models.llama.modeling_llama as m; print(type(m.apply_rotary_pos_emb).__name__)"],
        env=env, capture_output=True, text=True, timeout=300)
    assert hidden.stdout.strip() == "function", hidden.stderr[-2000:]
    tests = ["test_integrations_transformers.py::test_logits_gradients_and_generation_match",
             "test_integrations_transformers.py::test_patch_is_per_type_idempotent_and_reversible",
             "test_integrations_transformers.py::test_a_patch_after_compiling_is_seen_by_the_compiled_model",
             "test_integrations_transformers_qk_norm.py::test_hooked_or_replaced_norms_run_as_the_model_runs_them"]
    here = pathlib.Path(__file__).parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          *(str(here / t) for t in tests)], env=env, capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{len(CONFIGS) + 3} passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_revert_gives_a_kernels_module_its_own_forward_back():
    """With the kernels package, the patch sets posenc's function as the module's own forward;
    revert restores what the module had: no forward of its own, or the one it had (kernelize
    binds one), not posenc's and not none."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    rotation = llama.apply_rotary_pos_emb
    if not isinstance(rotation, torch.nn.Module):
        pytest.skip("transformers runs without the kernels package here: its rotation is a function")
    assert "forward" not in rotation.__dict__
    integration.apply_posenc_rope("llama")
    assert rotation.__dict__["forward"] is integration.posenc_apply_rotary_pos_emb
    integration.revert_posenc_rope("llama")
    assert "forward" not in rotation.__dict__ and llama.apply_rotary_pos_emb is rotation
    own = type(rotation).forward.__get__(rotation)  # a forward of its own, as kernelize binds one
    rotation.forward = own
    try:
        integration.apply_posenc_rope("llama")
        assert integration.is_patched("llama")
        integration.revert_posenc_rope("llama")
        assert rotation.__dict__["forward"] is own and not integration.is_patched("llama")
    finally:
        rotation.__dict__.pop("forward", None)


def test_a_patch_after_compiling_is_seen_by_the_compiled_model():
    """Code compiled before the patch (or the first of two models compiled before the second is
    patched) runs posenc after it, and transformers' rotation again after revert: with the
    kernels package, a copy of its module put in the modeling module's place was never seen by
    compiled code (dynamo guards the module's own forward, reached through kernels' wrapper of
    the attention's forward, not the modeling module's name): a silent miss found by a review."""
    model = tiny_model("llama")
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(model, backend="aot_eager")

    def run():
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = compiled(input_ids=ids).logits
        return out, sum(e.name == "posenc::apply_rope_cos_sin" for e in prof.events())

    want, calls = run()
    assert calls == 0
    integration.apply_posenc_rope(model)
    got, calls = run()
    assert calls > 0
    torch.testing.assert_close(got, want, **TOL)
    integration.revert_posenc_rope(model)
    got, calls = run()
    assert calls == 0 and torch.equal(got, want)


def test_patch_and_revert_from_several_threads():
    """apply_posenc_rope_to and revert_posenc_rope change one registry of originals: from
    several threads at once, revert iterated it while another thread wrote it ("dictionary
    changed size during iteration", thousands of times in a review's run). Now one at a
    time, and the type ends unpatched after a final revert."""
    import sys
    import threading
    import time

    errors = []

    def loop(fn, stop):
        while not stop.is_set():
            try:
                fn()
            except BaseException as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):  # rounds of fresh threads (the first round rarely meets)
            stop = threading.Event()
            threads = [threading.Thread(target=loop, args=(lambda: integration.apply_posenc_rope_to("llama"), stop),
                                        daemon=True) for _ in range(3)]
            threads.append(threading.Thread(target=loop, args=(lambda: integration.revert_posenc_rope("llama"), stop),
                                            daemon=True))
            for t in threads:
                t.start()
            time.sleep(0.25)
            stop.set()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, sorted({repr(e) for e in errors})
    integration.revert_posenc_rope()
    assert not integration.is_patched("llama")


def test_model_type_from_the_module_of_the_class():
    class Stand(torch.nn.Module):
        pass

    Stand.__module__ = "transformers.models.mistral.modeling_mistral"
    integration.apply_posenc_rope(Stand())
    assert integration.is_patched("mistral")


def test_unsupported_model_types_are_refused():
    with pytest.raises(ValueError, match=r"model type 'phi3' is not supported; supported: llama, mistral"):
        integration.apply_posenc_rope(transformers.Phi3Config())
    with pytest.raises(ValueError, match="model type 'bert' is not supported"):
        integration.apply_posenc_rope_to("bert")
    with pytest.raises(TypeError, match="expected a transformers model, config or model-type string, got int"):
        integration.apply_posenc_rope(3)


def test_a_changed_transformers_signature_is_refused(monkeypatch):
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", lambda x, cos, sin: x)
    with pytest.raises(RuntimeError, match=r"takes \('x', 'cos', 'sin'\), not \('q', 'k', 'cos', 'sin'\)"):
        integration.apply_posenc_rope_to("llama")


def test_replacement_layouts_and_arguments():
    q, k = torch.randn(2, 4, 5, 16, dtype=torch.float64), torch.randn(2, 2, 5, 16, dtype=torch.float64)
    cos, sin = posenc.functional.rope_cos_sin(torch.arange(5).expand(2, 5), 16, dtype=torch.float64)
    want = posenc.functional.apply_rope(q, k, positions=torch.arange(5), layout="bhsd")
    for got in (integration.posenc_apply_rotary_pos_emb(q, k, cos, sin),
                integration.posenc_apply_rotary_pos_emb(q, k, cos, sin, None, 1),
                [t.transpose(1, 2) for t in integration.posenc_apply_rotary_pos_emb(
                    q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)],
                [t.transpose(1, 2) for t in integration.posenc_apply_rotary_pos_emb(
                    q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)]):  # transformers 5: 5th is unsqueeze_dim
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="expected unsqueeze_dim 1 .* or 2 .* got 0"):
        integration.posenc_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    # GPT-J: (batch, seq, heads, rot) with half-width sin/cos
    half_cos, half_sin = cos[..., :8], sin[..., :8]
    got = integration.posenc_gptj_apply_rotary_pos_emb(q.transpose(1, 2), half_sin, half_cos)
    torch.testing.assert_close(got.transpose(1, 2), posenc.functional.apply_rope(
        q, positions=torch.arange(5), layout="bhsd", interleaved=True), rtol=1e-12, atol=1e-12)


def test_the_llama_style_replacement_refuses_tables_transformers_would_not_rotate_so():
    """Llama's apply_rotary_pos_emb broadcasts cos.unsqueeze(unsqueeze_dim) against q: it
    raises for tables narrower than the head (a Llama config with partial_rotary_factor in
    its rope parameters builds them), and pairs a 2-D table's rows with q's heads. The
    replacement ran both, as GPT-NeoX's partial rotary and as per-token tables (found by an
    audit): silently unlike the model it patches. GPT-NeoX's own function keeps its partial
    rotary."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    neox = importlib.import_module("transformers.models.gpt_neox.modeling_gpt_neox")
    theirs = integration._runs(llama.apply_rotary_pos_emb)
    q, k = torch.randn(2, 4, 4, 16, dtype=torch.float64), torch.randn(2, 2, 4, 16, dtype=torch.float64)
    cos, sin = posenc.functional.rope_cos_sin(torch.arange(4).expand(2, 4), 16, dtype=torch.float64)
    narrow = (cos[..., :8], sin[..., :8])
    with pytest.raises(RuntimeError):
        theirs(q, k, *narrow)
    with pytest.raises(ValueError, match=r"expected cos and sin of shape \(1 or batch, seq, head_dim\) for q of "
                                         r"shape \(2, 4, 4, 16\) with unsqueeze_dim=1 .* got cos \(2, 4, 8\)"):
        integration.posenc_apply_rotary_pos_emb(q, k, *narrow)
    # (seq, head_dim) tables with seq == heads: transformers turns head h by row h of the table
    flat = (cos[0], sin[0])
    theirs(q, q, *flat)  # runs: a per-head rotation
    with pytest.raises(ValueError, match=r"got cos \(4, 16\), sin \(4, 16\)"):
        integration.posenc_apply_rotary_pos_emb(q, q, *flat)
    for bad in ((cos[:, :3], sin[:, :3]), (cos, sin[..., :8]), (cos[:1].expand(3, 4, 16), sin[:1].expand(3, 4, 16))):
        with pytest.raises(ValueError, match="expected cos and sin of shape"):
            integration.posenc_apply_rotary_pos_emb(q, k, *bad)
    # Batch-1 tables broadcast over q's batch, as transformers' do.
    for a, b in zip(integration.posenc_apply_rotary_pos_emb(q, k, cos[:1], sin[:1]), theirs(q, k, cos[:1], sin[:1])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # GPT-NeoX's function turns the leading features with narrower tables, as transformers' does
    # (bhsd and bshd), and refuses the 2-D ones.
    neox_theirs = integration._runs(neox.apply_rotary_pos_emb)
    assert neox_theirs is not integration.posenc_gpt_neox_apply_rotary_pos_emb
    for unsqueeze_dim in (1, 2):
        qq, kk = (q, k) if unsqueeze_dim == 1 else (q.transpose(1, 2), k.transpose(1, 2))
        got = integration.posenc_gpt_neox_apply_rotary_pos_emb(qq, kk, *narrow, unsqueeze_dim=unsqueeze_dim)
        want = neox_theirs(qq, kk, *narrow, unsqueeze_dim=unsqueeze_dim)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"GPT-NeoX .*rotary_dim <= head_dim"):
        integration.posenc_gpt_neox_apply_rotary_pos_emb(q, k, *flat)


def test_a_patched_llama_with_partial_rotary_tables_raises_as_the_unpatched_one():
    config = transformers.LlamaConfig(**COMMON)
    config.rope_parameters = dict(rope_type="linear", factor=2.0, rope_theta=10000.0, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="must match"):
        model(input_ids=ids)
    integration.apply_posenc_rope(model)
    with pytest.raises(ValueError, match=r"expected cos and sin of shape .* got cos \(1, 9, 8\)"):
        model(input_ids=ids)
