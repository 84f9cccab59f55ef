"""The reference site (docs/, built by `make docs`) against the code, without building it:

1. Coverage: every public Python name (``posenc.__all__``, ``posenc.functional.__all__`` and the
   ``__all__`` of the public modules ``posenc.modules``, ``posenc.distributed``,
   ``posenc.integrations`` and ``posenc.integrations.transformers``) has an autodoc entry in the
   docs, and every public C++ header under csrc/include/posenc has a ``cpp-header`` section:
   a name or header added without one fails here.
2. Every ```python block of each page runs: the blocks of a page are executed in order in one
   namespace per page, so the documented calls cannot drift from the code. The examples are
   self-contained (tiny tensors and models, no downloads).

Slow examples are not ```python blocks but ``literalinclude`` of files that other tests run
already, so they are not executed here (that would take minutes): the AOTInductor export
(examples/deploy/export_model.py, run by tests/cpp/run_example.sh in ``make test``, beside
examples/cpp/deploy_model.cpp) and the torch.func examples (examples/torch_func_examples.py,
tests/python/test_examples_func.py). This test checks that every included file exists.
"""

import importlib
import importlib.util
import pathlib
import re
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HEADERS = ROOT / "csrc" / "include"
PUBLIC_MODULES = ["posenc", "posenc.functional", "posenc.modules", "posenc.distributed", "posenc.integrations",
                  "posenc.integrations.transformers"]
PEERS = ["transformers", "diffusers", "timm"]
AUTODOC = re.compile(r"^\.\. auto(?:module|class|function|data|attribute|method)::\s+(\S+)", re.M)


def pages():
    return sorted(p for p in DOCS.rglob("*.md") if "_generated" not in p.parts and "_build" not in p.parts)


def all_text():
    return "\n".join(p.read_text() for p in pages())


def documented_objects():
    """The object of each autodoc directive's target, by import."""
    objects = []
    for target in AUTODOC.findall(all_text()):
        if target.startswith("posenc.integrations.transformers") and importlib.util.find_spec("transformers") is None:
            continue  # imports transformers (public_names leaves its names out without it)
        try:
            objects.append(importlib.import_module(target))
            continue
        except ImportError:
            pass
        module, _, name = target.rpartition(".")
        objects.append(getattr(importlib.import_module(module), name))
    return objects


def public_names():
    for module_name in PUBLIC_MODULES:
        if module_name.startswith("posenc.integrations") and importlib.util.find_spec("transformers") is None:
            continue  # posenc.integrations' __all__ names the submodule that imports transformers
        module = importlib.import_module(module_name)
        yield module_name, module, None
        for name in module.__all__:
            yield f"{module_name}.{name}", module, name


def test_every_public_python_name_has_a_reference_entry():
    documented = documented_objects()
    missing = []
    for full_name, module, name in public_names():
        obj = module if name is None else getattr(module, name)
        if isinstance(obj, (tuple, list, dict, set, frozenset, str, int, float)):
            # Data: identity says nothing (equal tuples), the directive must name it.
            if not re.search(r"\.\. autodata::\s+" + re.escape(full_name) + r"\s", all_text()):
                missing.append(full_name)
        elif not any(obj is d for d in documented):
            missing.append(full_name)
    assert not missing, f"public names without an autodoc entry in docs/ (add them to docs/api.md): {missing}"


def test_every_public_header_has_a_cpp_header_section():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import cppheaders
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    named = set(cppheaders.headers_named(all_text()))
    headers = {p.relative_to(HEADERS).as_posix() for p in (HEADERS / "posenc").rglob("*.h")}
    assert headers - named == set(), f"headers without a cpp-header directive in docs/cpp.md: {sorted(headers - named)}"
    assert named - headers == set(), f"cpp-header directives naming no header: {sorted(named - headers)}"
    # The parser finds each header's leading comment and a commented declaration in each
    # family header (the page would otherwise show bare code).
    for name in headers:
        parsed = cppheaders.parse_header((HEADERS / name).read_text())
        assert parsed.leading, f"{name}: no leading comment"
        if parsed.entries:
            assert any(e.comment and e.code for e in parsed.entries), name


