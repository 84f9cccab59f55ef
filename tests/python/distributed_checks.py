"""The checks of test_distributed.py, run by each rank of a 2-process gloo group:
``python distributed_checks.py RANK WORLD PORT OUT_DIR``. Every check compares DTensor or
per-rank results with the single-process result on the same float64 data (generated from one
seed on every rank), and writes ``{check: "ok" | traceback}`` to OUT_DIR/rank<R>.json."""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def close(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def randint(high, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g)


def env():
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),)), Replicate, Shard, Partial, distribute_tensor


def as_partial(t, mesh):
    """A Partial() DTensor whose sum over ranks is t (rank-dependent split)."""
    from torch.distributed.tensor import DTensor, Partial

    rank, world = dist.get_rank(), dist.get_world_size()
    w = rand(*t.shape, seed=999)
    local = t * w if rank == 0 else t * (1 - w)
    if world > 2:
        local = t / world
    return DTensor.from_local(local, mesh, [Partial()], run_check=False)


def run_rope_case(name, q, k, placements, kwargs, expect, grad_seed=5):
    """apply_rope on DTensors placed as `placements` (q, k, positions, offsets) against the
    plain call: forward, output placement, backward."""
    from posenc.functional import apply_rope
    from torch.distributed.tensor import DTensor, Partial

    mesh, Replicate, Shard, _, distribute_tensor = env()
    qp, kp, pp, op = placements

    def place(t, p):
        if t is None:
            return None
        if isinstance(p, Partial):
            return as_partial(t, mesh)
        return distribute_tensor(t, mesh, [p])

    ref_q = q.clone().requires_grad_()
    ref_k = None if k is None else k.clone().requires_grad_()
    ref = apply_rope(ref_q, ref_k, **kwargs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    dq = place(q, qp).detach().requires_grad_()
    dk = None if k is None else place(k, kp).detach().requires_grad_()
    dkw = dict(kwargs)
    if "positions" in dkw:
        dkw["positions"] = place(dkw["positions"], pp)
    if isinstance(dkw.get("offset"), torch.Tensor):
        dkw["offset"] = place(dkw["offset"], op)
    if isinstance(dkw.get("cu_seqlens"), torch.Tensor):
        dkw["cu_seqlens"] = place(dkw["cu_seqlens"], Replicate())
    out = apply_rope(dq, dk, **dkw)
    out = out if isinstance(out, tuple) else (out,)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert isinstance(o, DTensor), name
        close(o.full_tensor(), r.detach(), f"{name} forward {i}")
        if expect is not None:
            assert o.placements == (expect,), f"{name}: output placed {o.placements}, expected {expect}"
    grads = [rand(*r.shape, seed=grad_seed + i) for i, r in enumerate(ref)]
    torch.autograd.backward(ref, grads)
    dgrads = [distribute_tensor(g, mesh, o.placements) if not o.placements[0].is_partial() else
              distribute_tensor(g, mesh, [Replicate()]) for g, o in zip(grads, out)]
    torch.autograd.backward(out, dgrads)
    close(dq.grad.full_tensor(), ref_q.grad, f"{name} grad q")
    if dk is not None:
        close(dk.grad.full_tensor(), ref_k.grad, f"{name} grad k")


def apply_rope_plain(q, **kwargs):
    from posenc.functional import apply_rope

    return apply_rope(q, **kwargs)


@check
def rope_rules():
    _, Replicate, Shard, Partial, _ = env()
    R = Replicate()
    B, S, Hq, Hk, D = 2, 8, 4, 2, 16
    for layout, (b, s, h) in {"bshd": (0, 1, 2), "bhsd": (0, 2, 1), "sbhd": (1, 0, 2)}.items():
        shape = {"bshd": (B, S, None, D), "bhsd": (B, None, S, D), "sbhd": (S, B, None, D)}[layout]
        q = rand(*[Hq if n is None else n for n in shape], seed=1)
        k = rand(*[Hk if n is None else n for n in shape], seed=2)
        pos2 = randint(100, (B, S), 3)
        pos1 = randint(100, (S,), 4)
        offs = randint(50, (B,), 6)
        base = dict(layout=layout, interleaved=layout == "bhsd", rotary_dim=12 if layout == "sbhd" else None)
        cases = [
            ("replicate", (R, R, R, R), {}, R),
            ("heads", (Shard(h), Shard(h), R, R), {}, Shard(h)),
            ("heads+positions", (Shard(h), Shard(h), Shard(1), R), dict(positions=pos2), Shard(h)),
            ("partial", (Partial(), Partial(), R, R), dict(positions=pos1), Partial()),
            ("batch", (Shard(b), Shard(b), R, R), dict(offset=3), Shard(b)),
            ("batch+positions(B,S)", (Shard(b), Shard(b), Shard(0), R), dict(positions=pos2), Shard(b)),
            ("batch+positions(S,)", (Shard(b), Shard(b), R, R), dict(positions=pos1), Shard(b)),
            ("batch+offsets", (Shard(b), Shard(b), R, Shard(0)), dict(offset=offs), Shard(b)),
            ("seq+positions(B,S)", (Shard(s), Shard(s), Shard(1), R), dict(positions=pos2), Shard(s)),
            ("seq+positions(S,)", (Shard(s), Shard(s), Shard(0), R), dict(positions=pos1), Shard(s)),
            ("seq+positions+offsets", (Shard(s), Shard(s), Shard(0), R), dict(positions=pos1, offset=offs), Shard(s)),
            # The op's rules have no split without positions (each rank's would restart at 0;
            # below): DTensor gathers, and apply_rope hands the result back split.
            ("seq without positions", (Shard(s), Shard(s), R, R), dict(offset=2), Shard(s)),
            ("seq, positions replicated", (Shard(s), Shard(s), R, R), dict(positions=pos1), Shard(s)),
            ("scaling llama3 heads", (Shard(h), Shard(h), R, R),
             dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}), Shard(h)),
            ("yarn seq", (Shard(s), Shard(s), Shard(0), R),
             dict(positions=pos1, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
             Shard(s)),
        ]
        for name, placements, kwargs, expect in cases:
            run_rope_case(f"{layout} {name}", q, k, placements, {**base, **kwargs}, expect)
        run_rope_case(f"{layout} q only, heads", q, None, (Shard(h), R, R, R), base, Shard(h))
        # The op itself on a sequence split without positions: no rule splits it (each rank's
        # rows would start at 0): DTensor gathers, and the result is right.
        mesh, _, _, _, distribute_tensor = env()
        op_kw = {n: v for n, v in base.items() if v is not None}
        raw = torch.ops.posenc.rope(distribute_tensor(q, mesh, [Shard(s)]), None, offset=2, **op_kw)[0]
        assert raw.placements != (Shard(s),), f"{layout}: the op split a sequence without positions"
        close(raw.full_tensor(), apply_rope_plain(q, offset=2, **base), f"{layout} op, sequence split")


@check
def qk_norm_rope_rules():
    """qk_norm_rope on DTensors: forward, output placement, and the gradients of q, k and
    both weights against the plain call; norm "hidden" on heads-sharded inputs is
    redistributed (replicated outputs), not computed per shard."""
    from posenc.functional import qk_norm_rope
    from torch.distributed.tensor import DTensor

    mesh, Replicate, Shard, _, distribute_tensor = env()
    R = Replicate()
    B, S, Hq, Hk, D = 2, 6, 4, 2, 8
    q, k = rand(B, S, Hq, D, seed=11), rand(B, S, Hk, D, seed=12)
    pos = randint(100, (B, S), 13)
    for norm in ("head", "hidden"):
        lq, lk = (D, D) if norm == "head" else (Hq * D, Hk * D)
        wq, wk = rand(lq, seed=14) + 2, rand(lk, seed=15) + 2
        cases = [("replicate", R, {}, R), ("batch", Shard(0), dict(offset=3), Shard(0)),
                 ("seq+positions", Shard(1), dict(positions=pos), Shard(1)),
                 # norm "hidden" spans a token's heads: its rules gather them, and the function
                 # hands the result back split as q was
                 ("heads", Shard(2), {}, Shard(2))]
        for name, place, kwargs, expect in cases:
            what = f"qk_norm_rope {norm} {name}"
            ref_in = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
            ref = qk_norm_rope(*ref_in, norm=norm, weight_offset=0.5, **kwargs)
            d_in = [distribute_tensor(q, mesh, [place]), distribute_tensor(k, mesh, [place]),
                    distribute_tensor(wq, mesh, [R]), distribute_tensor(wk, mesh, [R])]
            d_in = [t.detach().requires_grad_() for t in d_in]
            dkw = dict(kwargs)
            if "positions" in dkw:
                dkw["positions"] = distribute_tensor(pos, mesh, [Shard(1)])
            out = qk_norm_rope(*d_in, norm=norm, weight_offset=0.5, **dkw)
            grads = [rand(*r.shape, seed=16 + i) for i, r in enumerate(ref)]
            torch.autograd.backward(ref, grads)
            for i, (o, r) in enumerate(zip(out, ref)):
                assert isinstance(o, DTensor), what
                close(o.full_tensor(), r.detach(), f"{what} forward {i}")
                assert o.placements == (expect,), f"{what}: output placed {o.placements}, expected {expect}"
            torch.autograd.backward(out, [distribute_tensor(g, mesh, o.placements) for g, o in zip(grads, out)])
            for i, (d, r) in enumerate(zip(d_in, ref_in)):
                torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-10, atol=1e-10,
                                           msg=lambda m, what=what, i=i: f"{what} grad {i}: {m}")


