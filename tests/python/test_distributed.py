"""posenc under torch.distributed (2 ranks, gloo, CPU): DTensor sharding rules of every op
(forward and backward equal to the single-process result, float64, and the output kept
sharded where a rule applies), DDP and FSDP2 equality with one process, context-parallel
shards equal to slices of the full result, dropout under sharding.

The checks live in distributed_checks.py; one process group of 2 ranks runs them all (one
start-up for the whole file), each rank writes its results, and each check is one test here.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distributed_checks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORLD = 2
TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.pop("POSENC_DIST_CHECKS", None)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "distributed_checks.py"), str(rank), str(WORLD), str(port), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.communicate()
        pytest.fail(f"the {WORLD}-rank process group did not finish within {TIMEOUT_S} s")
    per_rank = []
    for rank, proc in enumerate(procs):
        path = out / f"rank{rank}.json"
        if proc.returncode != 0 or not path.is_file():
            pytest.fail(f"rank {rank} exited with {proc.returncode}:\n{logs[rank][-4000:]}")
        per_rank.append(json.loads(path.read_text()))
    return per_rank


@pytest.mark.parametrize("name", [fn.__name__ for fn in distributed_checks.CHECKS])
def test_distributed(results, name):
    for rank, ranked in enumerate(results):
        assert name in ranked, f"rank {rank} did not run {name}"
        assert ranked[name] == "ok", f"rank {rank}, {name}:\n{ranked[name]}"


def test_import_posenc_leaves_dtensor_alone():
    """``import posenc`` does not import the DTensor machinery; ``posenc.distributed`` does,
    and registers its rules once (idempotent)."""
    code = (
        "import sys, posenc\n"
        "assert 'torch.distributed.tensor' not in sys.modules and 'posenc.distributed' not in sys.modules\n"
        "import posenc.distributed as d\n"
        "from torch.distributed.tensor import DTensor\n"
        "prop = DTensor._op_dispatcher.sharding_propagator\n"
        "import torch\n"
        "assert torch.ops.posenc.rope.default in prop.op_strategy_funcs\n"
        "d.register_sharding_rules()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_context_parallel_helpers_single_process():
    """The index helpers against torch's own load balancer and torch.chunk, no process group."""
    from posenc.distributed import context_parallel_indices, packed_shard

    balancers = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    _HeadTailLoadBalancer = balancers._HeadTailLoadBalancer
    S, W = 16, 4
    order = _HeadTailLoadBalancer(S, W, "cpu")._generate_indices()[0]
    got = torch.cat([context_parallel_indices(S, W, r, "head_tail") for r in range(W)])
    assert torch.equal(got, order.long())
    assert torch.equal(torch.cat([context_parallel_indices(10, 4, r) for r in range(4)]), torch.arange(10))
    assert context_parallel_indices(10, 4, 3).tolist() == [9]
    cu, off = packed_shard(torch.tensor([0, 5, 6, 17]), torch.tensor([4, 5, 6, 7, 16, 0]), torch.tensor([1, 2, 3]))
    assert cu.tolist() == [0, 1, 2, 4, 5, 6] and off.tolist() == [5, 2, 3, 13, 1]
    with pytest.raises(ValueError, match="head-tail"):
        context_parallel_indices(10, 4, 0, "head_tail")
    with pytest.raises(ValueError, match="rank"):
        context_parallel_indices(10, 4, 4)


