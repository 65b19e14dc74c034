"""The spec is generated from the code: committed schemas and tables must match what the code makes."""

from __future__ import annotations

import re
import subprocess
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


# The CPU flags that matter to llama.cpp's build on each kind of CI machine (/proc/cpuinfo).
CI_CPUS = {
    "AMD EPYC Zen 4": "avx avx2 fma f16c bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma "
    "avx512_vbmi avx512_vbmi2 avx512_vnni avx512_bf16 avx512_bitalg avx512_vpopcntdq",
    "Intel Xeon Emerald Rapids": "avx avx2 fma f16c bmi2 avx_vnni avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512ifma avx512_vbmi avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16",
    "AMD EPYC without AVX-512": "avx avx2 fma f16c bmi2 vaes vpclmulqdq",
}
AVX512_ARGS = ["-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=ON"]


def test_readme_builds_llama_cpp_as_ci_does_for_this_cpu(tmp_path):
    """The README's test command and .ci/run build llama-cpp-python with the flags that
    .ci/llama-cmake-args reads off the CPU, past pip's wheel cache (keyed without CMAKE_ARGS); on
    each CI machine those flags are its instruction sets (AVX-512's only where it has them: a build
    with them dies with SIGILL on a CPU without), not native, never AMX, never VEX AVX-VNNI (Zen 4
    lacks it)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".ci" / "run").is_file():
        pytest.skip("not a source checkout")
    for f in ("README.md", ".ci/run"):
        m = re.search(
            r'CMAKE_ARGS="\$\(sh \.ci/llama-cmake-args\)" pip install ([^\n|]*)', (root / f).read_text()
        )
        assert m, f'{f}: no CMAKE_ARGS="$(sh .ci/llama-cmake-args)" pip install line'
        assert all(word in m.group(1) for word in ("--no-cache-dir", "--force-reinstall", "llama-cpp-python"))

    def args(cpuinfo: str) -> list[str]:
        (tmp_path / "cpuinfo").write_text(cpuinfo)
        run = subprocess.run(
            ["sh", str(root / ".ci/llama-cmake-args"), str(tmp_path / "cpuinfo")],
            capture_output=True,
            text=True,
            check=True,
        )
        return run.stdout.split()

    base = [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DLLAVA_BUILD=OFF",
    ]
    for cpu, flags in CI_CPUS.items():
        got = args(f"processor\t: 0\nflags\t\t: fpu {flags}\n")
        want = base + (AVX512_ARGS if "avx512f" in flags else [])
        assert sorted(got) == sorted(want), cpu
    assert args("processor\t: 0\nFeatures\t: fp asimd\n") == ["-DLLAVA_BUILD=OFF"]  # ARM: native
