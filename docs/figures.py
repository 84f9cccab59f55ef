"""The documentation's figures, drawn from the library itself (issue 38, item 3).

``generate(out_dir)`` writes the five PNGs the pages embed; Sphinx's conf.py calls it at build
time. Every number comes from posenc's ops: the sinusoidal table from ``sinusoidal_table``,
RoPE's frequencies from ``rope_frequencies`` (the code the kernels run), the multi-axis split
and the relative similarity from ``apply_rope`` itself, the performance from the JSON that
``benchmarks/bench_table.py --json`` writes (``benchmarks/results/``). Nothing re-implements a
formula of the library.

Usage: PYTHONPATH=python python docs/figures.py OUT_DIR
"""

from __future__ import annotations

import io
import json
import math
import pathlib
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
try:
    import posenc
except ImportError:  # run from a checkout without PYTHONPATH=python
    sys.path.insert(0, str(ROOT / "python"))
    import posenc

F = posenc.functional
RESULTS = ROOT / "benchmarks" / "results"
FIGSIZE = (8, 4.5)
DPI = 120
FILES = ("sinusoidal_heatmap.png", "rope_wavelengths.png", "multi_axis_split.png", "relative_similarity.png",
         "performance_fraction.png")


def _save(fig: Any, path: pathlib.Path) -> pathlib.Path:
    """The figure as a 256-colour PNG (a third of the RGBA file's size, the same picture)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, optimize=True)
    return path


# --- 1. the sinusoidal encoding ---------------------------------------------------------------

def sinusoidal_values(positions: int = 128, d_model: int = 64) -> torch.Tensor:
    """posenc's sinusoidal table of positions 0 .. positions-1 (what PositionalEncoding adds)."""
    return F.sinusoidal_table(torch.arange(positions), d_model)


def sinusoidal_heatmap(path: pathlib.Path, positions: int = 128, d_model: int = 64) -> pathlib.Path:
    table = sinusoidal_values(positions, d_model)
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    image = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("feature (even: sin, odd: cos; the frequency falls from left to right)")
    ax.set_ylabel("position")
    ax.set_title(f"Sinusoidal positional encoding: posenc.functional.sinusoidal_table, "
                 f"{positions} positions x d_model={d_model}", fontsize=10)
    fig.colorbar(image, ax=ax, label="PE[position, feature]")
    return _save(fig, path)


# --- 2. RoPE's wavelength per pair for each scaling type --------------------------------------

HEAD_DIM = 128
BASE = 500000.0
ORIGINAL = 8192  # original_max_position_embeddings (Llama 3's)
FACTOR = 8.0
LONG_SEQ = int(ORIGINAL * FACTOR)  # the extended context the scaled types aim at


def _longrope_lists(pairs: int) -> Tuple[List[float], List[float]]:
    """Phi-3-like lists (one factor per pair): short ~1, long rising from 1 on the fast pairs
    to about the factor on the slow ones."""
    ramp = [i / (pairs - 1) for i in range(pairs)]
    short = [1.0 + 0.05 * r for r in ramp]
    long = [1.0 + (FACTOR * 1.25 - 1.0) * r * r * (3 - 2 * r) for r in ramp]
    return short, long