@check
def functions_take_plain_tensors_beside_dtensors():
    """apply_rope, apply_rope_cos_sin and add_position with a DTensor input and plain index
    tensors / tables beside it: those are replicated on its mesh (no "mixed Tensor and
    DTensor" error), and the result equals the plain call."""
    mesh, _, Shard, _, distribute_tensor = env()
    from posenc import functional as F

    q, k = rand(2, 8, 4, 16, seed=301), rand(2, 8, 2, 16, seed=302)
    pos = randint(100, (2, 8), 303)
    want_q, want_k = F.apply_rope(q, k, positions=pos, offset=torch.tensor([3, 5]))
    got_q, got_k = F.apply_rope(distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)]),
                                positions=pos, offset=torch.tensor([3, 5]))
    assert got_q.placements == (Shard(2),), got_q.placements
    close(got_q.full_tensor(), want_q, "apply_rope plain positions")
    close(got_k.full_tensor(), want_k, "apply_rope plain positions k")
    # A 0-dim offset as a DTensor (every sequence's): is_pinned() has no DTensor rule.
    from torch.distributed.tensor import Replicate

    got_q, _ = F.apply_rope(distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)]),
                            offset=distribute_tensor(torch.tensor(4), mesh, [Replicate()]))
    close(got_q.full_tensor(), F.apply_rope(q, k, offset=4)[0], "apply_rope 0-dim DTensor offset")
    cos, sin = F.rope_cos_sin(pos, 16, dtype=torch.float64)
    want = F.apply_rope_cos_sin(q.transpose(1, 2), None, cos, sin)
    got = F.apply_rope_cos_sin(distribute_tensor(q.transpose(1, 2), mesh, [Shard(1)]), None, cos, sin)
    close(got.full_tensor(), want, "apply_rope_cos_sin plain tables")
    x, table = rand(4, 8, 16, seed=304), rand(20, 16, seed=305)
    want = F.add_position(x, table, positions=(pos[:1] % 20).expand(4, 8).contiguous())
    got = F.add_position(distribute_tensor(x, mesh, [Shard(0)]), table, positions=(pos[:1] % 20).expand(4, 8).contiguous())
    close(got.full_tensor(), want, "add_position plain table")


@check
def torch_context_parallel():
    """torch's context_parallel context manager shards the buffers it is given along their
    sequence dims (head-tail load balancing) in place: a positions buffer 0..S-1 given with q
    comes out as each rank's global positions, so apply_rope on the local q rotates exactly
    the rank's rows of the full call (the README recipe)."""
    from torch.distributed.tensor.experimental import context_parallel

    from posenc.distributed import context_parallel_indices
    from posenc.functional import apply_rope

    mesh = env()[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k = rand(2, 16, 2, 16, seed=311), rand(2, 16, 1, 16, seed=312)
    want_q, want_k = apply_rope(q, k)
    q_local, k_local, pos = q.clone(), k.clone(), torch.arange(16)
    with context_parallel(mesh, buffers=[q_local, k_local, pos], buffer_seq_dims=[1, 1, 0]):
        got_q, got_k = apply_rope(q_local, k_local, positions=pos)
        idx = context_parallel_indices(16, world, rank, "head_tail")
        assert torch.equal(pos, idx), (pos, idx)
        close(got_q, want_q[:, idx], "context_parallel q")
        close(got_k, want_k[:, idx], "context_parallel k")


@check
def rope_dynamic_scaling():
    """'dynamic' reads the call's longest position: sharded index tensors or sequence would
    each see their own; without seq_len the rule replicates them, with the global seq_len
    the sequence split is offered."""
    _, Replicate, Shard, _, _ = env()
    R = Replicate()
    B, S, H, D = 2, 8, 2, 16
    q, k = rand(B, S, H, D, seed=11), rand(B, S, H, D, seed=12)
    pos2 = randint(64, (B, S), 13)
    pos2[1, 3] = 60  # the longest position is on one rank's rows / columns only
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    run_rope_case("dynamic heads", q, k, (Shard(2), Shard(2), R, R), dict(positions=pos2, scaling=dyn), Shard(2))
    run_rope_case("dynamic batch(B,S) -> not batch-sharded", q, k, (Shard(0), Shard(0), Shard(0), R),
                  dict(positions=pos2, scaling=dyn), None)
    run_rope_case("dynamic seq -> not seq-sharded", q, k, (Shard(1), Shard(1), Shard(1), R),
                  dict(positions=pos2, scaling=dyn), None)
    run_rope_case("dynamic batch offsets", q, k, (Shard(0), Shard(0), R, Shard(0)),
                  dict(offset=torch.tensor([3, 40]), scaling=dyn), None)
    run_rope_case("dynamic, global seq_len, seq", q, k, (Shard(1), Shard(1), Shard(1), R),
                  dict(positions=pos2, scaling=dyn, seq_len=61), Shard(1))
    run_rope_case("dynamic, global seq_len, batch", q, k, (Shard(0), Shard(0), Shard(0), R),
                  dict(positions=pos2, scaling=dyn, seq_len=61), Shard(0))
    run_rope_case("dynamic batch, positions (S,)", q, k, (Shard(0), Shard(0), R, R),
                  dict(positions=pos2[1], scaling=dyn), Shard(0))


@check
def rope_multi_axis_and_packed():
    _, Replicate, Shard, _, _ = env()
    R = Replicate()
    B, S, H, D = 2, 8, 2, 16
    q, k = rand(B, H, S, D, seed=21), rand(B, H, S, D, seed=22)
    pos3 = randint(30, (3, B, S), 23)
    kw = dict(positions=pos3, sections=[2, 3, 3], sections_mode="mrope", layout="bhsd")
    run_rope_case("mrope batch", q, k, (Shard(0), Shard(0), Shard(1), R), kw, Shard(0))
    run_rope_case("mrope seq", q, k, (Shard(2), Shard(2), Shard(2), R), kw, Shard(2))
    run_rope_case("mrope (3,S) seq", q, k, (Shard(2), Shard(2), Shard(1), R), {**kw, "positions": pos3[:, 0]},
                  Shard(2))
    run_rope_case("axial heads", q, k, (Shard(1), Shard(1), R, R), {**kw, "sections_mode": "axial"}, Shard(1))
    T = 12
    qt, kt = rand(T, 4, D, seed=24), rand(T, 2, D, seed=25)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    run_rope_case("thd heads", qt, kt, (Shard(1), Shard(1), R, R), dict(cu_seqlens=cu, layout="thd"), Shard(1))
    run_rope_case("thd heads offsets", qt, kt, (Shard(1), Shard(1), R, R),
                  dict(cu_seqlens=cu, layout="thd", offset=torch.tensor([4, 9])), Shard(1))
    # Token-sharded packed input: no rule (cu_seqlens describe the whole pack) -> replicated.
    run_rope_case("thd tokens -> gathered, handed back split", qt, kt, (Shard(0), Shard(0), R, R),
                  dict(cu_seqlens=cu, layout="thd"), Shard(0))


@check
def rope_inplace():
    from posenc.functional import apply_rope

    mesh, Replicate, Shard, _, distribute_tensor = env()
    q, k = rand(2, 8, 4, 16, seed=31), rand(2, 8, 2, 16, seed=32)
    pos = randint(50, (2, 8), 33)
    want_q, want_k = apply_rope(q, k, positions=pos)
    for pl, pos_pl in ((Shard(2), Replicate()), (Shard(0), Shard(0)), (Shard(1), Shard(1)), (Replicate(), Shard(1))):
        dq, dk = distribute_tensor(q, mesh, [pl]), distribute_tensor(k, mesh, [pl])
        with torch.no_grad():
            apply_rope(dq, dk, positions=distribute_tensor(pos, mesh, [pos_pl]), inplace=True)
        assert dq.placements == (pl,) and dk.placements == (pl,)
        close(dq.full_tensor(), want_q, f"inplace q {pl}")
        close(dk.full_tensor(), want_k, f"inplace k {pl}")
    # q and k placed differently: a redistributed copy of k would be rotated, not k -> error.
    dq, dk = distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Replicate()])
    try:
        apply_rope(dq, dk, positions=distribute_tensor(pos, mesh, [Replicate()]), inplace=True)
    except RuntimeError as e:
        assert "in place" in str(e) or "in-place" in str(e), str(e)
    else:
        raise AssertionError("rope_ with k needing a redistribution did not raise")
    # Sequence-sharded without positions: no rule keeps q's placement -> error, not a wrong answer.
    dq = distribute_tensor(q, mesh, [Shard(1)])
    try:
        apply_rope(dq, inplace=True)
    except RuntimeError:
        pass
    else:
        raise AssertionError("rope_ on a sequence-sharded q without positions did not raise")


