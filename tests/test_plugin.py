"""A third-party engine plugs in: examples/engine-plugin is pip-installed into a fresh virtual
environment, appears in `infer engines`, and runs a tiny synthetic GGUF through `infer run`. Its
numpy forward pass is checked against llama.cpp's logits on the same model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_factory import write_llama_gguf

from stdengine.events import Emitter
from stdengine.options import Options

PLUGIN = Path(__file__).resolve().parent.parent / "examples" / "engine-plugin"


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv that sees this environment's packages (stdengine, numpy, gguf, pip, setuptools)
    through a .pth file, with the plugin pip-installed into it, offline."""
    venv = tmp_path_factory.mktemp("plugin") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    # addsitedir (not a plain path line) so that the parent's own .pth files run too (editable installs)
    parent = sysconfig.get_paths()["purelib"]
    Path(purelib, "stdengine_parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", str(PLUGIN)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return python


def infer(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "stdengine.cli.main", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_plugin_is_listed(venv_python):
    r = infer(venv_python, "engines", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    row = rows["numpy-llama"]
    assert row["available"] and row["distribution"] == "stdengine-numpy-llama" and row["version"] == "0.1.0"
    assert "logits" in row["capabilities"] and "temp" in row["honoured_options"]
    assert "reference" in rows  # the built-ins are still there


def test_the_plugin_is_not_in_this_environment():
    from stdengine.registry import entries

    assert "numpy-llama" not in entries()  # the test installed it in its own venv only


def test_infer_run_with_the_plugin(venv_python, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_llama_gguf(model, weight_type="Q8_0")
    r = infer(venv_python, "run", "-e", "numpy-llama", "-m", str(model), "-p", "tok1tok2", "-n", "8", "--temp", "0",
              "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["engine"] == "numpy-llama" and result["usage"]["prompt_tokens"] == 3  # <s> tok1 tok2
    n = result["usage"]["completion_tokens"]
    assert (n, result["finish_reason"]) == (8, "length") or result["finish_reason"] == "stop"
    assert result["text"].startswith("tok")
    r = infer(
        venv_python, "run", "-e", "numpy-llama", "-m", str(model), "-p", "tok1", "--repeat-penalty", "1.1"
    )
    assert r.returncode == 2 and "engine 'numpy-llama' cannot honour repeat_penalty" in r.stderr


def plugin_class() -> Any:
    spec = importlib.util.spec_from_file_location(
        "numpy_llama_src", PLUGIN / "src" / "stdengine_numpy_llama" / "__init__.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NumpyLlamaEngine


def test_the_plugin_forward_pass_matches_llama_cpp(tmp_path):
    pytest.importorskip("llama_cpp")
    from stdengine.engines.llamacpp import LlamaCppEngine

    model = tmp_path / "tiny-f32.gguf"
    # llama.cpp wants a newline byte token in a SentencePiece vocabulary; it never tokenizes here
    write_llama_gguf(
        model, weight_type="F32", tokens=["<unk>", "<s>", "</s>", "<0x0A>"] + [f"tok{i}" for i in range(60)]
    )
    options = Options(model=str(model), ctx_size=64, threads=1)
    ours, theirs = (
        plugin_class().load(options, Emitter(verbosity=0)),
        LlamaCppEngine.load(options, Emitter(verbosity=0)),
    )
    try:
        tokens = [1, 5, 9, 33, 7, 12]
        expected = theirs.decode(tokens, all_logits=True)
        got = ours.decode(tokens, all_logits=True)
        assert got.shape == expected.shape == (6, 64)
        np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max() + 1e-6)
        assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()
        # the KV cache carries on across calls
        np.testing.assert_allclose(
            ours.decode([3, 4]), theirs.decode([3, 4]), atol=1e-4 * np.abs(expected).max() + 1e-6
        )
    finally:
        theirs.close()
