"""The whole table in one run: every CPU op of posenc against its memory floor, eager PyTorch
and torch.compile (issue 37).

Per row: the bytes the op must move (inputs read once + outputs written once), posenc's time,
the floor (``clone()`` of a buffer of half those bytes: the same bytes read and written),
fraction = floor / posenc (the median over rounds of each round's ratio), the eager
expression's time and torch.compile's of it (compiled once per row, ``dynamic=False``, warmed
up, forward rows under no_grad), all timed interleaved in this process
(harness.time_interleaved: one sample of each per round, each round starting one further on;
times are medians; every sample of posenc, the floor, eager and compile from caches emptied
by harness.flush_caches, so that none pays for its neighbour's work and the floor is
memory's; decode rows and the compute column in their own steady state),
under the allocator this process has. Backward rows time the backward alone (the graph is
built once, ``retain_graph=True``). Decode-sized calls are launch-bound: judged against eager
and compile only.

Usage: PYTHONPATH=python python benchmarks/bench_table.py [--reps 11] [--no-compile] [--quick]
       [--small] [--only SUBSTRING] [--json PATH]
(``make bench``; preload tcmalloc with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
to take page faults out of both sides.)
"""

from __future__ import annotations

import os

# Inductor's compile workers would otherwise steal the cores the timings run on.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

import posenc  # noqa: E402
from bench_rope_append_kv import composition as append_kv_composition  # noqa: E402
from bench_rope_append_kv import fused as append_kv_fused  # noqa: E402
from bench_rope_append_kv import composition_fp8 as append_kv_composition_fp8  # noqa: E402
from bench_rope_append_kv import fused_fp8 as append_kv_fused_fp8  # noqa: E402
from bench_rope_append_kv import composition_qk_norm as append_kv_composition_qk_norm  # noqa: E402
from bench_rope_append_kv import fused_qk_norm as append_kv_fused_qk_norm  # noqa: E402
from rope_harness import rotate_half  # noqa: E402
from bench_rope_append_kv import composition_mla as append_kv_composition_mla  # noqa: E402
from bench_rope_append_kv import fused_mla as append_kv_fused_mla  # noqa: E402
from bench_rope_cos_sin import hf_apply  # noqa: E402
from bench_rope_multi_axis import SECTIONS, mrope_tables, rotate  # noqa: E402
from harness import _reference as add_position_reference  # noqa: E402
from harness import allocator, cpu_model, page_policy, time_interleaved  # noqa: E402
from rope_harness import reference as rope_reference  # noqa: E402

F = posenc.functional
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
P = 0.1  # dropout of the training rows

# Every row compiles its own expression for its own shapes and dtypes: many graphs per code
# object, so lift dynamo's recompile limit (past it, torch.compile silently runs eager).
for _name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 4096)


@dataclass
class Bench:
    """One row's work. Forward rows: ``ours(*args)`` against ``eager(*args)``. Backward rows:
    both forwards are run once on ``args`` (some require grad), then the gradients of their
    outputs (weighted by ``grads``) with respect to ``wrt`` are timed."""

    nbytes: int
    ours: Callable
    eager: Callable
    args: tuple
    backward: bool = False
    wrt: tuple = ()
    grads: tuple = ()
    launch_bound: bool = False
    # False where posenc writes only into tensors it was given (in place): its floor is then a
    # copy into a buffer allocated once, not a clone, which would pay an allocation (a fresh
    # mmap's page faults under glibc) that the op does not.
    allocates: bool = True
    # True where posenc reads and writes one tensor in place (and nothing else): its floor is
    # then one in-place pass over a tensor of nbytes / 2 (read and written, neg_), not a copy
    # into a second buffer, which also reads the lines it writes (write-allocate:
    # docs/performance.md, "Read with care").
    in_place: bool = False
    # Dropout's rows: posenc's call on a slice that stays in cache, and how many such slices
    # the row's tensor holds. Scaled, its time is what the op costs without DRAM: posenc's own
    # compute (Philox bits + arithmetic), shown beside the fraction, not folded into it (it is
    # posenc's own speed, not an independent floor).
    compute: Optional[Callable] = None
    compute_scale: float = 1.0


