"""posenc.integrations without transformers: importing the integration raises ImportError
naming the pip command; import posenc never imports transformers. Runs whether or not
transformers is installed (hidden through sys.modules)."""

import importlib
import subprocess
import sys

import pytest

import posenc  # noqa: F401


def test_import_error_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "posenc.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match="pip install transformers"):
        importlib.import_module("posenc.integrations.transformers")
    import posenc.integrations  # the package itself imports nothing

    assert posenc.integrations.__all__ == ["transformers"]


def test_import_posenc_does_not_import_transformers():
    code = "import sys, posenc, posenc.functional, posenc.integrations; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
