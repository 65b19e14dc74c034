"""Built-in engines other than the reference engine, each registered under the entry-point group
`stdengine.engines` like any third-party engine (pyproject.toml):

- `llamacpp` (llamacpp.py): llama.cpp in-process through llama-cpp-python (the `llamacpp` extra);
- `openai` (openai.py): any OpenAI-compatible HTTP server (llama-server, vLLM, Ollama, ...).

Modules here import their engine's library lazily, so listing engines stays fast and an engine
whose library is missing is reported by `infer engines`, not fatal. spec/engines.md is the prose.
"""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Physical cores (llama.cpp's default thread count), else the logical CPUs."""
    try:
        cores: set[tuple[str, str]] = set()
        phys = ""
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    phys = value.strip()
                elif key.strip() == "core id":
                    cores.add((phys, value.strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1