@dataclass
class Spec:
    op: str
    case: str
    shape: str
    dtype: torch.dtype
    build: Callable[[torch.dtype], Bench]
    label: str = field(init=False)

    def __post_init__(self):
        self.label = f"{self.op} {self.case} {_dtype_name(self.dtype)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _grads_like(*tensors: torch.Tensor) -> tuple:
    return tuple(torch.randn_like(t) for t in tensors)


# ---------------------------------------------------------------- eager expressions (plain PyTorch)

def eager_sinusoidal_table(positions, d_model, dtype):
    """The classic formulation (the PyTorch tutorial's), columns interleaved as posenc's."""
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    angles = positions.float()[:, None] * div
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


def eager_sinusoidal_2d_table(grid_h, grid_w, dim, dtype):
    """MAE's get_2d_sincos_pos_embed in torch (float64 as MAE's NumPy): [sin w | cos w | sin h | cos h]."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    h, w = torch.meshgrid(torch.arange(grid_h, dtype=torch.float64), torch.arange(grid_w, dtype=torch.float64),
                          indexing="ij")
    ow, oh = w.reshape(-1, 1) * omega, h.reshape(-1, 1) * omega
    return torch.cat((ow.sin(), ow.cos(), oh.sin(), oh.cos()), dim=1).to(dtype)


def eager_rope_bhsd(q, k, cos_table, sin_table, positions):
    """Hugging Face's apply_rotary_pos_emb on (batch, heads, seq, head_dim)."""
    return hf_apply(q, k, cos_table[positions], sin_table[positions])


def eager_rope_partial(q, k, cos_table, sin_table, positions):
    """GPT-NeoX's partial rotary: the first rotary_dim features turn, the rest pass through."""
    r = cos_table.shape[-1]
    oq, ok = rope_reference(q[..., :r], k[..., :r], cos_table, sin_table, positions)
    return torch.cat((oq, q[..., r:]), dim=-1), torch.cat((ok, k[..., r:]), dim=-1)