def test_context_parallel_helpers_refuse_what_they_would_misread():
    """Each of these returned a result: positions of another length cut to the indices,
    float positions, offsets and indices truncated, an index list that is not a permutation
    (a token twice, one past seq_len), cu_seqlens not from 0 or decreasing (negative
    offsets), a float seq_len (float indices); others raised Python's errors about tuples or
    attributes instead of naming the argument."""
    from posenc.distributed import (context_parallel_indices, context_parallel_positions, packed_shard,
                                    sequence_positions, shard_sequence)

    calls = [
        (ValueError, "with seq_len=4 entries", lambda: context_parallel_positions(4, 2, 1, positions=torch.arange(10, 16))),
        (ValueError, "with seq_len=4 entries", lambda: context_parallel_positions(4, 2, 1, positions=torch.arange(3))),
        (TypeError, "integer positions", lambda: context_parallel_positions(2, 2, 1, positions=torch.tensor([2.7, 3.9]))),
        (TypeError, "expected offset to be an int", lambda: context_parallel_positions(4, 2, 1, offset=0.5)),
        (TypeError, "expected offset to be an int", lambda: sequence_positions(torch.zeros(1, 5), 1, offset=0.5)),
        (ValueError, "permutation", lambda: context_parallel_indices(4, 2, 1, torch.tensor([0, 0, 0, 9]))),
        (ValueError, "permutation", lambda: context_parallel_indices(4, 2, 1, torch.tensor([[0, 1, 2, 3], [0, 1, 1, 3]]))),
        (TypeError, "integer rearrange indices", lambda: context_parallel_indices(4, 2, 1, torch.tensor([0.0, 1, 2, 3]))),
        (TypeError, "expected seq_len to be an int", lambda: context_parallel_indices(8.0, 2, 1)),
        (ValueError, "expected seq_len >= 0", lambda: context_parallel_indices(-1, 2, 1)),
        (TypeError, "expected rank to be an int", lambda: context_parallel_indices(4, 2, 1.0)),
        (TypeError, "expected world_size to be an int", lambda: context_parallel_indices(4, "2", 1)),
        (TypeError, "expected load_balance", lambda: context_parallel_indices(4, 2, 1, 1)),
        (TypeError, "expected dim to be an int", lambda: shard_sequence(torch.zeros(4), 0.0, 2, 1)),
        (ValueError, "start at 0 and not decrease", lambda: packed_shard(torch.tensor([2, 5, 8]), torch.arange(3))),
        (ValueError, "start at 0 and not decrease", lambda: packed_shard(torch.tensor([0, 6, 3, 8]), torch.arange(3))),
        (ValueError, r"cu_seqlens of shape \(num_seqs \+ 1,\)", lambda: packed_shard(torch.tensor([], dtype=torch.long),
                                                                           torch.arange(3))),
        (TypeError, "cu_seqlens to be an integer tensor", lambda: packed_shard(torch.tensor([0.0, 2, 4]), torch.arange(3))),
        (TypeError, "expected cu_seqlens to be a Tensor", lambda: packed_shard([0, 2, 4], torch.arange(3))),
        (TypeError, "offsets to be an integer tensor", lambda: packed_shard(torch.tensor([0, 2, 4]), torch.arange(3),
                                                                           torch.tensor([1.7, 2.2]))),
        (ValueError, r"offsets of shape \(num_seqs,\)", lambda: packed_shard(torch.tensor([0, 2, 4]), torch.arange(3),
                                                                          torch.tensor([1]))),
    ]
    for error, message, call in calls:
        with pytest.raises(error, match=message):
            call()
    # What stays accepted: a permutation, per-row permutations, a load balancer's object.
    assert context_parallel_indices(4, 2, 1, torch.tensor([3, 1, 0, 2])).tolist() == [0, 2]
    balancer = type("Balancer", (), {"_generate_indices": lambda self: torch.tensor([[1, 0, 3, 2]])})()
    assert context_parallel_indices(4, 2, 0, balancer).tolist() == [1, 0]


def test_context_parallel_positions_of_multi_axis_positions_with_per_row_indices():
    """Per-row rearrange indices ((batch, seq)) with multi-axis positions: (n_axes, batch, seq)
    gathers each axis per row (2-D positions are (batch, seq)); (3, seq) with a batch of 3 was
    read as (batch, seq) and the shards' rotations were 6.0 off; a shape that is neither is a
    ValueError now. The shards' positions are the full call's at the shard's indices."""
    from posenc.distributed import context_parallel_positions

    g = torch.Generator().manual_seed(3)
    batch, S, world = 3, 8, 2
    order = torch.stack([torch.randperm(S, generator=g) for _ in range(batch)])
    full = torch.randint(0, 50, (3, batch, S), generator=g)  # (n_axes, batch, seq)
    for rank in range(world):
        idx = order[:, rank * 4:(rank + 1) * 4]
        got = context_parallel_positions(S, world, rank, order, positions=full, offset=2)
        want = torch.stack([torch.stack([full[a, b, idx[b]] for b in range(batch)]) for a in range(3)]) + 2
        assert torch.equal(got, want)
        got2 = context_parallel_positions(S, world, rank, order, positions=full[0])  # (batch, seq)
        assert torch.equal(got2, want[0] - 2)
    with pytest.raises(ValueError, match=r"\(n_axes, batch=3, seq\)"):
        context_parallel_positions(S, world, 0, order, positions=torch.zeros(2, S, dtype=torch.long))