@check
def qk_norm_rope_inplace():
    """qk_norm_rope(..., inplace=True) on DTensors: the in-place op's rule keeps q's and k's
    placements (heads for norm "head", batch, sequence with positions, replicated), and
    refuses what would write a redistributed copy (norm "hidden" has no heads sharding)."""
    from posenc.functional import qk_norm_rope

    mesh, Replicate, Shard, _, distribute_tensor = env()
    q, k = rand(2, 8, 4, 16, seed=41), rand(2, 8, 2, 16, seed=42)
    pos = randint(50, (2, 8), 43)
    for norm in ("head", "hidden"):
        wq = rand(16 if norm == "head" else 64, seed=44) + 1.5
        wk = rand(16 if norm == "head" else 32, seed=45) + 1.5
        want_q, want_k = qk_norm_rope(q, k, wq, wk, norm=norm, positions=pos)
        cases = [(Shard(0), Shard(0)), (Shard(1), Shard(1)), (Replicate(), Replicate())]
        if norm == "head":
            cases.append((Shard(2), Replicate()))
        for pl, pos_pl in cases:
            # Copies: a replicated DTensor may share the plain tensor's storage, which the
            # in-place call would then overwrite for the next case.
            dq, dk = distribute_tensor(q.clone(), mesh, [pl]), distribute_tensor(k.clone(), mesh, [pl])
            with torch.no_grad():
                out = qk_norm_rope(dq, dk, wq, wk, norm=norm, positions=distribute_tensor(pos, mesh, [pos_pl]),
                                   inplace=True)
            assert out[0] is dq and out[1] is dk
            assert dq.placements == (pl,) and dk.placements == (pl,), (norm, pl, dq.placements)
            close(dq.full_tensor(), want_q, f"qk_norm_rope inplace q {norm} {pl}")
            close(dk.full_tensor(), want_k, f"qk_norm_rope inplace k {norm} {pl}")
    # norm "hidden" reduces over the heads: heads-sharded q and k would be redistributed -> error.
    dq, dk = distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)])
    try:
        with torch.no_grad():
            qk_norm_rope(dq, dk, rand(64, seed=46), rand(32, seed=47), norm="hidden", inplace=True)
    except RuntimeError as e:
        assert "in place" in str(e) or "in-place" in str(e), str(e)
    else:
        raise AssertionError("qk_norm_rope_ with norm 'hidden' on heads-sharded q did not raise")


def run_add_case(name, x, table, placements, kwargs, expect, p=0.0, seed=None):
    from torch.distributed.tensor import DTensor

    mesh, Replicate, Shard, _, distribute_tensor = env()
    xp, tp, pp = placements
    ref_x = x.clone().requires_grad_()
    ref_t = table.clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    ref = torch.ops.posenc.add_position(ref_x, ref_t, kwargs.get("positions"), kwargs.get("offset", 0),
                                        kwargs.get("batch_first", True), p)
    dx = distribute_tensor(x, mesh, [xp]).requires_grad_()
    dt = distribute_tensor(table, mesh, [tp]).requires_grad_()
    pos = kwargs.get("positions")
    dpos = None if pos is None else distribute_tensor(pos, mesh, [pp])
    if seed is not None:
        torch.manual_seed(seed)
    out = torch.ops.posenc.add_position(dx, dt, dpos, kwargs.get("offset", 0), kwargs.get("batch_first", True), p)
    assert isinstance(out, DTensor)
    close(out.full_tensor(), ref.detach(), f"{name} forward")
    if expect is not None:
        assert out.placements == (expect,), f"{name}: output placed {out.placements}, expected {expect}"
    g = rand(*ref.shape, seed=41)
    ref.backward(g)
    out.backward(distribute_tensor(g, mesh, out.placements))
    close(dx.grad.full_tensor(), ref_x.grad, f"{name} grad x")
    close(dt.grad.full_tensor(), ref_t.grad, f"{name} grad table")
    # The table alone (the fixed-buffer case: add_position_backward only).
    with torch.no_grad():
        dx2 = distribute_tensor(x, mesh, [xp]).requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    out2 = torch.ops.posenc.add_position(dx2, dt.detach(), dpos, kwargs.get("offset", 0),
                                         kwargs.get("batch_first", True), p)
    out2.backward(distribute_tensor(g, mesh, out2.placements))
    close(dx2.grad.full_tensor(), ref_x.grad, f"{name} grad x (fixed table)")


@check
def add_position_rules():
    _, Replicate, Shard, _, _ = env()
    R = Replicate()
    B, S, D, L = 4, 6, 8, 20
    for batch_first in (True, False):
        b, s = (0, 1) if batch_first else (1, 0)
        x = rand(*((B, S, D) if batch_first else (S, B, D)), seed=51)
        for table in (rand(L, D, seed=52), rand(1, L, D, seed=53)):
            t_last = table.dim() - 1
            pos2 = randint(L, (B, S), 54)
            pos1 = randint(L, (S,), 55)
            bf = dict(batch_first=batch_first)
            cases = [
                ("replicate", (R, R, R), dict(offset=3), R),
                ("batch", (Shard(b), R, R), dict(offset=3), Shard(b)),
                ("batch+positions(B,S)", (Shard(b), R, Shard(0)), dict(positions=pos2), Shard(b)),
                ("batch+positions(S,)", (Shard(b), R, R), dict(positions=pos1), Shard(b)),
                ("hidden", (Shard(2), Shard(t_last), R), dict(offset=5), Shard(2)),
                ("hidden+positions", (Shard(2), Shard(t_last), R), dict(positions=pos2), Shard(2)),
                ("hidden, table replicated", (Shard(2), R, R), dict(offset=1), Shard(2)),
                ("seq+positions(S,)", (Shard(s), R, Shard(0)), dict(positions=pos1), Shard(s)),
                ("seq+positions(B,S)", (Shard(s), R, Shard(1)), dict(positions=pos2), Shard(s)),
                ("table sharded on positions", (Shard(b), Shard(t_last - 1), R), dict(offset=2), None),
            ]
            for name, placements, kwargs, expect in cases:
                run_add_case(f"bf={batch_first} table{table.dim()}D {name}", x, table, placements, {**kwargs, **bf},
                             expect)
            # Inference mode skips the autograd kernel: DTensor sees the op add_position itself.
            mesh, _, _, _, distribute_tensor = env()
            with torch.inference_mode():
                got = torch.ops.posenc.add_position(distribute_tensor(x, mesh, [Shard(b)]),
                                                    distribute_tensor(table, mesh, [R]),
                                                    distribute_tensor(pos2, mesh, [Shard(0)]), 0, batch_first, 0.0)
                want = torch.ops.posenc.add_position(x, table, pos2, 0, batch_first, 0.0)
            assert got.placements == (Shard(b),), got.placements
            close(got.full_tensor(), want, "inference mode")
            name = f"bf={batch_first} table{table.dim()}D seq without positions"
            run_add_case(name, x, table, (Shard(s), R, R), dict(offset=2, **bf), None)
            out_pl = run_and_place(x, table, Shard(s), dict(offset=2, **bf))
            assert out_pl != (Shard(s),), f"{name}: a sequence-sharded output without positions"


def run_and_place(x, table, xp, kwargs):
    mesh, Replicate, _, _, distribute_tensor = env()
    out = torch.ops.posenc.add_position(distribute_tensor(x, mesh, [xp]), distribute_tensor(table, mesh, [Replicate()]),
                                        None, kwargs["offset"], kwargs["batch_first"], 0.0)
    return out.placements