def eager_rope_scaled(q, k, inv_freq, attention_factor, positions):
    """Hugging Face's rotary embedding with scaling (yarn): angles from the positions in the
    call, cos/sin times the attention factor, then the rotation."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_factor).to(q.dtype).unsqueeze(2)
    sin = (emb.sin() * attention_factor).to(q.dtype).unsqueeze(2)
    return rotate(q, k, cos, sin)


def eager_rope_thd(q, k, cos_table, sin_table, token_positions):
    """Packed tokens (tokens, heads, head_dim) at their positions within their sequences."""
    cos, sin = cos_table[token_positions].unsqueeze(1), sin_table[token_positions].unsqueeze(1)
    return rotate(q, k, cos, sin)


def eager_mrope(q, k, positions, base):
    """Qwen2-VL: cos/sin of every axis built in the call, then the rotation."""
    cos, sin = mrope_tables(positions, q.shape[-1], SECTIONS, base, q.dtype)
    return rotate(q, k, cos, sin)


def eager_qk_norm_rope(q, k, q_norm, k_norm):
    """The composition qk_norm_rope replaces (bench_qk_norm_rope.py): RMSNorm modules, then apply_rope."""
    return F.apply_rope(q_norm(q), k_norm(k))


# ---------------------------------------------------------------- rows

def rows(small: bool) -> List[Spec]:
    B, S, d = (2, 128, 512) if small else (32, 512, 512)  # add_position
    RB, RS, Hq, Hk, D = (1, 128, 16, 4, 128) if small else (4, 1024, 16, 4, 128)  # RoPE
    N = 1024 if small else 16384  # sinusoidal_table positions
    G = 16 if small else 64  # sinusoidal_2d_table grid side
    specs: List[Spec] = []

    def add(op, case, shape, build, dtypes=DTYPES):
        specs.extend(Spec(op, case, shape, dtype, build) for dtype in dtypes)

    # add_position -------------------------------------------------------------------------
    def position_module(dtype, kind):
        if kind == "learned":
            module = posenc.LearnedPositionalEncoding(d, P, max_len=S)  # float32 table (a parameter)
        else:
            module = posenc.PositionalEncoding(d, P, max_len=S)
            module.pe = module.pe.to(dtype)  # the table in x's dtype, as bench_add_position.py
        return module, module.pe

    def add_position_forward(kind, training):
        def build(dtype):
            module, table = position_module(dtype, kind)
            module.train(training)
            x = torch.randn(B, S, d, dtype=dtype)
            bench = Bench(2 * _nbytes(x) + _nbytes(table), lambda x: module(x),
                          add_position_reference(table, P, training), (x,))
            if training:  # Philox: a slice of x whose input and output stay in the L3 cache (4 MiB each)
                chunk = x[: max(1, (4 << 20) // _nbytes(x[0]))].contiguous()
                bench.compute = lambda: module(chunk)
                bench.compute_scale = x.numel() / chunk.numel()
            return bench
        return build

    def add_position_backward(kind):
        def build(dtype):
            module, table = position_module(dtype, kind)
            module.train(True)
            x = torch.randn(B, S, d, dtype=dtype, requires_grad=True)
            wrt = (x, table) if kind == "learned" else (x,)
            # grad read, grad x written, the table gradient written (learned), and the keep mask
            # the CPU forward saved (1 bit per element) read.
            nbytes = 2 * _nbytes(x) + (_nbytes(table) if kind == "learned" else 0) + x.numel() // 8
            return Bench(nbytes, lambda x: module(x), add_position_reference(table, P, True), (x,),
                         backward=True, wrt=wrt, grads=_grads_like(x))
        return build

    shape = f"({B}, {S}, {d})"
    add("add_position", "sinusoidal eval forward", shape, add_position_forward("sinusoidal", False))
    add("add_position", f"sinusoidal train forward, p={P}", shape, add_position_forward("sinusoidal", True))
    add("add_position", "sinusoidal backward (grad x)", shape, add_position_backward("sinusoidal"))
    add("add_position", f"learned train forward, p={P}", shape, add_position_forward("learned", True))
    add("add_position", "learned backward (grad x, table)", shape, add_position_backward("learned"))

    # tables ---------------------------------------------------------------------------------
    def table_1d(dtype):
        positions = torch.arange(N)
        return Bench(N * d * dtype.itemsize + _nbytes(positions),
                     lambda p, d_, t: F.sinusoidal_table(p, d_, dtype=t), eager_sinusoidal_table, (positions, d, dtype))

    def table_2d(dtype):
        return Bench(G * G * d * dtype.itemsize, lambda h, w, d_, t: F.sinusoidal_2d_table(h, w, d_, dtype=t),
                     eager_sinusoidal_2d_table, (G, G, d, dtype))

    add("sinusoidal_table", "positions 0..N-1", f"N={N}, d={d}", table_1d)
    add("sinusoidal_2d_table", f"{G}x{G} grid", f"({G * G}, {d})", table_2d)

    # apply_rope -------------------------------------------------------------------------------
    def tables(rows_, dim, dtype):
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        emb = torch.arange(rows_, dtype=torch.float32)[:, None] * inv
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def qk(dtype, layout="bshd", grad=False):
        if layout == "bhsd":
            q, k = torch.randn(RB, Hq, RS, D, dtype=dtype), torch.randn(RB, Hk, RS, D, dtype=dtype)
        elif layout == "thd":
            q, k = torch.randn(RB * RS, Hq, D, dtype=dtype), torch.randn(RB * RS, Hk, D, dtype=dtype)
        else:
            q, k = torch.randn(RB, RS, Hq, D, dtype=dtype), torch.randn(RB, RS, Hk, D, dtype=dtype)
        return q.requires_grad_(grad), k.requires_grad_(grad)

    def rope_bench(dtype, mode, layout, ours, eager, extra):
        """mode: "forward", "in place" (posenc rotates copies of q, k in place; eager and
        compile as forward) or "backward"."""
        q, k = qk(dtype, layout, grad=mode == "backward")
        nbytes = 2 * _nbytes(q, k)
        if mode == "backward":
            return Bench(nbytes, lambda a, b, *_: ours(a, b), eager, (q, k) + extra, backward=True, wrt=(q, k),
                         grads=_grads_like(q, k))
        if mode == "in place":
            q_own, k_own = q.clone(), k.clone()
            return Bench(nbytes, lambda *_: ours(q_own, k_own, inplace=True), eager, (q, k) + extra, allocates=False,
                         in_place=True)
        return Bench(nbytes, lambda a, b, *_: ours(a, b), eager, (q, k) + extra)

    positions = torch.arange(RS).expand(RB, RS)

    def rope_default(layout, mode):
        eager = eager_rope_bhsd if layout == "bhsd" else rope_reference

        def build(dtype):
            cos, sin = tables(RS, D, dtype)
            return rope_bench(dtype, mode, layout, lambda a, b, **kw: F.apply_rope(a, b, layout=layout, **kw),
                              eager, (cos, sin, positions))
        return build

    def rope_partial(mode):
        def build(dtype):
            cos, sin = tables(RS, 64, dtype)
            return rope_bench(dtype, mode, "bshd", lambda a, b, **kw: F.apply_rope(a, b, rotary_dim=64, **kw),
                              eager_rope_partial, (cos, sin, positions))
        return build

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256 if small else 1024}

    def rope_yarn(mode):
        inv_freq, attention = F.rope_frequencies(D, scaling=yarn)

        def build(dtype):
            return rope_bench(dtype, mode, "bshd", lambda a, b, **kw: F.apply_rope(a, b, scaling=yarn, **kw),
                              eager_rope_scaled, (inv_freq.float(), float(attention), positions))
        return build

    lengths = [RS // 2, RS // 4, RS, RS // 4] * (RB // 2) if RB > 1 else [RS // 2, RS // 2]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    token_positions = torch.cat([torch.arange(n) for n in lengths])

    def rope_thd(mode):
        def build(dtype):
            cos, sin = tables(max(lengths), D, dtype)
            return rope_bench(dtype, mode, "thd",
                              lambda a, b, **kw: F.apply_rope(a, b, layout="thd", cu_seqlens=cu_seqlens, **kw),
                              eager_rope_thd, (cos, sin, token_positions))
        return build

    # Multi-axis positions (t, h, w): a vision block in the middle of text, as bench_rope_multi_axis.py.
    axes = torch.arange(RS).expand(3, RB, RS).clone()
    lo, side = RS // 4, int(math.isqrt(RS // 4))
    grid = torch.arange(side * side)
    axes[1, :, lo : lo + side * side] = lo + grid // side
    axes[2, :, lo : lo + side * side] = lo + grid % side

    def rope_mrope(mode):
        def build(dtype):
            def ours(a, b, **kw):
                return F.apply_rope(a, b, positions=axes, sections=SECTIONS, sections_mode="mrope", base=1e6, **kw)
            return rope_bench(dtype, mode, "bshd", ours, eager_mrope, (axes, 1e6))
        return build

    rope_shape = f"q ({RB}, {RS}, {Hq}, {D}), k ({RB}, {RS}, {Hk}, {D})"
    for layout in ("bshd", "bhsd"):
        for mode in ("forward", "in place", "backward"):
            add("apply_rope", f"{layout} GQA {Hq}/{Hk}, {mode}", rope_shape, rope_default(layout, mode))
    thd = f"thd packed, {len(lengths)} seqs"
    for name, builder in (("partial rotary_dim 64", rope_partial), ("yarn x4", rope_yarn), (thd, rope_thd),
                          ("mrope [16, 24, 24]", rope_mrope)):
        for mode in ("forward", "backward"):
            add("apply_rope", f"{name}, {mode}", f"q ({RB * RS}, {Hq}, {D})" if builder is rope_thd else rope_shape,
                builder(mode))

    # apply_rope_cos_sin (bhsd, Hugging Face's tables) ------------------------------------------
    def cos_sin(mode):
        def build(dtype):
            cos, sin = F.rope_cos_sin(positions, D, dtype=dtype)
            q, k = qk(dtype, "bhsd", grad=mode == "backward")
            nbytes = 2 * _nbytes(q, k) + _nbytes(cos, sin)
            if mode == "backward":
                return Bench(nbytes, F.apply_rope_cos_sin, hf_apply, (q, k, cos, sin), backward=True, wrt=(q, k),
                             grads=_grads_like(q, k))
            return Bench(nbytes, F.apply_rope_cos_sin, hf_apply, (q, k, cos, sin))
        return build

    cs_shape = f"q ({RB}, {Hq}, {RS}, {D}), k ({RB}, {Hk}, {RS}, {D})"
    add("apply_rope_cos_sin", "bhsd, forward", cs_shape, cos_sin("forward"))
    add("apply_rope_cos_sin", "bhsd, backward", cs_shape, cos_sin("backward"))

    # qk_norm_rope (bshd) --------------------------------------------------------------------
    def qk_norm(mode):
        def build(dtype):
            from bench_qk_norm_rope import RMSNorm  # transformers' Qwen3RMSNorm when installed

            q_norm, k_norm = RMSNorm(D).to(dtype), RMSNorm(D).to(dtype)
            if mode != "backward":
                q_norm.requires_grad_(False)
                k_norm.requires_grad_(False)
            q, k = qk(dtype, "bshd", grad=mode == "backward")

            def ours(a, b, qn, kn):
                return F.qk_norm_rope(a, b, qn.weight, kn.weight)

            args = (q, k, q_norm, k_norm)
            if mode == "backward":  # reads x and the gradient, writes dx
                return Bench(3 * _nbytes(q, k), ours, eager_qk_norm_rope, args, backward=True,
                             wrt=(q, k, q_norm.weight, k_norm.weight), grads=_grads_like(q, k))
            return Bench(2 * _nbytes(q, k), ours, eager_qk_norm_rope, args)
        return build

    add("qk_norm_rope", "bshd, forward", rope_shape, qk_norm("forward"))
    add("qk_norm_rope", "bshd, backward", rope_shape, qk_norm("backward"))

    # rope_append_kv ------------------------------------------------------------------------
    def append_kv(batch, seq, cache, launch_bound, fp8=False, qk_norm=False):
        def build(dtype):
            torch.manual_seed(0)
            q = torch.randn(batch, seq, 32, D, dtype=dtype)
            k, v = torch.randn(batch, seq, 8, D, dtype=dtype), torch.randn(batch, seq, 8, D, dtype=dtype)
            cache_dtype = torch.float8_e4m3fn if fp8 else dtype
            k_cache = torch.zeros(batch, cache, 8, D, dtype=cache_dtype)
            v_cache = torch.zeros(batch, cache, 8, D, dtype=cache_dtype)
            lengths_ = torch.randint(0, cache - seq + 1, (batch,))
            args = (q, k, v, k_cache, v_cache, lengths_)
            if fp8:  # q read and written; k and v read; one byte per cache element written
                # The caches' uint8 views made here, outside the compiled composition
                # (composition_fp8 says why).
                bits = (k_cache.view(torch.uint8), v_cache.view(torch.uint8))
                return Bench(2 * _nbytes(q) + _nbytes(k, v) + k.numel() + v.numel(), append_kv_fused_fp8,
                             append_kv_composition_fp8, args + bits, launch_bound=launch_bound)
            if qk_norm:  # Qwen3: float32 norm weights of head_dim values (read once: negligible)
                weights = (torch.rand(D) + 0.5, torch.rand(D) + 0.5)
                return Bench(2 * _nbytes(q, k, v), append_kv_fused_qk_norm, append_kv_composition_qk_norm,
                             args + weights, launch_bound=launch_bound)
            return Bench(2 * _nbytes(q, k, v), append_kv_fused, append_kv_composition, args,
                         launch_bound=launch_bound)
        return build

    prefill_seq, cache = (128, 256) if small else (2048, 4096)
    add("rope_append_kv", "prefill", f"(1, {prefill_seq}, 32, 8, {D}), cache {cache}",
        append_kv(1, prefill_seq, cache, False))
    add("rope_append_kv", "decode", f"(8, 1, 32, 8, {D}), cache {cache // 2}", append_kv(8, 1, cache // 2, True))
    add("rope_append_kv", "prefill, FP8 e4m3 caches", f"(1, {prefill_seq}, 32, 8, {D}), cache {cache}",
        append_kv(1, prefill_seq, cache, False, fp8=True))
    add("rope_append_kv", "decode, FP8 e4m3 caches", f"(8, 1, 32, 8, {D}), cache {cache // 2}",
        append_kv(8, 1, cache // 2, True, fp8=True))
    add("rope_append_kv", "prefill, QK-norm", f"(1, {prefill_seq}, 32, 8, {D}), cache {cache}",
        append_kv(1, prefill_seq, cache, False, qk_norm=True))
    add("rope_append_kv", "decode, QK-norm", f"(8, 1, 32, 8, {D}), cache {cache // 2}",
        append_kv(8, 1, cache // 2, True, qk_norm=True))

    def append_mla(batch, seq, cache, launch_bound):
        def build(dtype):
            torch.manual_seed(0)
            q = torch.randn(batch, seq, 16, 192, dtype=dtype)
            kv_c, k_pe = torch.randn(batch, seq, 1, 512, dtype=dtype), torch.randn(batch, seq, 1, 64, dtype=dtype)
            latent = torch.zeros(batch, cache, 1, 576, dtype=dtype)
            lengths_ = torch.randint(0, cache - seq + 1, (batch,))
            # q_pe read and written in place; kv_c and k_pe read; the latent rows written.
            nbytes = 2 * q[..., 128:].numel() * q.element_size() + 2 * _nbytes(kv_c, k_pe)
            return Bench(nbytes, append_kv_fused_mla, append_kv_composition_mla, (q, kv_c, k_pe, latent, lengths_),
                         launch_bound=launch_bound, allocates=False)
        return build

    # rope_shift_kv: a context shift of half the cache (rows cache/2 .. cache-1 move down by
    # cache/4 positions), in place; eager: Hugging Face's rotate_half twice (back by the old
    # angle, on by the new one) on the gathered rows, written back.
    def shift_kv(batch, cache):
        def build(dtype):
            torch.manual_seed(0)
            k_cache = torch.randn(batch, cache, 8, D, dtype=dtype)
            rows = torch.arange(cache // 2, cache)
            old, new = rows, rows - cache // 4
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
            tables = []
            for p in (old, new):
                angle = torch.cat([p[:, None] * inv_freq] * 2, -1)
                tables.append((angle.cos().to(dtype)[:, None], angle.sin().to(dtype)[:, None]))

            def ours(kc):
                return F.rope_shift_kv(kc, old, new, rows=rows)

            def eager(kc):
                x = kc[:, rows]
                (co, so), (cn, sn) = tables
                x = x * co - rotate_half(x) * so  # back by the old angle
                kc[:, rows] = x * cn + rotate_half(x) * sn
                return kc

            # rows read and written in place
            return Bench(2 * k_cache[:, rows].numel() * k_cache.element_size(), ours, eager, (k_cache,),
                         allocates=False, in_place=True)
        return build

    add("rope_shift_kv", "shift half the cache", f"cache (1, {cache}, 8, {D})", shift_kv(1, cache))

    add("rope_append_kv", "MLA prefill (DeepSeek-V3 512 + 64)", f"q (1, {prefill_seq}, 16, 192), latent {cache}",
        append_mla(1, prefill_seq, cache, False))
    add("rope_append_kv", "MLA decode (DeepSeek-V3 512 + 64)", f"q (8, 1, 16, 192), latent {cache // 2}",
        append_mla(8, 1, cache // 2, True))
    return specs


# ---------------------------------------------------------------- timing

# The columns timed from emptied caches (harness.flush_caches before each sample).
COLD = ("posenc", "floor", "eager", "compile")


def measure(bench: Bench, dtype: torch.dtype, reps: int, warmup: int, with_compile: bool,
            samples: Optional[dict] = None) -> Dict[str, float]:
    buffer = torch.randn(bench.nbytes // 2 // dtype.itemsize, dtype=dtype)  # the floor: these bytes copied
    if bench.in_place:
        floor = buffer.neg_
    elif bench.allocates:
        floor = buffer.clone
    else:
        into = torch.empty_like(buffer)
        floor = lambda: into.copy_(buffer)  # noqa: E731

    fns: Dict[str, Callable] = {}
    if bench.backward:
        def backward_of(fn):
            outputs = fn(*bench.args)
            return lambda: torch.autograd.grad(outputs, bench.wrt, bench.grads, retain_graph=True)

        fns["posenc"] = backward_of(bench.ours)
        fns["floor"] = floor
        fns["eager"] = backward_of(bench.eager)
        if with_compile:
            fns["compile"] = backward_of(torch.compile(bench.eager, dynamic=False))
        return time_interleaved(fns, "cpu", reps, warmup, samples=samples, cold=COLD)
    with torch.no_grad():
        fns["posenc"] = lambda: bench.ours(*bench.args)
        fns["floor"] = floor
        fns["eager"] = lambda: bench.eager(*bench.args)
        if with_compile:
            compiled = torch.compile(bench.eager, dynamic=False)
            compiled(*bench.args)  # compile outside the timed rounds
            fns["compile"] = lambda: compiled(*bench.args)
        if bench.compute is not None:
            fns["compute"] = bench.compute
        # Decode-sized calls: the mean of a burst of calls per sample (a decode loop's steady
        # state; harness.time_interleaved).
        times = time_interleaved(fns, "cpu", reps, warmup, burst=20 if bench.launch_bound else 1, samples=samples,
                                 cold=() if bench.launch_bound else COLD)
    if "compute" in times:
        times["compute"] *= bench.compute_scale
    return times


COLUMNS = (f"{'op':19} {'case':36} {'dtype':8} {'MB':>7} {'posenc ms':>9} {'floor ms':>8} {'compute ms':>10} "
           f"{'fraction':>12} {'eager ms':>8} {'eager/posenc':>12} {'compile ms':>10} {'compile/posenc':>14}")


def format_row(r: dict) -> str:
    def num(value, width, fmt=".3f"):
        return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"

    fraction = f"{'launch-bound':>12}" if r["launch_bound"] else num(r["fraction"], 12, ".2f")
    return (f"{r['op']:19} {r['case']:36} {r['dtype']:8} {r['bytes'] / 1e6:7.1f} {r['posenc_ms']:9.3f} "
            f"{r['floor_ms']:8.3f} {num(r['compute_floor_ms'], 10)} {fraction} {r['eager_ms']:8.3f} "
            f"{num(r['eager_ratio'], 12, '.2f')} {num(r['compile_ms'], 10)} {num(r['compile_ratio'], 14, '.2f')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=11, help="interleaved rounds per row (median)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds, 1 warm-up call")
    parser.add_argument("--small", action="store_true", help="small shapes (tests)")
    parser.add_argument("--only", help="run the rows whose 'op case dtype' contains this substring")
    parser.add_argument("--json", help="also write the rows (and the header) as JSON here")
    args = parser.parse_args(argv)
    reps, warmup = (3, 1) if args.quick else (args.reps, 3)
    specs = rows(args.small)
    if args.only:
        specs = [s for s in specs if args.only in s.label]
        if not specs:
            print(f"no row matches {args.only!r}", file=sys.stderr)
            return 2

    meta = dict(allocator=allocator(), threads=torch.get_num_threads(), reps=reps, compile=not args.no_compile,
                torch=torch.__version__, posenc=posenc.__version__,
                cpu=cpu_model(), cpu_capability=torch.ops.posenc.cpu_capability())
    print(f"posenc {meta['posenc']}, torch {meta['torch']}, CPU {meta['cpu']}, kernels {meta['cpu_capability']}; "
          f"allocator: {meta['allocator']}; {meta['threads']} threads; median of {reps} interleaved rounds "
          f"({warmup} warm-up calls each)")
    print(page_policy())
    print(COLUMNS)
    print("-" * len(COLUMNS), flush=True)
    start = time.perf_counter()
    results = []
    for spec in specs:
        torch.manual_seed(0)
        bench = spec.build(spec.dtype)
        samples: dict = {}
        t = measure(bench, spec.dtype, reps, warmup, not args.no_compile, samples)
        compute = t.get("compute")
        # The fraction pairs each round's floor with the same round's posenc call (the median
        # of their ratios): a shared host's drift moves both, where the ratio of two medians
        # of 11 single calls moved by up to 2x between runs.
        fraction = statistics.median(f / p for f, p in zip(samples["floor"], samples["posenc"]))
        r = dict(op=spec.op, case=spec.case, shape=spec.shape, dtype=_dtype_name(spec.dtype), bytes=bench.nbytes,
                 posenc_ms=t["posenc"], floor_ms=t["floor"], compute_floor_ms=compute,
                 fraction=None if bench.launch_bound else fraction, launch_bound=bench.launch_bound,
                 eager_ms=t["eager"], eager_ratio=t["eager"] / t["posenc"], compile_ms=t.get("compile"),
                 compile_ratio=t["compile"] / t["posenc"] if "compile" in t else None)
        results.append(r)
        print(format_row(r), flush=True)
        del bench
    elapsed = time.perf_counter() - start
    print("-" * len(COLUMNS))
    print("\n".join((
        "MB: bytes the op must read and write (inputs once, outputs once). floor: clone() of half those bytes",
        "  (in-place rows, which allocate nothing: a copy_ into a buffer allocated once).",
        "compute: dropout rows, posenc's own train forward on a 4 MiB slice of x (in and out stay in L3), scaled",
        "  to all of x: its speed without DRAM (near posenc ms: compute-bound), not a floor.",
        "fraction: floor / posenc, the median of each round's ratio (>= 0.8 is issue 37's target).",
        "eager: plain PyTorch (add_position: F.dropout(x + pe); RoPE: Hugging Face's rotate_half, cos/sin gathered",
        "  or built in the call); qk_norm_rope and rope_append_kv: the compositions they replace (RMSNorm modules +",
        "  apply_rope; apply_rope + index copies into the cache). compile: torch.compile of the eager expression.",
        "In-place rows: posenc inplace=True against the out-of-place eager and compile. Backward rows: the backward",
        "  alone (graph built once). Forward rows under no_grad.")))
    shapes: Dict[str, dict] = {}
    for s in specs:
        shapes.setdefault(s.op, {})[s.shape] = None
    print("shapes: " + "; ".join(f"{op} {', '.join(v)}" for op, v in shapes.items()))
    print(f"{len(results)} rows in {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, seconds=elapsed, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
