"""examples/attention_sinks.py: generation with attention sinks and a sliding window, the cache
shifted by rope_shift_kv. Its keys equal the keys recomputed at their current positions, and
its tokens equal those of the same loop that re-rotates every cached key from scratch at every
step (no shift, no rope_append_kv)."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import torch

from posenc.functional import apply_rope

PATH = pathlib.Path(__file__).resolve().parents[2] / "examples" / "attention_sinks.py"


def load():
    spec = importlib.util.spec_from_file_location("attention_sinks", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cache_holds_the_keys_at_their_positions():
    ex = load()
    tokens, cached, recomputed, length, shifts = ex.generate(steps=60)
    assert shifts >= 5 and length == ex.MAX_LEN
    torch.testing.assert_close(cached, recomputed, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_tokens_equal_a_loop_that_recomputes_the_keys():
    ex = load()
    tokens, *_ = ex.generate(steps=40)
    model = ex.TinyDecoder()
    raw_k, raw_v, token, want = [], [], 1, []
    for _ in range(40):
        if len(raw_k) == ex.MAX_LEN:
            del raw_k[ex.SINKS:ex.SINKS + ex.DROP], raw_v[ex.SINKS:ex.SINKS + ex.DROP]
        q, k, v = model.project(token)
        raw_k.append(k[:, 0])
        raw_v.append(v[:, 0])
        n = len(raw_k)
        keys = apply_rope(torch.stack(raw_k, 1), positions=torch.arange(n), scaling=ex.SCALING)
        q = apply_rope(q, positions=torch.tensor([n - 1]), scaling=ex.SCALING)
        token = model.attend(q, keys, torch.stack(raw_v, 1), n)
        want.append(token)
    assert tokens == want


def test_the_script_runs():
    env = dict(os.environ, PYTHONPATH=str(PATH.parents[1] / "python"))
    out = subprocess.run([sys.executable, str(PATH)], capture_output=True, text=True, check=True, env=env)
    assert "the cache holds the keys at their current positions" in out.stdout