@check
def dropout_under_sharding():
    """p > 0: only the replicated rule; every rank draws the whole tensor's mask, equal to a
    single-process run under the same seed (forward and backward). Local (plain) calls on
    each rank's shard draw from the rank's own generator and the local element index."""
    mesh, Replicate, Shard, _, distribute_tensor = env()
    x, table = rand(4, 6, 8, seed=61), rand(20, 8, seed=62)
    for xp in (Replicate(), Shard(0), Shard(1), Shard(2)):
        pos = randint(20, (4, 6), 63)
        pp = Shard(1) if xp == Shard(1) else Replicate()
        run_add_case(f"dropout x {xp}", x, table, (xp, Replicate(), pp), dict(positions=pos), Replicate(), p=0.3,
                     seed=1234)
    # Local calls, ranks seeded alike: equal-shaped shards draw the same mask pattern.
    rank = dist.get_rank()
    torch.manual_seed(7)
    local = torch.ones(2, 6, 8, dtype=torch.float64)
    out = torch.ops.posenc.add_position(local, torch.zeros(20, 8, dtype=torch.float64), None, 0, True, 0.5)
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    assert torch.equal(gathered[0], gathered[1]), "same seed, same local shape: the same mask"
    torch.manual_seed(7 + rank)
    out = torch.ops.posenc.add_position(local, torch.zeros(20, 8, dtype=torch.float64), None, 0, True, 0.5)
    dist.all_gather(gathered, out)
    assert not torch.equal(gathered[0], gathered[1]), "seeds differing per rank: different masks"


@check
def sinusoidal_table_and_bounds():
    mesh, Replicate, Shard, _, distribute_tensor = env()
    from torch.distributed.tensor.experimental import implicit_replication

    pos = randint(1000, (4, 6), 71)
    want = torch.ops.posenc.sinusoidal_table(pos, 10, 10000.0)
    for pl in (Replicate(), Shard(0), Shard(1)):
        out = torch.ops.posenc.sinusoidal_table(distribute_tensor(pos, mesh, [pl]), 10, 10000.0)
        assert out.placements == (pl,), out.placements
        close(out.full_tensor(), want, f"sinusoidal_table {pl}")
    # Differentiable float positions: the C++ backward builds its frequencies as plain tensors,
    # which DTensor accepts as replicated under implicit_replication().
    t = rand(6, seed=72).abs() * 100
    ref_t = t.clone().requires_grad_()
    ref = torch.ops.posenc.sinusoidal_table(ref_t, 8, 10000.0)
    g = rand(6, 8, seed=73)
    ref.backward(g)
    dt = distribute_tensor(t, mesh, [Shard(0)]).requires_grad_()
    out = torch.ops.posenc.sinusoidal_table(dt, 8, 10000.0)
    close(out.full_tensor(), ref.detach(), "float positions")
    with implicit_replication():
        out.backward(distribute_tensor(g, mesh, [Shard(0)]))
    close(dt.grad.full_tensor(), ref_t.grad, "float positions grad")
    # Bounds: the global ones on every rank.
    pos = torch.arange(12).reshape(2, 6)
    for pl in (Replicate(), Shard(0), Shard(1)):
        lo, hi = torch.ops.posenc.position_bounds(distribute_tensor(pos, mesh, [pl]), 100)
        assert (lo, hi) == (0, 11), (pl, lo, hi)
        try:
            torch.ops.posenc.position_bounds(distribute_tensor(pos, mesh, [pl]), 11)
        except IndexError:
            pass
        else:
            raise AssertionError("position 11 >= max_len 11 not refused on every rank")
    q = rand(2, 6, 2, 4, seed=74)
    dq = distribute_tensor(q, mesh, [Shard(1)])
    assert torch.ops.posenc.rope_position_bounds(dq, None, distribute_tensor(pos, mesh, [Shard(1)])) == (0, 11)
    assert torch.ops.posenc.rope_position_bounds(dq, offset=4) == (4, 9)
    # The device-side form (a compiled module's check): the global bounds, as a plain tensor.
    ext = torch.ops.posenc.rope_position_extremes(dq, None, distribute_tensor(pos, mesh, [Shard(1)]), offset=2)
    assert ext.tolist() == [2, 13], ext


@check
def helper_ops():
    """make_positions, timestep_embedding, resample_position_table: ATen compositions."""
    import posenc.functional as F

    mesh, Replicate, Shard, _, distribute_tensor = env()
    tokens = torch.tensor([[5, 6, 1, 1, 7, 8], [7, 8, 9, 1, 2, 3]])
    want = F.make_positions(tokens, 1)
    for pl in (Replicate(), Shard(0), Shard(1)):
        close(F.make_positions(distribute_tensor(tokens, mesh, [pl]), 1).full_tensor(), want, f"make_positions {pl}")
    # timestep_embedding builds its frequencies as a plain tensor: DTensor refuses the mix
    # (a clear error) unless told that plain tensors are replicated.
    from torch.distributed.tensor.experimental import implicit_replication

    t = torch.tensor([0.0, 10.0, 999.0, 5.0])
    want = F.timestep_embedding(t, 32)
    try:
        F.timestep_embedding(distribute_tensor(t, mesh, [Shard(0)]), 32)
    except RuntimeError as e:
        assert "mixed torch.Tensor and DTensor" in str(e), str(e)
    else:
        raise AssertionError("timestep_embedding without implicit_replication: expected DTensor's error")
    for pl in (Replicate(), Shard(0)):
        with implicit_replication():
            got = F.timestep_embedding(distribute_tensor(t, mesh, [pl]), 32)
        close(got.full_tensor(), want, f"timestep {pl}")
    pe = rand(1, 1 + 16, 8, seed=81)
    want = F.resample_position_table(pe, (6, 6), num_prefix_tokens=1)
    # rope_cos_sin (plain frequencies inside: implicit_replication) and apply_rope_cos_sin
    # (an op with its rule: heads-, batch- and sequence-sharded q and k stay sharded).
    pos = randint(40, (2, 8), 82)
    cos, sin = F.rope_cos_sin(pos, 16, dtype=torch.float64)
    with implicit_replication():
        dcos, dsin = F.rope_cos_sin(distribute_tensor(pos, mesh, [Shard(1)]), 16, dtype=torch.float64)
    close(dcos.full_tensor(), cos, "rope_cos_sin cos")
    close(dsin.full_tensor(), sin, "rope_cos_sin sin")
    q, k = rand(2, 4, 8, 16, seed=83), rand(2, 2, 8, 16, seed=84)
    want_q, want_k = F.apply_rope_cos_sin(q, k, cos, sin)
    got_q, got_k = F.apply_rope_cos_sin(distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(k, mesh, [Shard(1)]),
                                        distribute_tensor(cos, mesh, [Replicate()]),
                                        distribute_tensor(sin, mesh, [Replicate()]))
    assert got_q.placements == (Shard(1),), got_q.placements
    close(got_q.full_tensor(), want_q, "apply_rope_cos_sin q")
    close(got_k.full_tensor(), want_k, "apply_rope_cos_sin k")
    for qk_p, table_p in ((Shard(0), Shard(0)), (Shard(2), Shard(1))):  # batch (per-row tables), sequence
        got_q, got_k = F.apply_rope_cos_sin(
            distribute_tensor(q, mesh, [qk_p]), distribute_tensor(k, mesh, [qk_p]),
            distribute_tensor(cos, mesh, [table_p]), distribute_tensor(sin, mesh, [table_p]))
        assert got_q.placements == (qk_p,) and got_k.placements == (qk_p,), (got_q.placements, qk_p)
        close(got_q.full_tensor(), want_q, f"apply_rope_cos_sin q {qk_p}")
        close(got_k.full_tensor(), want_k, f"apply_rope_cos_sin k {qk_p}")
    # Backward: the transposed rotation on the sharded gradient.
    qd = distribute_tensor(q, mesh, [Shard(1)]).requires_grad_()
    out = F.apply_rope_cos_sin(qd, None, distribute_tensor(cos, mesh, [Replicate()]),
                               distribute_tensor(sin, mesh, [Replicate()]))
    (grad_d,) = torch.autograd.grad((out * out).sum(), qd)
    q_plain = q.clone().requires_grad_()
    out_plain = F.apply_rope_cos_sin(q_plain, None, cos, sin)
    (grad_plain,) = torch.autograd.grad((out_plain * out_plain).sum(), q_plain)
    close(grad_d.full_tensor(), grad_plain, "apply_rope_cos_sin backward")
    # resample_position_table: torch 2.11's DTensor has no rule for ATen's antialiased bicubic
    # upsampling (a clear NotImplementedError; resample the full table, then place it); a later
    # torch's may have one, whose result must be the full table's.
    dpe = distribute_tensor(pe, mesh, [Shard(1)])
    try:
        direct = F.resample_position_table(dpe, (6, 6), num_prefix_tokens=1)
    except NotImplementedError:
        pass
    else:
        close(direct.full_tensor(), want, "resample of a DTensor (a DTensor rule of a later torch)")
    got = distribute_tensor(F.resample_position_table(dpe.full_tensor(), (6, 6), num_prefix_tokens=1), mesh, [Shard(1)])
    close(got.full_tensor(), want, "resample")


