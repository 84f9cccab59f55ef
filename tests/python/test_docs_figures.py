"""docs/figures.py: the five pictures are written, and the numbers behind them are right."""

import importlib.util
import json
import math
import pathlib

import matplotlib  # noqa: F401  (requirements-dev.txt: docs/figures.py draws with it)
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("posenc_docs_figures_test", ROOT / "docs" / "figures.py")
figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(figures)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_generate_writes_the_five_pngs(tmp_path):
    written = figures.generate(tmp_path / "out")
    names = ["sinusoidal_heatmap.png", "rope_wavelengths.png", "multi_axis_split.png", "relative_similarity.png",
             "performance_fraction.png"]
    assert [p.name for p in written] == names
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE), path
        assert 1000 < len(data) < 200_000, (path, len(data))
    # The CPU table docs/performance.md includes: a row per benchmark row of the tcmalloc run.
    table = (tmp_path / "out" / "cpu_table.md").read_text()
    rows = json.loads((figures.RESULTS / "cpu_tcmalloc.json").read_text())["rows"]
    assert table.count("\n| ") == len(rows) + 1 and "rope_shift_kv" in table


def _wavelengths():
    return {(config["scaling"] or {"rope_type": "default"})["rope_type"]: figures.rope_wavelengths(config)
            for _, config in figures.wavelength_configs()}


def test_wavelengths_of_each_scaling_type():
    wl = _wavelengths()
    assert set(wl) == {"default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional"}
    default = wl["default"]
    assert default.shape == (64,)
    # default: 2 pi base^(2i/d)
    assert default[0].item() == pytest.approx(2 * math.pi)
    assert default[-1].item() == pytest.approx(2 * math.pi * 500000.0 ** (126 / 128), rel=1e-12)
    # linear multiplies every wavelength by the factor
    torch.testing.assert_close(wl["linear"], 8 * default, rtol=1e-12, atol=0)
    # llama3 leaves the fast pairs alone (wavelength below original / high_freq_factor = 2048) and
    # multiplies the slow ones (above original = 8192) by the factor; yarn likewise at its ends
    for name in ("llama3", "yarn"):
        assert wl[name][0].item() == pytest.approx(default[0].item(), rel=1e-12)
        assert wl[name][-1].item() == pytest.approx(8 * default[-1].item(), rel=1e-12)
        assert bool(((wl[name] >= default * (1 - 1e-12)) & (wl[name] <= 8 * default * (1 + 1e-12))).all())
    fast, slow = default < 2048, default > 8192
    torch.testing.assert_close(wl["llama3"][fast], default[fast], rtol=1e-12, atol=0)
    torch.testing.assert_close(wl["llama3"][slow], 8 * default[slow], rtol=1e-12, atol=0)
    # dynamic at 65536 (= 8 x original) raises the base: the fastest pair stays, the others slow down
    assert wl["dynamic"][0].item() == pytest.approx(default[0].item(), rel=1e-12)
    assert bool((wl["dynamic"][1:] > default[1:]).all())
    # longrope beyond the original context: default x long_factor, pair by pair
    _, long = figures._longrope_lists(64)
    torch.testing.assert_close(wl["longrope"], default * torch.tensor(long, dtype=torch.float64), rtol=1e-12, atol=0)
    # proportional, partial_rotary_factor 0.25: 16 pairs turn as the default's first 16, 48 never turn
    torch.testing.assert_close(wl["proportional"][:16], default[:16], rtol=1e-12, atol=0)
    assert bool(torch.isinf(wl["proportional"][16:]).all())


@pytest.mark.parametrize("index", range(7))
def test_the_kernel_turns_by_the_frequencies_plotted(index):
    """apply_rope itself, read back with atan2 at position 1, turns each pair by the inv_freq
    of the figure (rope_frequencies)."""
    label, config = figures.wavelength_configs()[index]
    seq_len = config.get("seq_len")
    angles = figures.rope_angles(config["head_dim"], torch.tensor([1]), base=config["base"],
                                 scaling=config["scaling"], **({} if seq_len is None else dict(seq_len=seq_len)))
    torch.testing.assert_close(angles, figures.rope_inv_freq(config), rtol=1e-12, atol=1e-15, msg=label)


def test_axis_split_of_each_scheme():
    schemes = {title.split(" (")[0]: kw for title, kw, _ in figures.multi_axis_schemes()}
    mrope = schemes["M-RoPE"]
    axis, _ = figures.axis_split(mrope["head_dim"], mrope["sections"], mrope["sections_mode"], mrope["base"])
    assert axis.tolist() == [0] * 16 + [1] * 24 + [2] * 24
    qwen3 = schemes["Interleaved M-RoPE"]
    axis, _ = figures.axis_split(qwen3["head_dim"], qwen3["sections"], qwen3["sections_mode"], qwen3["base"])
    assert axis[:6].tolist() == [0, 1, 2, 0, 1, 2]
    assert axis[60:].tolist() == [0, 0, 0, 0]
    assert [int((axis == a).sum()) for a in range(3)] == [24, 20, 20]
    vit = schemes["2-D axial RoPE of a ViT head"]
    axis, freq = figures.axis_split(vit["head_dim"], vit["sections"], vit["sections_mode"], vit["base"])
    assert axis.tolist() == [0] * 16 + [1] * 16
    # axial: each axis is its own 1-D RoPE, so both start at the fastest frequency (1 per position)
    assert freq[0] == pytest.approx(1.0) and freq[16] == pytest.approx(1.0)


def test_similarity_depends_only_on_the_distance():
    curves = [figures.rope_similarity(anchor) for anchor in figures.SIM_ANCHORS]
    for delta, values in curves[1:]:
        assert (delta == curves[0][0]).all()
        assert abs(values - curves[0][1]).max() < 1e-9
    sinusoidal = [figures.sinusoidal_similarity(anchor) for anchor in figures.SIM_ANCHORS]
    for _, values in sinusoidal[1:]:
        assert abs(values - sinusoidal[0][1]).max() < 1e-9
    delta, values = sinusoidal[0]
    assert values[delta == 0].item() == pytest.approx(1.0)
    # symmetric for sinusoidal (sum of cos((m - n) w)), not for RoPE with q != k
    assert abs(values - values[::-1]).max() < 1e-9
    rope = curves[0][1]
    assert abs(rope - rope[::-1]).max() > 0.1


def test_performance_rows_from_the_benchmark_json():
    results = figures.load_results(figures.RESULTS / "cpu_tcmalloc.json")
    for key in ("allocator", "torch", "posenc", "cpu_capability", "threads"):
        assert key in results
    rows = figures.performance_rows(results)
    assert len(rows) * 3 == len(results["rows"])
    decode = dict(rows)["rope_append_kv: decode"]
    assert decode == {"float32": None, "bfloat16": None, "float16": None}
    first = results["rows"][0]
    assert dict(rows)[f"{first['op']}: {first['case']}"][first["dtype"]] == first["fraction"]