def wavelength_configs() -> List[Tuple[str, Dict[str, Any]]]:
    """(legend label, configuration) of each scaling type: head_dim 128, base 500000, Llama 3's
    original context 8192, extended x8 to 65536."""
    short, long = _longrope_lists(HEAD_DIM // 2)
    common = dict(head_dim=HEAD_DIM, base=BASE)
    return [
        ("default (no scaling)", dict(common, scaling=None)),
        ("linear x8 (every wavelength x8)", dict(common, scaling=dict(rope_type="linear", factor=FACTOR))),
        (f"dynamic x8, at seq_len {LONG_SEQ:,}",
         dict(common, seq_len=LONG_SEQ, scaling=dict(rope_type="dynamic", factor=FACTOR,
                                                     original_max_position_embeddings=ORIGINAL))),
        ("yarn x8 (beta_fast 32, beta_slow 1)",
         dict(common, scaling=dict(rope_type="yarn", factor=FACTOR, original_max_position_embeddings=ORIGINAL))),
        ("llama3 x8 (low 1, high 4)",
         dict(common, scaling=dict(rope_type="llama3", factor=FACTOR, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=ORIGINAL))),
        (f"longrope x8, long_factor (seq_len {LONG_SEQ:,})",
         dict(common, seq_len=LONG_SEQ, scaling=dict(rope_type="longrope", factor=FACTOR, short_factor=short,
                                                     long_factor=long, original_max_position_embeddings=ORIGINAL))),
        ("proportional, partial_rotary_factor 0.25",
         dict(common, scaling=dict(rope_type="proportional", partial_rotary_factor=0.25))),
    ]


def rope_inv_freq(config: Mapping[str, Any]) -> torch.Tensor:
    """float64 inverse frequencies of the head's pairs, from posenc's rope_frequencies (the
    library's own computation, the one its kernels run)."""
    inv_freq, _ = F.rope_frequencies(config["head_dim"], base=config.get("base"), scaling=config.get("scaling"),
                                     seq_len=config.get("seq_len", 0))
    return inv_freq


def rope_wavelengths(config: Mapping[str, Any]) -> torch.Tensor:
    """Wavelength 2*pi / inv_freq (in positions) of each pair; inf for a pair that does not turn."""
    inv_freq = rope_inv_freq(config)
    return torch.where(inv_freq > 0, 2 * math.pi / inv_freq, torch.full_like(inv_freq, math.inf))


def rope_angles(head_dim: int, positions: torch.Tensor, **rope: Any) -> torch.Tensor:
    """The angle apply_rope turns each pair by at ``positions`` (one token), read back from
    the op: head p holds a unit vector on pair p's first feature, the rotated head's pair p is
    (cos, sin) * attention factor, and atan2 gives the angle (in (-pi, pi])."""
    pairs = head_dim // 2
    q = torch.zeros(1, 1, pairs, head_dim, dtype=torch.float64)
    first = torch.arange(pairs) * 2 if rope.get("interleaved") else torch.arange(pairs)
    second = first + (1 if rope.get("interleaved") else pairs)
    q[0, 0, torch.arange(pairs), first] = 1.0
    out = F.apply_rope(q, positions=positions, **rope)[0, 0]
    return torch.atan2(out[torch.arange(pairs), second], out[torch.arange(pairs), first])


def rope_wavelengths_figure(path: pathlib.Path) -> pathlib.Path:
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    # default and linear are wide pale bands: the types that keep (or multiply) a part of them
    # run on top of them, visibly.
    styles = [dict(color="black", lw=5, alpha=0.35), dict(color="tab:blue", lw=5, alpha=0.35),
              dict(color="tab:purple", ls="-."), dict(color="tab:green", lw=1.6),
              dict(color="tab:red", ls=":", lw=2.2), dict(color="tab:orange", ls=(0, (5, 1, 1, 1))),
              dict(color="tab:brown", lw=1.2, marker=".", ms=5)]
    curves = [(label, rope_wavelengths(config).numpy()) for label, config in wavelength_configs()]
    top = max(wl[np.isfinite(wl)].max() for _, wl in curves)
    for (label, wl), style in zip(curves, styles):
        pairs = np.arange(len(wl))
        finite = np.isfinite(wl)
        ax.plot(pairs[finite], wl[finite], label=label, **style)
        if not finite.all():  # pairs that never turn: infinite wavelength, drawn at the top edge
            ax.plot(pairs[~finite], np.full((~finite).sum(), top * 2.5), ls="none", marker="^", ms=3.5,
                    color=style["color"], label=f"  its {(~finite).sum()} pairs that never turn (infinite)")
    ax.set_yscale("log")
    ax.axhline(ORIGINAL, color="grey", lw=0.8)
    ax.axhline(LONG_SEQ, color="grey", lw=0.8, ls="--")
    ax.text(1, ORIGINAL * 1.15, f"original context {ORIGINAL:,}", fontsize=8, color="dimgrey")
    ax.text(1, LONG_SEQ * 1.15, f"extended context {LONG_SEQ:,}", fontsize=8, color="dimgrey")
    ax.set_xlim(0, HEAD_DIM // 2 - 1)
    ax.set_ylim(3, top * 4)
    ax.text(HEAD_DIM // 2 - 2, 8, "fast pairs (left): yarn, llama3 and proportional keep the default;\n"
            "slow pairs (right): linear, yarn and llama3 coincide (x8)", fontsize=7.5, ha="right", color="dimgrey")
    ax.set_xlabel("feature pair i (of head_dim 128; i = 0 turns fastest)")
    ax.set_ylabel("wavelength 2*pi / inv_freq (positions)")
    ax.set_title(f"RoPE wavelength per pair by scaling type (base {BASE:,.0f}, from posenc rope_frequencies)",
                 fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left", framealpha=0.9)
    ax.grid(True, which="major", alpha=0.3)
    return _save(fig, path)


# --- 3. the multi-axis split of a head ----------------------------------------------------------

def multi_axis_schemes() -> List[Tuple[str, Dict[str, Any], Sequence[str]]]:
    """(title, apply_rope keywords, axis names) of the schemes drawn."""
    return [
        ("M-RoPE (Qwen2-VL / Qwen2.5-VL), head_dim 128, mrope_section [16, 24, 24]",
         dict(head_dim=128, base=1000000.0, sections=[16, 24, 24], sections_mode="mrope"), ("t", "h", "w")),
        ("Interleaved M-RoPE (Qwen3-VL), head_dim 128, mrope_section [24, 20, 20]",
         dict(head_dim=128, base=5000000.0, sections=[24, 20, 20], sections_mode="mrope_interleaved"),
         ("t", "h", "w")),
        ("2-D axial RoPE of a ViT head (EVA-02 / timm), head_dim 64, sections [16, 16]",
         dict(head_dim=64, base=10000.0, sections=[16, 16], sections_mode="axial"), ("h", "w")),
    ]


def axis_split(head_dim: int, sections: Sequence[int], sections_mode: str,
               base: float) -> Tuple[np.ndarray, np.ndarray]:
    """(axis of each pair, its angle per unit position), read from apply_rope: the head is
    rotated at position 1 on one axis (0 on the others), once per axis; a pair that turns
    belongs to that axis. Axis -1: the pair turns on no axis."""
    n_axes = len(sections)
    angles = []
    for a in range(n_axes):
        positions = torch.zeros(n_axes, 1, dtype=torch.int64)
        positions[a] = 1
        angles.append(rope_angles(head_dim, positions, base=base, sections=list(sections),
                                  sections_mode=sections_mode).numpy())
    angles = np.stack(angles)  # (n_axes, pairs)
    turned = angles != 0
    if (turned.sum(0) > 1).any():
        raise AssertionError("a pair turns on more than one axis")
    axis = np.where(turned.any(0), turned.argmax(0), -1)
    return axis, np.abs(angles).max(0)


AXIS_COLORS = {"t": "tab:blue", "h": "tab:orange", "w": "tab:green"}


def multi_axis_figure(path: pathlib.Path) -> pathlib.Path:
    schemes = multi_axis_schemes()
    fig, axes = plt.subplots(len(schemes), 1, figsize=(8, 4.5), layout="constrained")
    for ax, (title, kw, names) in zip(axes, schemes):
        axis, freq = axis_split(kw["head_dim"], kw["sections"], kw["sections_mode"], kw["base"])
        pairs = len(axis)
        # Shade by frequency: the fastest pair of the head full colour, the slowest pale.
        logf = np.log(freq[axis >= 0])
        shade = np.ones(pairs)
        shade[axis >= 0] = (logf - logf.min()) / max(logf.max() - logf.min(), 1e-12)
        rgb = np.ones((1, pairs, 3))
        for p in range(pairs):
            if axis[p] < 0:
                rgb[0, p] = 0.85
                continue
            color = np.array(to_rgb(AXIS_COLORS[names[axis[p]]]))
            strength = 0.3 + 0.7 * shade[p]
            rgb[0, p] = 1 - strength * (1 - color)
        ax.imshow(rgb, aspect="auto", interpolation="nearest", extent=(-0.5, pairs - 0.5, 0, 1))
        for p in range(1, pairs):
            if axis[p] != axis[p - 1]:
                ax.axvline(p - 0.5, color="white", lw=0.6)
        counts = ", ".join(f"{n}: {int((axis == i).sum())}" for i, n in enumerate(names))
        ax.set_title(f"{title}  ({counts} pairs)", fontsize=8.5, loc="left")
        ax.set_yticks([])
        ax.set_xlim(-0.5, pairs - 0.5)
        ax.set_xticks(list(range(0, pairs, 8 if pairs > 32 else 4)) + [pairs - 1])
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("feature pair i (rotates features i and i + head_dim/2)", fontsize=8)
    handles = [Patch(color=c, label=f"axis {n}") for n, c in AXIS_COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="pale: slow (low frequency) pair"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Which position axis turns each feature pair (read from apply_rope; "
                 "colour depth: the pair's frequency)", fontsize=10)
    return _save(fig, path)


# --- 4. relative-position similarity ------------------------------------------------------------

SIM_DIM = 64
SIM_ANCHORS = (256, 4096, 100000)
SIM_SPAN = 96


def sinusoidal_similarity(anchor: int, span: int = SIM_SPAN, d_model: int = SIM_DIM) -> Tuple[np.ndarray, np.ndarray]:
    """(m - n, PE(m) . PE(n) / (d_model / 2)) for n = anchor, m = anchor - span .. anchor + span (posenc's
    table in float64; |PE|^2 = d_model / 2, so this is the cosine similarity, 1 at m = n)."""
    delta = torch.arange(-span, span + 1)
    table = F.sinusoidal_table(torch.cat([delta + anchor, torch.tensor([anchor])]), d_model, dtype=torch.float64)
    return delta.numpy(), (table[:-1] @ table[-1]).numpy() / (d_model / 2)


def rope_similarity(anchor: int, span: int = SIM_SPAN, head_dim: int = SIM_DIM, seed: int = 0) -> Tuple[np.ndarray,
                                                                                                         np.ndarray]:
    """(m - n, q(m) . k(n)) for fixed random q and k rotated by apply_rope to m and n = anchor."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    delta = torch.arange(-span, span + 1)
    qm = F.apply_rope(q.expand(1, len(delta), 1, head_dim).contiguous(), positions=delta + anchor)[0, :, 0]
    kn = F.apply_rope(k.view(1, 1, 1, head_dim), positions=torch.tensor([anchor]))[0, 0, 0]
    return delta.numpy(), (qm @ kn).numpy() / math.sqrt(head_dim)


def relative_similarity_figure(path: pathlib.Path) -> pathlib.Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE, layout="constrained", sharex=True)
    styles = [dict(lw=3.2, alpha=0.35, color="tab:blue"), dict(lw=1.6, color="tab:orange", ls="--"),
              dict(lw=1.0, color="black", ls=":")]
    for anchor, style in zip(SIM_ANCHORS, styles):
        left.plot(*sinusoidal_similarity(anchor), label=f"n = {anchor:,}", **style)
        right.plot(*rope_similarity(anchor), label=f"n = {anchor:,}", **style)
    left.set_title(f"sinusoidal: PE(m) . PE(n) / (d/2), d_model {SIM_DIM}", fontsize=9)
    right.set_title(f"RoPE: q(m) . k(n) / sqrt(d), random q, k; head_dim {SIM_DIM}", fontsize=9)
    left.set_ylabel("similarity")
    for ax in (left, right):
        ax.set_xlabel("m - n (query position - key position)")
        ax.axvline(0, color="grey", lw=0.6)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7.5, title="key position", title_fontsize=7.5, loc="upper right")
    fig.suptitle("Relative-position similarity: the curves for keys at n = 256, 4,096 and 100,000 coincide "
                 "(only m - n matters)", fontsize=9.5)
    return _save(fig, path)


# --- 5. performance as a fraction of the memory floor -------------------------------------------

DTYPE_COLORS = {"float32": "tab:blue", "bfloat16": "tab:orange", "float16": "tab:green"}
TARGET = 0.8


def load_results(path: pathlib.Path) -> Dict[str, Any]:
    """A JSON of ``benchmarks/bench_table.py --json``: the header (allocator, threads, torch,
    posenc, cpu_capability, ...) and ``rows``."""
    with open(path) as f:
        return json.load(f)


def performance_rows(results: Mapping[str, Any]) -> List[Tuple[str, Dict[str, Optional[float]]]]:
    """(``op: case``, {dtype: fraction of the floor, None when launch-bound}) in the table's order."""
    rows: Dict[str, Dict[str, Optional[float]]] = {}
    for r in results["rows"]:
        label = f"{r['op']}: {r['case']}"
        rows.setdefault(label, {})[r["dtype"]] = None if r["launch_bound"] else r["fraction"]
    return list(rows.items())


XMAX = 1.5  # the axis' end; a bar beyond it is cut there and its value written


def _performance_panel(ax: Any, rows: List[Tuple[str, Dict[str, Optional[float]]]], results: Mapping[str, Any],
                       source: str) -> None:
    height = 0.26
    dtypes = list(DTYPE_COLORS)
    for i, (_, fractions) in enumerate(rows):
        values = [fractions.get(d) for d in dtypes]
        if all(v is None for v in values):
            ax.text(0.03, i, "launch-bound: no floor", va="center", fontsize=7, color="dimgrey", style="italic")
            continue
        for j, (dtype, value) in enumerate(zip(dtypes, values)):
            if value is None:
                continue
            y = i + (j - 1) * height
            ax.barh(y, min(value, XMAX), height=height, color=DTYPE_COLORS[dtype])
            if value > XMAX:
                ax.text(XMAX - 0.02, y, f"{value:.1f}", va="center", ha="right", fontsize=5.5, color="white",
                        weight="bold")
        if max(v for v in values if v is not None) < 0.1:
            ax.text(0.12, i, " / ".join(f"{v:.2f}" for v in values if v is not None), va="center", fontsize=6.5,
                    color="dimgrey")
    ax.axvline(TARGET, color="red", lw=1.2, ls="--")
    ax.axvline(1.0, color="grey", lw=0.6)
    ax.set_xlim(0, XMAX)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("max(floor) / posenc time", fontsize=8)
    at_target = sum(1 for _, f in rows for v in f.values() if v is not None and v >= TARGET)
    measured = sum(1 for _, f in rows for v in f.values() if v is not None)
    ax.set_title(f"{results['allocator']}: {at_target} of {measured} rows >= {TARGET}\n({source})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def performance_figure(path: pathlib.Path, sources: Sequence[pathlib.Path] = (RESULTS / "cpu_tcmalloc.json",
                                                                              RESULTS / "cpu_glibc.json")
                       ) -> pathlib.Path:
    """One panel per JSON (same rows, one bar per dtype); launch-bound rows are marked, not drawn."""
    sources = [pathlib.Path(s) for s in sources if pathlib.Path(s).is_file()]
    loaded = [load_results(s) for s in sources]
    fig, axes = plt.subplots(1, len(loaded), figsize=(8, 9), layout="constrained", sharey=True, squeeze=False)
    labels = [label for label, _ in performance_rows(loaded[0])]
    for ax, results, source in zip(axes[0], loaded, sources):
        rows = dict(performance_rows(results))
        _performance_panel(ax, [(label, rows.get(label, {})) for label in labels], results,
                           f"benchmarks/results/{source.name}")
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=7)
    handles = [Patch(color=c, label=d) for d, c in DTYPE_COLORS.items()]
    handles.append(Line2D([], [], color="red", ls="--", label=f"target {TARGET}"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    first = loaded[0]
    fig.suptitle(f"posenc CPU ops as a fraction of their floor (memory: clone() of the same bytes; dropout rows: "
                 f"max with compute)\nposenc {first['posenc']}, torch {first['torch']}, CPU kernels "
                 f"{first['cpu_capability']}, {first['threads']} threads; from bench_table.py --json; "
                 f"higher is better", fontsize=8.5)
    return _save(fig, path)


# --- all of them ----------------------------------------------------------------------------------

def cpu_table_markdown(glibc: pathlib.Path = RESULTS / "cpu_glibc.json",
                       tcmalloc: pathlib.Path = RESULTS / "cpu_tcmalloc.json") -> str:
    """The CPU table of docs/performance.md, from the benchmark's own JSON (bench_table.py
    --json): one line per op, case and dtype, glibc and tcmalloc side by side."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in (glibc, tcmalloc)]
    by_key = [{(r["op"], r["case"], r["dtype"]): r for r in run["rows"]} for run in runs]

    def num(r, key, fmt="{:.2f}"):
        return "-" if r is None or r.get(key) is None else fmt.format(r[key])

    def fraction(r):
        return "-" if r is None else ("launch-bound" if r.get("launch_bound") else num(r, "fraction"))

    lines = ["| op, case | dtype | fraction glibc | fraction tcmalloc | posenc ms glibc / tcmalloc | "
             "eager/posenc glibc / tcmalloc | compile/posenc glibc / tcmalloc |",
             "|---|---|---|---|---|---|---|"]
    last = None
    for r in runs[1]["rows"]:
        key = (r["op"], r["case"], r["dtype"])
        g, c = by_key[0].get(key), r
        label = f"{r['op']} {r['case']}" if (r["op"], r["case"]) != last else ""
        last = (r["op"], r["case"])
        lines.append(f"| {label} | {r['dtype']} | {fraction(g)} | {fraction(c)} | {num(g, 'posenc_ms')} / "
                     f"{num(c, 'posenc_ms')} | {num(g, 'eager_ratio')} / {num(c, 'eager_ratio')} | "
                     f"{num(g, 'compile_ratio')} / {num(c, 'compile_ratio')} |")
    meta = runs[1]
    return (f"torch {meta.get('torch')}, posenc {meta.get('posenc')}, CPU {meta.get('cpu', 'not recorded')}, "
            f"{meta.get('threads')} threads, CPU kernels {meta.get('cpu_capability')}, median of {meta.get('reps')}."
            "\n\n" + "\n".join(lines) + "\n")


def generate(out_dir: pathlib.Path) -> List[pathlib.Path]:
    """Writes the five figures into ``out_dir`` (created if needed), and the CPU table
    (``cpu_table.md``, included by docs/performance.md); returns the figures' paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cpu_table.md").write_text(cpu_table_markdown())
    makers = (sinusoidal_heatmap, rope_wavelengths_figure, multi_axis_figure, relative_similarity_figure,
              performance_figure)
    return [make(out_dir / name) for make, name in zip(makers, FILES)]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/figures.py OUT_DIR")
    for written in generate(pathlib.Path(sys.argv[1])):
        print(written)