@check
def modules_with_dtensors():
    import posenc
    from posenc.distributed import accept_dtensor_inputs, sequence_positions
    from torch.distributed.tensor import DTensor

    mesh, Replicate, Shard, _, distribute_tensor = env()
    x = rand(2, 8, 16, seed=91)
    pe = posenc.PositionalEncoding(16, dropout=0.0, max_len=32).double()
    want = pe(x, offset=3)
    mod = accept_dtensor_inputs(posenc.PositionalEncoding(16, dropout=0.0, max_len=32).double())
    dx = distribute_tensor(x, mesh, [Shard(1)])
    out = mod(dx, positions=sequence_positions(dx, 1, offset=3))
    assert out.placements == (Shard(1),), out.placements
    close(out.full_tensor(), want, "PositionalEncoding sequence parallel")
    out = mod(distribute_tensor(x, mesh, [Shard(0)]), offset=3)
    assert out.placements == (Shard(0),)
    close(out.full_tensor(), want, "PositionalEncoding batch")
    dxb = distribute_tensor(x, mesh, [Shard(0)])
    pos_b = sequence_positions(dxb, 1, offset=3, batch_dim=0)  # (B, S), sharded on the batch like x
    assert pos_b.placements == (Shard(0),) and pos_b.shape == (2, 8)
    out = mod(dxb, positions=pos_b)
    assert out.placements == (Shard(0),)
    close(out.full_tensor(), want, "PositionalEncoding batch, (B, S) positions")
    assert not isinstance(mod.pe, DTensor)  # the buffer is wrapped for DTensor calls only
    close(mod(x, offset=3), want, "plain call after DTensor calls")
    # Plain positions beside a DTensor input: replicated by the hook.
    pos = randint(32, (2, 8), 92)
    close(mod(dx, positions=pos).full_tensor(), pe(x, positions=pos), "plain positions")
    # RoPE module, "dynamic": its range check reads the global bounds, so the sequence split holds.
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    rope = accept_dtensor_inputs(posenc.RotaryPositionalEncoding(16, max_len=64, scaling=dyn))
    q, k = rand(2, 8, 2, 16, seed=93), rand(2, 8, 2, 16, seed=94)
    pos = randint(60, (2, 8), 95)
    want_q, want_k = rope(q, k, positions=pos)
    dq, dk = distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(k, mesh, [Shard(1)])
    got_q, got_k = rope(dq, dk, positions=distribute_tensor(pos, mesh, [Shard(1)]))
    assert got_q.placements == (Shard(1),), got_q.placements
    close(got_q.full_tensor(), want_q, "rope module q")
    close(got_k.full_tensor(), want_k, "rope module k")
    got_q, _ = rope(dq, dk, positions=pos)  # plain positions: replicated -> DTensor moves q to a rule
    close(got_q.full_tensor(), want_q, "rope module, plain positions")
    bad = pos.clone()
    bad[1, 7] = 64  # >= max_len, on rank 1's shard only
    try:
        rope(dq, dk, positions=distribute_tensor(bad, mesh, [Shard(1)]))
    except IndexError:
        pass
    else:
        raise AssertionError("out-of-range position not refused on every rank")
    # A plain parameter with DTensor inputs is refused by the hook.
    lpe = accept_dtensor_inputs(posenc.LearnedPositionalEncoding(16, dropout=0.0, max_len=32).double())
    try:
        lpe(dx)
    except RuntimeError as e:
        assert "distribute" in str(e)
    else:
        raise AssertionError("plain parameter accepted")
    from torch.distributed.tensor import distribute_module

    distribute_module(lpe, mesh)  # replicates its parameter
    close(lpe(dx, offset=1).full_tensor(), torch.ops.posenc.add_position(x, lpe.pe.full_tensor(), None, 1, True, 0.0),
          "learned, distributed")


class TinyModel(torch.nn.Module):
    def __init__(self):
        import posenc

        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.pos = posenc.LearnedPositionalEncoding(16, dropout=0.0, max_len=12).double()
        self.rope = posenc.RotaryPositionalEncoding(8, max_len=12)
        self.out = torch.nn.Linear(16, 4, dtype=torch.float64)

    def forward(self, x):
        h = self.pos(self.inp(x))
        B, S, _ = h.shape
        q = h.view(B, S, 2, 8)
        qr, kr = self.rope(q, q * 0.5)
        att = torch.softmax(torch.einsum("bshd,bthd->bhst", qr, kr) / 8 ** 0.5, -1)
        return self.out(torch.einsum("bhst,bthd->bshd", att, q).reshape(B, S, 16))


def reference_step(data):
    model = TinyModel()
    loss = model(data).square().mean()
    loss.backward()
    return model, loss.detach()


@check
def ddp_equality():
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    data = rand(4, 10, 8, seed=101)
    ref, ref_loss = reference_step(data)
    model = DistributedDataParallel(TinyModel())
    local = data.chunk(world)[rank]
    loss = model(local).square().mean()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    close(total / world, ref_loss, "DDP loss")
    for (name, p), (_, q) in zip(model.module.named_parameters(), ref.named_parameters()):
        close(p.grad, q.grad, f"DDP grad {name}")


@check
def fsdp2_equality():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    mesh, _, Shard, _, _ = env()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = rand(4, 10, 8, seed=111)
    table = rand(12, 16, seed=112)
    ref = TinyModel()
    ref.pos.load_table(table)
    ref_loss = ref(data).square().mean()
    ref_loss.backward()
    model = TinyModel()

    def placement(param):  # the learned table on its position dimension, the rest as FSDP2's default
        return Shard(1) if param.dim() == 3 else None

    fully_shard(model.pos, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.pos.pe, DTensor) and model.pos.pe.placements == (Shard(1),)
    assert model.pos.pe.to_local().shape == (1, 6, 16)
    model.pos.load_table(rand(12, 16, seed=113))  # a plain table: each rank copies its shard
    close(model.pos.pe.full_tensor(), rand(12, 16, seed=113).unsqueeze(0), "load_table of a plain table")
    with implicit_replication():  # as before load_table distributed plain tables itself
        model.pos.load_table(table)
    close(model.pos.pe.full_tensor(), ref.pos.pe.detach(), "load_table into the sharded table")
    local = data.chunk(world)[rank]
    loss = model(local).square().mean()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    close(total / world, ref_loss.detach(), "FSDP2 loss")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(p.grad.full_tensor(), q.grad, f"FSDP2 grad {name}")