@pytest.mark.parametrize("constant,opening,closing", [
    ("SUPPORTED_MODEL_TYPES", "`SUPPORTED_MODEL_TYPES` (each `config.model_type`):", "other model types raise"),
    ("QK_NORM_MODEL_TYPES", "`apply_posenc_rope(model, qk_norm=True)` routes", "(`QK_NORM_MODEL_TYPES`)"),
])
def test_the_integration_page_lists_the_supported_types(constant, opening, closing):
    """docs/integrations.md names each model type its list holds (by `config.model_type`), and
    no other: the list is the code's (a type added or dropped without the page fails here)."""
    pytest.importorskip("transformers")
    from posenc.integrations import transformers as integration

    text = (DOCS / "integrations.md").read_text()
    assert text.count(opening) == 1, opening
    paragraph = text[text.index(opening) + len(opening):]
    paragraph = paragraph[:paragraph.index(closing)]
    named = set(re.findall(r"`([a-z][a-z0-9_]*)`", paragraph))
    listed = set(getattr(integration, constant))
    assert named == listed, f"{constant}: the page misses {sorted(listed - named)}, names {sorted(named - listed)} too"


def test_included_files_exist():
    """Every included file exists; those under _generated/ are written by the build
    (figures.generate, which test_docs_figures.py runs): they must be among what it writes."""
    for page in pages():
        for included in re.findall(r"```\{(?:literalinclude|include)\}\s+(\S+)", page.read_text()):
            if included.startswith("_generated/"):
                assert included in ("_generated/cpu_table.md",), f"{page.name}: {included} is not generated"
                continue
            assert (page.parent / included).resolve().is_file(), f"{page.name}: {included}"


def test_images_are_the_ones_figures_py_draws():
    names = set(re.findall(r"_generated/(\w+\.png)", all_text()))
    assert names == {"sinusoidal_heatmap.png", "rope_wavelengths.png", "multi_axis_split.png",
                     "relative_similarity.png", "performance_fraction.png"}


def python_blocks(page):
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


PAGES_WITH_CODE = [p for p in pages() if python_blocks(p)]


def check_multi_axis(ns):
    """The peers' own formulas (float64 references of Qwen2-VL's, EVA-02/timm's and FLUX's
    RoPE), on the page's inputs: its last q, k are the ViT's and x is FLUX's."""
    import torch

    import posenc
    from multi_axis_reference import eva_timm_rope, flux_rope, qwen2vl_mrope

    f64 = lambda t: t.to(torch.float64)  # noqa: E731
    f32 = dict(atol=1e-5, rtol=1e-5)  # the page's tensors are float32
    torch.testing.assert_close(f64(ns["q"]), eva_timm_rope(f64(ns["q_vit"]), 16, 16, 1), **f32)
    torch.testing.assert_close(f64(ns["x"]), flux_rope(f64(ns["x_flux"]), ns["ids"], (16, 56, 56), 10000), **f32)
    want, _ = qwen2vl_mrope(f64(ns["q_hf"]), f64(ns["k_hf"]), ns["position_ids"], [16, 24, 24], 1e6)
    got = posenc.functional.apply_rope(f64(ns["q_hf"]), positions=ns["position_ids"], sections=[16, 24, 24],
                                       sections_mode="mrope", base=1e6, layout="bhsd")
    torch.testing.assert_close(got, want)
    assert list(ns["rope"].sections) == [16, 24, 24]


# Pages whose examples are also checked against independent references after they ran (the
# others assert their numbers inside the examples themselves).
CHECKS = {"guide/multi_axis.md": check_multi_axis}


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.relative_to(DOCS).as_posix() for p in PAGES_WITH_CODE])
def test_python_examples_run(page):
    code = "\n".join(python_blocks(page))
    for peer in PEERS:  # requirements-peers.txt: without them their pages' examples skip
        if re.search(rf"^\s*(from|import) {peer}\b", code, flags=re.M):
            pytest.importorskip(peer)
    # A real module per page (torch.compile looks its globals up in sys.modules).
    module = types.ModuleType(f"posenc_docs_{page.stem}")
    sys.modules[module.__name__] = module
    try:
        for i, block in enumerate(python_blocks(page)):
            exec(compile(block, f"{page.relative_to(ROOT)} (block {i + 1})", "exec"), module.__dict__)
        check = CHECKS.get(page.relative_to(DOCS).as_posix())
        if check is not None:
            check(module.__dict__)
    finally:
        del sys.modules[module.__name__]
