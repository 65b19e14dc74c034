"""The spec is generated from the code: committed schemas and tables must match what the code makes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stdengine import spec_gen
from stdengine.errors import all_error_classes
from stdengine.options import OPTION_NAMES


def test_committed_spec_matches_the_code():
    stale = [
        str(p)
        for p, content in spec_gen.render(spec_gen.default_spec_dir()).items()
        if not p.exists() or p.read_text(encoding="utf-8") != content
    ]
    assert not stale, f"run `python -m stdengine.spec_gen`; out of date: {stale}"


def test_every_option_is_in_the_options_table():
    table = (spec_gen.default_spec_dir() / "options.md").read_text()
    for name in OPTION_NAMES:
        assert f"| `{name}` |" in table


def test_error_codes_and_exit_statuses_are_unique_where_they_should_be():
    classes = all_error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    # each top-level family has its own exit status
    top = [c for c in classes if c.__base__.__name__ == "InferError"]
    assert len({c.exit_status for c in top}) == len(top)


def test_readme_builds_llama_cpp_as_ci_does_for_both_ci_machines():
    """The README's test command and .ci/run build llama-cpp-python with the same flags, which run
    on AMD Zen 4 and on Intel Xeons with AMX: not native, no AMX, no VEX AVX-VNNI (Zen 4 lacks it),
    and past pip's wheel cache (keyed without CMAKE_ARGS)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".ci" / "run").is_file():
        pytest.skip("not a source checkout")

    def install(text: str) -> tuple[list[str], str]:
        m = re.search(r'CMAKE_ARGS="([^"]*)"\s*\\?\s*pip install ([^\n|]*)', text)
        assert m, "no CMAKE_ARGS=... pip install line"
        return m.group(1).replace("\\\n", " ").split(), m.group(2).strip()

    (flags, readme_cmd), (ci_flags, ci_cmd) = (
        install((root / f).read_text()) for f in ("README.md", ".ci/run")
    )
    assert flags == ci_flags
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=ON" in flags
    assert not any("AMX" in f or "AVX_VNNI" in f for f in flags)
    for command in (readme_cmd, ci_cmd):
        assert (
            "--no-cache-dir" in command and "--force-reinstall" in command and "llama-cpp-python" in command
        )