@check
def context_parallel():
    import posenc
    from posenc.distributed import context_parallel_indices, context_parallel_positions, packed_shard, shard_sequence
    from posenc.functional import apply_rope

    rank, world = dist.get_rank(), dist.get_world_size()
    B, S, H, D = 2, 16, 2, 16
    q, k = rand(B, S, H, D, seed=121), rand(B, S, 1, D, seed=122)
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    try:  # torch's (private) load balancers, when this torch has them
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
            _PerDocumentHeadTailLoadBalancer,
        )
    except ImportError:
        _HeadTailLoadBalancer = _PerDocumentHeadTailLoadBalancer = None

    balancers = [None, "head_tail"]
    if _HeadTailLoadBalancer is not None:
        balancers.append(_HeadTailLoadBalancer(S, world, "cpu"))
        assert torch.equal(context_parallel_indices(S, world, rank, "head_tail"),
                           context_parallel_indices(S, world, rank, balancers[2]))
    for lb in balancers:
        for kwargs in ({}, dict(offset=5), dict(scaling=dyn)):
            want_q, want_k = apply_rope(q, k, **kwargs)
            pos = context_parallel_positions(S, world, rank, lb, offset=kwargs.get("offset", 0))
            extra = {key: v for key, v in kwargs.items() if key != "offset"}
            if "scaling" in kwargs:
                extra["seq_len"] = S  # "dynamic": the global length (the local one would differ)
            got_q, got_k = apply_rope(shard_sequence(q, 1, world, rank, lb), shard_sequence(k, 1, world, rank, lb),
                                      positions=pos, **extra)
            close(got_q, shard_sequence(want_q, 1, world, rank, lb), f"cp q {lb} {kwargs}")
            close(got_k, shard_sequence(want_k, 1, world, rank, lb), f"cp k {lb} {kwargs}")
    # Documents packed in rows: per-document positions and torch's per-document balancer.
    docs = [[4, 12], [8, 8]]
    doc_pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    want_q = apply_rope(q, positions=doc_pos)
    lb = None if _PerDocumentHeadTailLoadBalancer is None else _PerDocumentHeadTailLoadBalancer(docs, world, "cpu")
    got_q = apply_rope(shard_sequence(q, 1, world, rank, lb),
                       positions=context_parallel_positions(S, world, rank, lb, positions=doc_pos))
    close(got_q, shard_sequence(want_q, 1, world, rank, lb), "per-document cp")
    # Additive encodings: positions of the shard.
    x = rand(B, S, 8, seed=123)
    pe = posenc.PositionalEncoding(8, dropout=0.0, max_len=64).double()
    for lb in (None, "head_tail"):
        got = pe(shard_sequence(x, 1, world, rank, lb), positions=context_parallel_positions(S, world, rank, lb))
        close(got, shard_sequence(pe(x), 1, world, rank, lb), f"cp add_position {lb}")
    # Packed "thd": per-shard cu_seqlens and offsets.
    T = 24
    qt, kt = rand(T, H, D, seed=124), rand(T, 1, D, seed=125)
    cu = torch.tensor([0, 5, 6, 17, 24], dtype=torch.int32)
    for offsets in (None, 3, torch.tensor([2, 0, 7, 1])):
        kw = {} if offsets is None else dict(offset=offsets)
        want_q, want_k = apply_rope(qt, kt, cu_seqlens=cu, layout="thd", **kw)
        for lb in (None, "head_tail", torch.randperm(T, generator=torch.Generator().manual_seed(9))):
            idx = context_parallel_indices(T, world, rank, lb)
            local_cu, local_off = packed_shard(cu, idx, offsets)
            assert local_cu.dtype == torch.int32
            got_q, got_k = apply_rope(qt[idx], kt[idx], cu_seqlens=local_cu, offset=local_off, layout="thd")
            close(got_q, want_q[idx], f"packed q {lb} {offsets}")
            close(got_k, want_k[idx], f"packed k {lb} {offsets}")


@check
def two_dim_mesh():
    """Rules expand over every mesh dimension: batch on one, sequence or heads on the other."""
    from posenc.functional import apply_rope
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "cp"))
    q, k = rand(2, 8, 4, 16, seed=141), rand(2, 8, 2, 16, seed=142)
    pos = randint(50, (2, 8), 143)
    want_q, want_k = apply_rope(q, k, positions=pos)
    for qp, pp in (([Shard(0), Shard(1)], [Shard(0), Shard(1)]), ([Shard(0), Shard(2)], [Shard(0), Replicate()])):
        dq, dk = distribute_tensor(q, mesh, qp), distribute_tensor(k, mesh, qp)
        got_q, got_k = apply_rope(dq, dk, positions=distribute_tensor(pos, mesh, pp))
        assert list(got_q.placements) == qp, got_q.placements
        close(got_q.full_tensor(), want_q, f"2-D mesh q {qp}")
        close(got_k.full_tensor(), want_k, f"2-D mesh k {qp}")
        with torch.no_grad():
            apply_rope(dq, dk, positions=distribute_tensor(pos, mesh, pp), inplace=True)
        close(dq.full_tensor(), want_q, f"2-D mesh in place {qp}")
    x, table = rand(2, 8, 6, seed=144), rand(16, 6, seed=145)
    want = torch.ops.posenc.add_position(x, table, pos % 16, 0, True, 0.0)
    got = torch.ops.posenc.add_position(distribute_tensor(x, mesh, [Shard(0), Shard(1)]),
                                        distribute_tensor(table, mesh, [Replicate(), Replicate()]),
                                        distribute_tensor(pos % 16, mesh, [Shard(0), Shard(1)]), 0, True, 0.0)
    assert list(got.placements) == [Shard(0), Shard(1)], got.placements
    close(got.full_tensor(), want, "2-D mesh add_position")


@check
def sharding_cache_keys():
    """DTensor caches a sharding decision per call signature: calls that differ only in which
    optional index tensor is given (positions (S,) vs per-row offsets (B,), same shape) must
    not share one. Batch-sharded, the two decide differently: (S,) positions stay replicated,
    (B,) offsets are split with the batch. With the default base both calls' argument tuples
    end early (DTensor drops trailing defaults) and differ in length; with base 5e5 they have
    the same length, and only None's place tells them apart: a cache key that dropped the
    None arguments (register_sharding's, static_argnum at the first int) gave the offsets call
    the positions call's decision (every rank's whole offsets beside its half batch)."""
    _, Replicate, Shard, _, _ = env()
    R = Replicate()
    q, k = rand(4, 4, 2, 16, seed=151), rand(4, 4, 2, 16, seed=152)
    idx = torch.tensor([5, 1, 9, 3])
    for base in (10000.0, 5e5):
        for _ in range(2):
            run_rope_case(f"positions (S,), batch, base {base}", q, k, (Shard(0), Shard(0), R, R),
                          dict(positions=idx, base=base), Shard(0))
            run_rope_case(f"offsets (B,), batch, offsets replicated, base {base}", q, k,
                          (Shard(0), Shard(0), R, R), dict(offset=idx, base=base), Shard(0))
            run_rope_case(f"offsets (B,), batch, base {base}", q, k, (Shard(0), Shard(0), R, Shard(0)),
                          dict(offset=idx, base=base), Shard(0))


@check
def positional_encoding_takes_dtensors():
    """PositionalEncoding (its pe a buffer) takes a DTensor x without accept_dtensor_inputs, as
    the functions do: pe and plain positions are replicated on x's mesh, the result equals the
    plain call and keeps x's placement, forward and backward. LearnedPositionalEncoding with a
    plain parameter is refused (each rank would train its own copy); distributed, it runs."""
    import posenc
    from posenc.distributed import sequence_positions
    from torch.distributed.tensor import DTensor, distribute_module

    mesh, _, Shard, _, distribute_tensor = env()
    x = rand(2, 8, 16, seed=171)
    pos = randint(32, (2, 8), 172)
    pe = posenc.PositionalEncoding(16, dropout=0.0, max_len=32).double()
    for name, placement, kwargs in [
        ("batch", Shard(0), dict(offset=3)),
        ("hidden", Shard(2), dict(offset=1)),
        ("batch, plain (B, S) positions", Shard(0), dict(positions=pos)),
        ("sequence, plain positions", Shard(1), dict(positions=pos)),
    ]:
        ref_x = x.clone().requires_grad_()
        want = pe(ref_x, **kwargs)
        dx = distribute_tensor(x, mesh, [placement]).requires_grad_()
        out = pe(dx, **kwargs)
        assert isinstance(out, DTensor), name
        assert out.placements == (placement,), f"{name}: {out.placements}"
        close(out.full_tensor(), want, f"PositionalEncoding {name}")
        grad = rand(*x.shape, seed=173)
        want.backward(grad)
        out.backward(distribute_tensor(grad, mesh, out.placements))
        close(dx.grad.full_tensor(), ref_x.grad, f"PositionalEncoding {name} grad x")
    dx = distribute_tensor(x, mesh, [Shard(1)])
    out = pe(dx, positions=sequence_positions(dx, 1, offset=3))
    assert out.placements == (Shard(1),), out.placements
    close(out.full_tensor(), pe(x, offset=3), "PositionalEncoding sequence parallel")
    assert not isinstance(pe.pe, DTensor) and "pe" in pe.state_dict()
    seq_major = posenc.PositionalEncoding(16, dropout=0.0, max_len=32, batch_first=False).double()
    xt = x.transpose(0, 1).contiguous()
    close(seq_major(distribute_tensor(xt, mesh, [Shard(1)]), offset=2).full_tensor(), seq_major(xt, offset=2),
          "PositionalEncoding seq-major, batch split")
    lpe = posenc.LearnedPositionalEncoding(16, dropout=0.0, max_len=32).double()
    try:
        lpe(dx)
    except RuntimeError as e:
        assert "parameter 'pe' is a plain tensor" in str(e) and "distribute" in str(e), str(e)
    else:
        raise AssertionError("a plain parameter was used with a DTensor input")
    distribute_module(lpe, mesh)  # replicates its parameter
    close(lpe(dx, offset=1).full_tensor(), torch.ops.posenc.add_position(x, lpe.pe.full_tensor(), None, 1, True, 0.0),
          "learned, distributed")
    # The replicated table's gradient from a batch split is Partial; torch.optim steps it as
    # DTensor arithmetic, which reduces it where the step adds it to the table: the replicas
    # stay equal, each the one-process step (docs/distributed.md).
    ref = lpe.pe.full_tensor().detach().clone().requires_grad_()
    grad = rand(*x.shape, seed=174)
    lpe(distribute_tensor(x, mesh, [Shard(0)]), offset=1).backward(distribute_tensor(grad, mesh, [Shard(0)]))
    torch.ops.posenc.add_position(x, ref, None, 1, True, 0.0).backward(grad)
    assert lpe.pe.grad.placements[0].is_partial(), lpe.pe.grad.placements
    torch.optim.SGD(lpe.parameters(), lr=0.5).step()
    with torch.no_grad():
        ref -= 0.5 * ref.grad
    local = lpe.pe.to_local().detach()
    replicas = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(replicas, local)
    assert all(torch.equal(r, replicas[0]) for r in replicas), "the replicas drifted apart"
    close(local, ref, "learned, replicated table stepped with its Partial gradient")


