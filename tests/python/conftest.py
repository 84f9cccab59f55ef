import functools
import importlib.util
import inspect
import math
import os
import pathlib
import random
import re

import pytest
import torch

import posenc  # noqa: F401  (loads the ops)
from posenc._library import LIBRARY_PATH


def _inductor_cache_of_this_build() -> None:
    """torch.compile's caches key a graph on its Python and ATen, not on the C++ kernels and
    autograd of libposenc: a graph compiled against another build could be reused, and a
    test would check old code. One cache per build of the library (its size and mtime), so
    a rerun of the same build stays warm. An explicit TORCHINDUCTOR_CACHE_DIR wins."""
    import os
    import tempfile

    st = os.stat(LIBRARY_PATH)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"posenc-inductor-{st.st_size}-{st.st_mtime_ns}"))


_inductor_cache_of_this_build()

# transformers as a plain install of 5.24 and earlier leaves it: without the kernels package
# (which makes its rotation functions modules). test_integrations_transformers.py runs its
# tests again so in a process of their own; a test-only switch, read before transformers loads.
if os.environ.get("POSENC_TEST_HIDE_KERNELS") == "1":
    import sys

    sys.modules["kernels"] = None  # importlib.util.find_spec("kernels") is then None

CUDA = torch.cuda.is_available()

# Tests that need a GPU carry the `cuda` marker (here for the "cuda" device parameter,
# @pytest.mark.cuda elsewhere): skipped without one, selected with -m cuda by
# scripts/gpu_check.sh.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def reference_table(positions: torch.Tensor, d: int, base: float = 10000.0) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(same), in float64."""
    pos = positions.to(torch.float64).unsqueeze(-1)
    j = torch.arange(d, dtype=torch.float64, device=positions.device)
    angle = pos / torch.pow(torch.tensor(base, dtype=torch.float64), (2 * torch.div(j, 2, rounding_mode="floor")) / d)
    return torch.where(j % 2 == 0, torch.sin(angle), torch.cos(angle))


class ClassicPositionalEncoding(torch.nn.Module):
    """The Annotated Transformer listing (the seeds' example), written out; DEVICE = cpu."""

    def __init__(self, d_model, dropout, max_len=5000):
        super().__init__()
        self.dropout = torch.nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0.0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0.0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe_pos = torch.mul(position, div_term)
        pe[:, 0::2] = torch.sin(pe_pos)
        pe[:, 1::2] = torch.cos(pe_pos)
        pe = pe.unsqueeze(0)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[:, : x.size(1)].requires_grad_(False)
        return self.dropout(x)


def reference_add(x, table, positions=None, offset=0, batch_first=True, rounded=True):
    """x + table rows, summed in float32 (float64 for float64 x) and rounded once to x.dtype
    (left unrounded in that accumulation dtype when rounded=False)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    t = table.reshape(-1, table.shape[-1]).to(acc)
    bs = x if batch_first else x.transpose(0, 1)
    B, S = bs.shape[0], bs.shape[1]
    if positions is None:
        rows = t[offset : offset + S].unsqueeze(0).expand(B, S, -1)
    else:
        pos = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(B, S)
        rows = t[pos]
    out = bs.to(acc) + rows
    out = out.to(x.dtype) if rounded else out
    return out if batch_first else out.transpose(0, 1)


def strided_random(rng: random.Random, shape, dtype, device, low=-2.0, high=2.0):
    """Uniform values in [low, high) (drawn in float64, then rounded to dtype) in a tensor of
    `shape` whose strides are not the contiguous ones: a random storage order of the
    dimensions, possibly every other element along the last one, possibly a storage offset."""
    perm = list(range(len(shape)))
    rng.shuffle(perm)
    step = rng.choice([1, 1, 2])
    stored = [shape[p] for p in perm]
    last = perm.index(len(shape) - 1)
    stored[last] *= step
    start = rng.choice([0, 0, 5])
    n = math.prod(stored)
    flat = (torch.rand(n + start, dtype=torch.float64) * (high - low) + low).to(dtype)
    base = flat[start:].view(stored)
    if step > 1:
        base = base[(slice(None),) * last + (slice(None, None, step),)]
    out = base.permute([perm.index(i) for i in range(len(shape))])
    assert tuple(out.shape) == tuple(shape)
    return out.to(device)


@pytest.fixture
def no_vmap_fallback():
    """Within the test, an op without a batching rule under vmap raises ("Batching rule not
    implemented") instead of running functorch's per-sample fallback. The fallback's own
    warning ("There is a performance drop ...") is a C++ log line on stderr, not a Python
    warning: neither recwarn nor warnings.simplefilter("error") sees it."""
    enabled = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(enabled)


def host_levels() -> list:
    """The levels this CPU runs: always "default"; "avx2" with AVX2 + FMA + F16C; "avx512"
    with AVX-512F/BW/VL too (the AVX-512 Philox path; a host without them cannot run it)."""
    flags = set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    levels = ["default"]
    if {"avx2", "fma", "f16c"} <= flags:
        levels.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl"} <= flags:
            levels.append("avx512")
    return levels


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one; scripts/gpu_check.sh runs -m cuda)")


# A test body that branches on torch.cuda.is_available() (or a CUDA device count) hides
# its CUDA part the same way a skip does.
CUDA_BRANCH = re.compile(r"cuda\.(is_available|device_count)\(\)")


@functools.lru_cache(maxsize=None)
def branches_on_cuda(function) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return CUDA_BRANCH.search(source) is not None


def pytest_collection_modifyitems(config, items):
    """The `cuda` marker is the one way a test says it needs a GPU: without one such tests
    are skipped here, and a test that skips for want of CUDA without the marker is an error
    (scripts/gpu_check.sh selects -m cuda, so it would silently never run on the GPU)."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        marked = item.get_closest_marker("cuda") is not None
        if marked and not CUDA:
            item.add_marker(skip)
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", ""))
            if "CUDA" in reason and not marked:
                raise pytest.UsageError(f"{item.nodeid}: skips without CUDA but has no cuda marker")
        if not marked and branches_on_cuda(getattr(item, "function", None)):
            raise pytest.UsageError(
                f"{item.nodeid}: tests torch.cuda.is_available() in its body but has no cuda marker, "
                "so its CUDA branch runs nowhere (CI has no GPU, the GPU check selects -m cuda): "
                "move that branch into a test marked cuda")


def torchtune_position_embeddings():
    """torchtune's own torchtune/modules/position_embeddings.py (it imports only torch). The
    package itself does not import with --no-deps (its __init__ wants datasets and an older
    torchao), so the file is loaded on its own from the installed wheel (requirements-peers.txt)."""
    spec = importlib.util.find_spec("torchtune")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed (requirements-peers.txt)")
    path = os.path.join(spec.submodule_search_locations[0], "modules", "position_embeddings.py")
    module_spec = importlib.util.spec_from_file_location("torchtune_position_embeddings", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
