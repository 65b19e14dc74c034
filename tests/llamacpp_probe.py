"""Before any test touches llama.cpp in process, check in a subprocess that it runs on this CPU.

llama-cpp-python built for other instructions (AVX-512 on a CPU without it), or with AMX by GCC 12
(README, "llama.cpp with AMX"), dies with SIGILL, and in process that kills the whole pytest run
with no summary. The probe imports llama_cpp, loads a model and decodes one batch in a child
process (about a second and a half); if the child dies by a signal, conftest.py replaces
`llama_cpp` in this process with a module whose every attribute fails with the probe's message,
and fails every `llamacpp`-marked test with it: those tests fail, the others run, and the summary
says why."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

# The child: load the model, decode a batch of 32 tokens (the batch path is where the AMX build
# died), then one token (the generation path).
PROBE = """
import sys
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=128, n_batch=64, n_threads=1, verbose=False)
llm.eval([1 + i % 60 for i in range(32)])
llm.eval([3])
"""

README_HINT = (
    "rebuild llama-cpp-python for this CPU as README.md says (section 'The llama.cpp extra on x86': "
    'CMAKE_ARGS="$(sh .ci/llama-cmake-args)" pip install --no-cache-dir --force-reinstall --no-deps '
    "'llama-cpp-python>=0.3': the instruction sets this CPU lists, without AMX)"
)


def probe_model(tmp: Path) -> str:
    """A small synthetic model whose Q4_0 matrices (1024 wide) are shaped for llama.cpp's SIMD and
    AMX matrix paths; written in about half a second, so the probe never needs a download."""
    from gguf_factory import write_llama_gguf

    path = tmp / "probe.gguf"
    write_llama_gguf(path, weight_type="Q4_0", n_embd=1024, n_ff=1024, n_head=16, n_head_kv=4)
    return str(path)


def crash_message(code: str = PROBE, model: str | None = None) -> str | None:
    """None when llama_cpp is not installed or the child runs `code` to the end (or fails with
    an exception: that is for the tests to report); else what killed it, and what to do."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = model or probe_model(Path(tmp))
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120
            )
        except subprocess.TimeoutExpired:
            return None  # hung, not crashed: the tests that use it report it themselves
    if proc.returncode >= 0:
        return None
    try:
        name = signal.Signals(-proc.returncode).name
    except ValueError:
        name = f"signal {-proc.returncode}"
    return (
        f"llama.cpp (llama-cpp-python) died with {name} when a subprocess loaded a model and "
        f"decoded a batch: its build does not run on this CPU, so every test that needs llama_cpp "
        f"fails rather than crash the run; {README_HINT}"
    )


class CrashedLlamaCpp(types.ModuleType):
    """Stands in for llama_cpp after the probe crashed: any use fails with the probe's message."""

    def __init__(self, message: str) -> None:
        super().__init__("llama_cpp")
        self.message = message

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise RuntimeError(self.message)