@check
def sequence_parallel_style_keeps_the_split():
    """torch's SequenceParallel style on PositionalEncoding and RotaryPositionalEncoding (each
    rank's part of the sequence in, its part out, as LayerNorm under the style): the modules
    returned the whole sequence replicated (DTensor gathered x: no positions), so with
    use_local_output each rank got the whole sequence as its part. Now each rank's part of the
    one-process call (gathered and handed back), without dropout and with it (the same mask as
    the one-process call); and the gradient of x."""
    import posenc
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh, _, Shard, _, distribute_tensor = env()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x = rand(2, 8, 16, seed=181)
    grad = rand(2, 8, 16, seed=182)
    for p in (0.0, 0.5):
        pe = posenc.PositionalEncoding(16, dropout=p, max_len=32).double()
        ref_x = x.clone().requires_grad_()
        torch.manual_seed(183)
        want = pe(ref_x)
        want.backward(grad)
        sp = parallelize_module(posenc.PositionalEncoding(16, dropout=p, max_len=32).double(), mesh,
                                SequenceParallel(use_local_output=True))
        local = x.chunk(world, 1)[rank].clone().requires_grad_()
        torch.manual_seed(183)
        got = sp(local)
        assert not isinstance(got, DTensor) and got.shape == local.shape, (p, type(got), got.shape)
        close(got, want.detach().chunk(world, 1)[rank], f"SequenceParallel p={p}")
        got.backward(grad.chunk(world, 1)[rank])
        close(local.grad, ref_x.grad.chunk(world, 1)[rank], f"SequenceParallel p={p} grad x")
    # RotaryPositionalEncoding alike (q alone: the style splits the first input), also with
    # "dynamic" scaling, whose length the rules read from the whole call (gathered).
    q = rand(2, 8, 4, 16, seed=185)
    for scaling in (None, {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}):
        rope = posenc.RotaryPositionalEncoding(16, max_len=64, scaling=scaling)
        ref_q = q.clone().requires_grad_()
        want = rope(ref_q, offset=1)
        want.backward(grad[..., :16].reshape(2, 8, 1, 16).expand(2, 8, 4, 16))
        sp = parallelize_module(posenc.RotaryPositionalEncoding(16, max_len=64, scaling=scaling), mesh,
                                SequenceParallel(use_local_output=True))
        local = q.chunk(world, 1)[rank].clone().requires_grad_()
        got = sp(local, offset=1)
        assert not isinstance(got, DTensor) and got.shape == local.shape, (scaling, type(got), got.shape)
        close(got, want.detach().chunk(world, 1)[rank], f"SequenceParallel RoPE {scaling}")
        got.backward(grad[..., :16].reshape(2, 8, 1, 16).expand(2, 8, 4, 16).chunk(world, 1)[rank])
        close(local.grad, ref_q.grad.chunk(world, 1)[rank], f"SequenceParallel RoPE {scaling} grad q")
    # qk_norm_rope alike (its own function), forward and gradients of q, k and the weights.
    k, w, wk = rand(2, 8, 2, 16, seed=186), rand(16, seed=187), rand(16, seed=188)
    for norm, weights in (("head", (w, wk)), ("hidden", (rand(64, seed=189), rand(32, seed=190)))):
        ref = [t.clone().requires_grad_() for t in (q, k, *weights)]
        want = posenc.functional.qk_norm_rope(*ref, norm=norm, offset=2)
        dq, dk = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k))
        dws = [t.clone().requires_grad_() for t in weights]
        got = posenc.functional.qk_norm_rope(dq, dk, *dws, norm=norm, offset=2)
        g = [rand(*t.shape, seed=191 + i) for i, t in enumerate(want)]
        torch.autograd.backward(want, g)
        assert [o.placements for o in got] == [(Shard(1),)] * 2, [o.placements for o in got]
        torch.autograd.backward(got, [distribute_tensor(t, mesh, [Shard(1)]) for t in g])
        for i, (o, r) in enumerate(zip(got, want)):
            close(o.full_tensor(), r.detach(), f"qk_norm_rope {norm} sequence split {i}")
        close(dq.grad.full_tensor(), ref[0].grad, f"qk_norm_rope {norm} grad q")
        close(dk.grad.full_tensor(), ref[1].grad, f"qk_norm_rope {norm} grad k")
        for dw, r in zip(dws, ref[2:]):
            got_w = dw.grad.full_tensor() if isinstance(dw.grad, DTensor) else dw.grad
            close(got_w, r.grad, f"qk_norm_rope {norm} grad weight")
    # The function keeps x's placement too, offset included.
    dx = distribute_tensor(x, mesh, [Shard(1)])
    table = rand(32, 16, seed=184)
    out = posenc.functional.add_position(dx, table, offset=5)
    assert out.placements == (Shard(1),), out.placements
    close(out.full_tensor(), posenc.functional.add_position(x, table, offset=5), "add_position split, offset 5")
    try:  # the op's ValueError, which DTensor's sharding propagation re-raises as a RuntimeError
        posenc.functional.add_position(dx, table, offset=30)
    except (ValueError, RuntimeError) as e:
        assert "plus offset 30 exceeds max_len=32" in str(e), str(e)
    else:
        raise AssertionError("rows past the table were accepted")
    # An uneven split (7 rows over the ranks, as distribute_tensor chunks them), with dropout.
    x7 = rand(2, 7, 16, seed=195)
    torch.manual_seed(196)
    want = posenc.functional.add_position(x7, table, offset=1, p=0.5)
    torch.manual_seed(196)
    out = posenc.functional.add_position(distribute_tensor(x7, mesh, [Shard(1)]), table, offset=1, p=0.5)
    assert out.placements == (Shard(1),), out.placements
    close(out.full_tensor(), want, "add_position uneven split, dropout")


@check
def learned_padding_idx_with_a_dtensor_table():
    """LearnedPositionalEncoding(padding_idx=...) with its table distributed (replicated,
    sharded over positions or features): the padding row's freeze (a mask replicated beside the
    table) gives the plain module's values and table gradient, the padding row's zero."""
    import posenc
    from torch.distributed.tensor import DTensor

    mesh, Replicate, Shard, _, distribute_tensor = env()
    x = rand(2, 6, 8, seed=191)
    pos = torch.tensor([[0, 1, 2, 1, 1, 5], [1, 3, 4, 5, 6, 7]])
    for placement in (Replicate(), Shard(1), Shard(2)):
        plain = posenc.LearnedPositionalEncoding(8, dropout=0.0, max_len=8, padding_idx=1).double()
        sharded = posenc.LearnedPositionalEncoding(8, dropout=0.0, max_len=8, padding_idx=1).double()
        sharded.pe = torch.nn.Parameter(distribute_tensor(plain.pe.detach().clone(), mesh, [placement]))
        out = sharded(distribute_tensor(x, mesh, [Replicate()]), positions=pos)
        want = plain(x, positions=pos)
        assert isinstance(out, DTensor)
        close(out.full_tensor(), want, f"padding_idx {placement}")
        grad = rand(*x.shape, seed=192)
        want.backward(grad)
        out.backward(distribute_tensor(grad, mesh, out.placements))
        got = sharded.pe.grad.full_tensor()
        close(got, plain.pe.grad, f"padding_idx {placement} table grad")
        assert torch.equal(got[0, 1], torch.zeros(8, dtype=torch.float64)), placement
        # reset_parameters on the distributed table zeroes the padding row (on a table sharded
        # over positions, pe[..., 1, :].zero_() wrote to DTensor's gathered copy: the row
        # stayed random), as FSDP2's deferred init (meta, to_empty, reset) calls it.
        sharded.reset_parameters()
        table = sharded.pe.full_tensor()
        assert torch.equal(table[0, 1], torch.zeros(8, dtype=torch.float64)), placement
        assert table[0, 0].abs().sum() > 0 and not torch.signbit(table[0, 1]).any(), placement
        # PositionalEncoding's reset of a distributed buffer (it mixed a plain table into the
        # DTensor's copy_ and raised): each rank's part of the table.
        fixed = posenc.PositionalEncoding(8, dropout=0.0, max_len=8).double()
        fixed.reset_parameters()  # the float64 table (.double() widened the float32 one)
        want_pe = fixed.pe.detach().clone()
        fixed.pe = distribute_tensor(torch.zeros_like(want_pe), mesh, [placement])
        fixed.reset_parameters()
        assert torch.equal(fixed.pe.full_tensor(), want_pe), placement


@check
def sharded_values_read_whole():
    """Values read on the host from sharded tensors are the global tensor's (a review found each
    rank reading its own shard): rope_cos_sin's "dynamic" scale (the longest position: rank 0
    scaled by its shard's 3 + 1, tables 0.21 off); an out-of-range position in one rank's shard
    of add_position's positions (PositionalEncoding, a distributed LearnedPositionalEncoding,
    the function) an IndexError on every rank, not on that rank alone (the others went on to
    block in their next collective). And accept_dtensor_inputs keeps a buffer that forward
    reassigns (it put the pre-call one back)."""
    import posenc
    import posenc.functional as F
    from posenc.distributed import accept_dtensor_inputs
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.experimental import implicit_replication

    mesh, Replicate, Shard, _, distribute_tensor = env()
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 60], [7, 1, 2, 3, 4, 5, 6, 9]])  # 60 in rank 1's half
    want = F.rope_cos_sin(pos, 16, scaling=dyn, dtype=torch.float64)
    for pl in (Shard(1), Shard(0)):
        with implicit_replication():
            got = F.rope_cos_sin(distribute_tensor(pos, mesh, [pl]), 16, scaling=dyn, dtype=torch.float64)
        for g, w in zip(got, want):
            close(g.full_tensor(), w, f"rope_cos_sin dynamic {pl}")

    bad = torch.tensor([0, 1, 2, 9])  # 9 >= max_len 8, in rank 1's shard
    x = rand(2, 4, 6, seed=181)
    learned = posenc.LearnedPositionalEncoding(6, dropout=0.0, max_len=8).double()
    distribute_module(learned, mesh)
    calls = {
        "PositionalEncoding": lambda dx, dp: posenc.PositionalEncoding(6, dropout=0.0, max_len=8).double()(
            dx, positions=dp),
        "LearnedPositionalEncoding": lambda dx, dp: learned(dx, positions=dp),
        "add_position": lambda dx, dp: F.add_position(dx, torch.zeros(8, 6, dtype=torch.float64), positions=dp),
    }
    for name, call in calls.items():
        try:
            call(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(bad, mesh, [Shard(0)]))
        except IndexError as e:
            assert "found 9" in str(e), str(e)
        else:
            raise AssertionError(f"{name}: position 9 >= max_len 8 on rank 1's shard not refused on rank "
                                 f"{dist.get_rank()}")
    # Replicated positions (plain ones beside a DTensor x become those) are sharded with x by
    # the rule: their bounds too are checked whole (a review proposed checking sharded ones only;
    # rank 1 then raised alone and rank 0 blocked).
    good = torch.tensor([0, 1, 2, 7])
    for name, call in calls.items():
        want = call(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(good, mesh, [Shard(0)]))
        for positions in (good, distribute_tensor(good, mesh, [Replicate()])):
            out = call(distribute_tensor(x, mesh, [Shard(1)]), positions)
            close(out.full_tensor(), want.full_tensor(), f"{name} replicated positions")
        try:
            call(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(bad, mesh, [Replicate()]))
        except IndexError as e:
            assert "found 9" in str(e), str(e)
        else:
            raise AssertionError(f"{name}: replicated position 9 >= max_len 8 not refused on rank "
                                 f"{dist.get_rank()}")
    # The RoPE functions' own limit (positions and offsets within 2**53), checked by the kernel
    # on each rank's shard: rank 1 alone raised (rank 0 went on to its next collective). With
    # check_inputs=True the functions gather the bounds first (the module always does).
    q = rand(2, 8, 2, 16, seed=183)
    far = torch.arange(8)
    far[6] = 2**60  # in rank 1's half
    w = torch.ones(16, dtype=torch.float64)
    rope_calls = {
        "apply_rope positions": lambda: F.apply_rope(distribute_tensor(q, mesh, [Shard(1)]),
                                                     positions=distribute_tensor(far, mesh, [Shard(0)]),
                                                     check_inputs=True),
        "apply_rope offsets": lambda: F.apply_rope(distribute_tensor(q, mesh, [Shard(0)]),
                                                   offset=distribute_tensor(torch.tensor([0, 2**60]), mesh, [Shard(0)]),
                                                   check_inputs=True),
        "qk_norm_rope positions": lambda: F.qk_norm_rope(
            distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(q, mesh, [Shard(1)]), w, w,
            positions=distribute_tensor(far, mesh, [Shard(0)]), check_inputs=True),
        "RotaryPositionalEncoding positions": lambda: posenc.RotaryPositionalEncoding(16, max_len=2**62)(
            distribute_tensor(q, mesh, [Shard(1)]), positions=distribute_tensor(far, mesh, [Shard(0)])),
    }
    for name, call in rope_calls.items():
        try:
            call()
        except ValueError as e:
            assert "2**53" in str(e), str(e)
        else:
            raise AssertionError(f"{name}: 2**60 on rank 1's shard not refused on rank {dist.get_rank()}")

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls = self.calls + 1
            return x * 2

    counter = accept_dtensor_inputs(Counter())
    for _ in range(2):
        counter(distribute_tensor(x, mesh, [Replicate()]))
    counter(x)
    assert type(counter.calls) is torch.Tensor and int(counter.calls) == 3, counter.calls


@check
def accept_dtensor_inputs_from_threads():
    """A module wrapped by accept_dtensor_inputs called from two threads, one with DTensors and
    one with plain tensors: the plain calls saw the other call's DTensor buffer ("mixed
    torch.Tensor and DTensor"), and the buffer could stay a DTensor after both had finished
    (their records of it shared one stack). Now one call at a time: no error, the buffer
    plain afterwards, every result the plain call's."""
    import sys
    import threading

    import posenc
    from posenc.distributed import accept_dtensor_inputs

    mesh, Replicate, _, _, distribute_tensor = env()
    module = accept_dtensor_inputs(posenc.PositionalEncoding(8, dropout=0.0, max_len=16).double())
    x = rand(2, 5, 8, seed=191)
    want = module(x)
    dx = distribute_tensor(x, mesh, [Replicate()])
    errors, wrong = [], []

    def loop(call):
        try:
            for _ in range(300):
                out = call()
                out = out.to_local() if hasattr(out, "to_local") else out
                if not torch.equal(out, want):
                    wrong.append(out)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=loop, args=(call,), daemon=True)
                   for call in (lambda: module(dx), lambda: module(x), lambda: module(dx))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads) and not errors and not wrong, (errors[:2], len(wrong))
    assert type(module.pe) is torch.Tensor and type(module.state_dict()["pe"]) is torch.Tensor


@check
def docs_example():
    """docs/distributed.md's DTensor example, run as written on each rank (its own assertions
    compare the sharded results with one-process calls; its one-process group set-up and
    tear-down are skipped here, where the group has every rank)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    block = re.search(r"^```python\n(.*?)^```", page, flags=re.S | re.M).group(1)
    assert "dist.destroy_process_group()" in block and "q_tp" in block
    block = block.replace("dist.destroy_process_group()", "")
    names: dict = {}
    exec(compile(block, "docs/distributed.md (DTensor)", "exec"), names)
    assert names["world"] == dist.get_world_size() == 2
    assert names["q_tp"].placements[0].is_shard(2) and names["y"].placements[0].is_shard(1)

def main(rank, world, port, out_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    import posenc.distributed  # noqa: F401  (registers the sharding rules)

    only = os.environ.get("POSENC_DIST_CHECKS")
    results = {}
    for fn in CHECKS:
        if only and fn.__name__ not in only.split(","):
            continue
        try:
            fn()
            results[fn.__name__] = "ok"
        except Exception:  # noqa: BLE001  (reported per check)
            results[fn.__name__] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
