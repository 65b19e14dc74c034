"""infer-bench with the real engines on the catalogue models, the model fields against llama.cpp's
own, and `infer-bench compare` (table and plot) on two result files."""

from __future__ import annotations

import ctypes
import io
import json
import os
import sqlite3
import subprocess
import sys

import pytest
from stdengine.bench.compare import main as compare_main
from stdengine.bench.params import parse_args
from stdengine.bench.printers import make_printer
from stdengine.bench.record import finish, model_fields

from stdengine import registry


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.models
def test_reference_and_llamacpp_side_by_side(smollm2_path):
    missing = [e for e in ("reference", "llamacpp") if e not in registry.entries()]
    if missing:
        pytest.skip(f"engine(s) not registered yet: {', '.join(missing)}")
    r = bench(
        "-m",
        str(smollm2_path),
        "-e",
        "reference,llamacpp",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "-t",
        "2",
        "-o",
        "jsonl",
    )
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["engine"], x["n_prompt"], x["n_gen"]) for x in recs] == [
        ("reference", 16, 0),
        ("reference", 0, 4),
        ("llamacpp", 16, 0),
        ("llamacpp", 0, 4),
    ]
    for x in recs:
        assert x["model_type"] == "llama 256M Q4_1"
        assert x["model_size"] == 96576768 and x["model_n_params"] == 134515008
        assert x["backends"] == "CPU" and x["gpu_info"] == "" and x["n_threads"] == 2
        assert len(x["samples_ns"]) == 1 and x["avg_ts"] > 0 and x["n_ctx"] >= 16
    assert recs[0]["build_number"] == 0 and recs[0]["build_commit"]
    assert recs[2]["engine_version"]


@pytest.mark.models
def test_sampled_generation_with_the_screen_on_and_off(smollm2_path):
    """--sample-gen: every generated token is sampled (greedy) by the engine's own sampler, so the
    reference engine's screened head shows; the records say so (gen_sampled, engine_args) and so
    does the table. An engine that does not sample in process is refused."""
    for screen in ("on", "off"):
        r = bench(
            "-m",
            str(smollm2_path),
            "-p",
            "0",
            "-n",
            "8",
            "-r",
            "1",
            "--sample-gen",
            "-E",
            f"screen_head={screen}",
            "-o",
            "jsonl",
        )
        assert r.returncode == 0, r.stderr
        (rec,) = [json.loads(line) for line in r.stdout.splitlines()]
        assert (
            rec["gen_sampled"] is True and rec["engine_args"] == f"screen_head={screen}" and rec["avg_ts"] > 0
        )
    r = bench("-m", str(smollm2_path), "-p", "0", "-n", "8", "-r", "1", "--sample-gen")
    assert r.returncode == 0, r.stderr
    assert "tg8 sampled" in r.stdout
    r = bench("-e", "openai", "--url", "http://127.0.0.1:9", "-m", "x", "-p", "0", "-n", "8", "--sample-gen")
    assert r.returncode != 0


@pytest.mark.models
@pytest.mark.llamacpp
def test_llamacpp_alone_with_depth_json_on_clean_stdout(gemma3_path):
    if "llamacpp" not in registry.entries():
        pytest.skip("engine not registered yet: llamacpp")
    r = bench(
        "-m",
        str(gemma3_path),
        "-e",
        "llamacpp",
        "-p",
        "8",
        "-n",
        "2",
        "-d",
        "0,8",
        "-r",
        "2",
        "-t",
        "2",
        "-o",
        "json",
        "--progress",
    )
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)  # progress went to stderr; stdout is the json document alone
    assert [(x["n_prompt"], x["n_gen"], x["n_depth"]) for x in recs] == [
        (8, 0, 0),
        (0, 2, 0),
        (8, 0, 8),
        (0, 2, 8),
    ]
    assert {x["model_type"] for x in recs} == {"gemma3 270M Q4_K - Medium"}
    assert {x["n_ctx"] >= 16 for x in recs} == {True}
    assert "infer-bench: benchmark 3/4: depth run 1/2" in r.stderr


def _llama_cpp_desc(path: str) -> tuple[str, int, int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    assert model
    try:
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(model, buf, 256)
        return (
            buf.value.decode(),
            int(llama_cpp.llama_model_size(model)),
            int(llama_cpp.llama_model_n_params(model)),
        )
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.models
@pytest.mark.llamacpp
@pytest.mark.parametrize("fixture", ["smollm2_path", "gemma3_path"])
def test_model_fields_match_llama_cpp(fixture, request):
    path = str(request.getfixturevalue(fixture))
    desc, size, n_params = _llama_cpp_desc(path)
    mf = model_fields(path)
    assert (mf["model_type"], mf["model_size"], mf["model_n_params"]) == (desc, size, n_params)


# --- compare and plot -----------------------------------------------------------------------------


def _record(engine: str, n_prompt: int, n_gen: int, samples: list[int], threads: int = 2) -> dict:
    rec = {
        "build_commit": "abc1234" if engine == "reference" else "llama-cpp-python 0.3.36",
        "build_number": 0,
        "cpu_info": "AMD EPYC",
        "gpu_info": "",
        "backends": "CPU",
        "model_filename": "/m/smol.gguf",
        "model_type": "llama 256M Q4_1",
        "model_size": 96576768,
        "model_n_params": 134515008,
        "n_batch": 2048,
        "n_ubatch": 512,
        "n_threads": threads,
        "cpu_mask": "0x0",
        "cpu_strict": False,
        "poll": 50,
        "type_k": "f16",
        "type_v": "f16",
        "n_gpu_layers": 0,
        "n_cpu_moe": 0,
        "split_mode": "layer",
        "main_gpu": 0,
        "no_kv_offload": False,
        "flash_attn": False,
        "devices": "auto",
        "tensor_split": "0.00",
        "tensor_buft_overrides": "none",
        "use_mmap": True,
        "embeddings": False,
        "no_op_offload": 0,
        "no_host": False,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": 0,
        "test_time": "2026-11-29T17:00:00Z",
        "engine": engine,
        "engine_version": "0.1.0",
        "engine_build": "",
        "n_ctx": n_prompt + n_gen,
        "recipe": "",
    }
    return finish(rec, samples)


def _write(path, fmt: str, records: list[dict]) -> str:
    out = io.StringIO()
    p = make_printer(fmt, out, parse_args([]))
    p.header()
    for r in records:
        p.record(r)
    p.footer()
    path.write_text(out.getvalue())
    return str(path)


@pytest.fixture
def two_files(tmp_path):
    base = [
        _record("llamacpp", 512, 0, [1_000_000_000, 1_000_000_000]),
        _record("llamacpp", 0, 128, [4_000_000_000]),
    ]
    cand = [
        _record("reference", 512, 0, [500_000_000, 500_000_000]),
        _record("reference", 0, 128, [2_000_000_000]),
        _record("reference", 0, 64, [1_000_000_000]),
    ]  # no match in base: left out
    return _write(tmp_path / "base.json", "json", base), _write(tmp_path / "cand.jsonl", "jsonl", cand)


def test_compare_table(two_files, capsys):
    assert compare_main(list(two_files)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "| model           |  test | base     |      t/s base | candidate |  t/s candidate | speedup |"
    )
    assert lines[1] == (
        "| --------------- | ----: | -------- | ------------: | --------- | -------------: | ------: |"
    )
    assert lines[2] == (
        "| llama 256M Q4_1 | pp512 | llamacpp | 512.00 ± 0.00 | reference | 1024.00 ± 0.00 |    2.00 |"
    )
    assert lines[3] == (
        "| llama 256M Q4_1 | tg128 | llamacpp |  32.00 ± 0.00 | reference |   64.00 ± 0.00 |    2.00 |"
    )
    assert len(lines) == 4


def test_compare_json_and_sqlite(two_files, tmp_path, capsys):
    base, cand = two_files
    # the same results loaded into sqlite from -o sql, as llama.cpp's tooling does
    sql = _write(tmp_path / "cand.sql", "sql", [json.loads(line) for line in open(cand)])
    db = tmp_path / "cand.db"
    con = sqlite3.connect(db)
    con.executescript(open(sql).read())
    con.close()
    assert compare_main([base, str(db), "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["speedup"]) for r in rows] == [("pp512", 2.0), ("tg128", 2.0)]
    assert compare_main([base, sql, "--candidate-engine", "reference", "-o", "csv"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0] == "model,test,base,t/s base,candidate,t/s candidate,speedup"
    )


def test_compare_one_file_with_two_engines(tmp_path, capsys):
    both = _write(
        tmp_path / "both.jsonl",
        "jsonl",
        [_record("reference", 64, 0, [100_000_000]), _record("llamacpp", 64, 0, [200_000_000])],
    )
    assert compare_main([both, both]) == 1
    assert "choose one with --base-engine (llamacpp, reference)" in capsys.readouterr().err
    assert compare_main([both, both, "--base-engine", "llamacpp", "--candidate-engine", "reference"]) == 0
    assert "|    2.00 |" in capsys.readouterr().out


def test_compare_errors(two_files, tmp_path, capsys):
    base, _ = two_files
    assert compare_main([base]) == 1
    assert "two results files" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("hello")
    assert compare_main([base, str(bad)]) == 1
    assert "not a json, jsonl, sql or sqlite results file" in capsys.readouterr().err
    assert compare_main([base, str(tmp_path / "missing.json")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_plot(two_files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "cmp.png"
    assert compare_main([*two_files, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_without_matplotlib_is_a_clear_error(two_files, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert compare_main([*two_files, "--plot", str(tmp_path / "x.png")]) == 2  # usage (spec/errors.md)
    out = capsys.readouterr()
    assert out.out == ""  # no table before the error
    assert "error: --plot needs matplotlib" in out.err and "hint: pip install 'stdengine[plot]'" in out.err


@pytest.mark.models
def test_peak_memory_of_a_run(smollm2_path, tmp_path):
    """compare_llamacpp's peak memory: the child's own resident set, which holds the whole model
    (a prompt reads all the weights) and not the pages of the large process that started it; a
    failed run is an error naming the command."""
    import numpy as np
    from stdengine.bench.compare_llamacpp import peak_rss_mb

    parent = np.ones(512 * 2**20, dtype=np.uint8)  # 512 MiB resident here
    mb = peak_rss_mb(str(smollm2_path), "reference", 1)
    file_mb = os.path.getsize(smollm2_path) / 2**20
    assert file_mb < mb < file_mb + 400
    del parent
    with pytest.raises(RuntimeError, match="infer-bench -m .*missing.gguf"):
        peak_rss_mb(str(tmp_path / "missing.gguf"), "reference", 1)


def vs_llamacpp(*args: str, timeout: float = 60, cwd: object = None) -> subprocess.CompletedProcess[str]:
    """`infer bench vs-llamacpp ARGS` in a new process."""
    cmd = [sys.executable, "-m", "stdengine.cli.main", "bench", "vs-llamacpp", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_bench_vs_llamacpp_help_names_the_memory_source_and_the_output_folder():
    r = vs_llamacpp("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: infer bench vs-llamacpp" in r.stdout
    assert "VmHWM" in r.stdout and "ru_maxrss" not in r.stdout  # what peak_rss_mb reads
    assert "--out" in r.stdout and "./bench-results" in r.stdout


@pytest.mark.models
@pytest.mark.llamacpp
def test_bench_vs_llamacpp_writes_into_the_current_directory(smollm2_path, tmp_path):
    """`infer bench vs-llamacpp` writes its records, table and memory into ./bench-results of the
    directory it runs in (never into the installed package), and says how it was run."""
    import stdengine.bench

    if "llamacpp" not in registry.entries():
        pytest.skip("engine llamacpp not registered")
    args = ["--models", str(smollm2_path), "--threads", "1", "--depths", "0", "-p", "16", "-n", "4"]
    r = vs_llamacpp(*args, "--reps", "1", "--name", "t", timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "bench-results"
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".png") == ["t.jsonl", "t.md"]
    engines = sorted(json.loads(line)["engine"] for line in (out / "t.jsonl").read_text().splitlines())
    assert engines == ["llamacpp", "llamacpp", "reference", "reference"]  # pp16 and tg4 each
    md = (out / "t.md").read_text()
    assert "- command: infer bench vs-llamacpp --models" in md and "## peak memory" in md
    assert "speedup" in r.stdout  # the ratio table on stdout
    # the machine probe, the roofline beside both engines' figures, and the llama.cpp build
    assert "- machine probe: read bandwidth, DRAM" in md and "- machine probe: int8 multiply-accumulate" in md
    assert "## roofline" in md and "llamacpp t/s" in md and "reference t/s" in md and "reached" in md
    assert "- llama.cpp build: llama-cpp-python" in md and "llama.cpp build: llama-cpp-python" in r.stdout
    package_results = os.path.join(os.path.dirname(stdengine.bench.__file__), "results")
    assert not os.path.exists(os.path.join(package_results, "t.jsonl"))  # not beside the package


@pytest.mark.llamacpp
def test_llamacpp_path_runs_the_build_in_that_folder(tmp_path):
    """--llamacpp-path DIR imports llama_cpp from DIR (here the installed build's own folder, as a
    second build would be) and the report names it; a folder without llama_cpp is refused."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")  # finds it without importing it here
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed")
    folder = os.path.dirname(os.path.dirname(spec.origin))
    code = (
        "import sys; from stdengine.bench.compare_llamacpp import use_llamacpp_path, llamacpp_build; "
        "print(use_llamacpp_path(sys.argv[1])); print(llamacpp_build())"
    )
    r = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    resolved, build = r.stdout.splitlines()[-2:]
    assert resolved == os.path.realpath(folder)
    assert build.startswith("llama-cpp-python ") and f"from {resolved} (system info: " in build
    r = vs_llamacpp("--llamacpp-path", str(tmp_path))
    assert r.returncode == 2 and f"--llamacpp-path {tmp_path}: no llama_cpp package" in r.stderr


@pytest.mark.models
def test_peak_memory_probe_ignores_a_stdengine_folder_in_the_current_directory(smollm2_path, tmp_path):
    # From a source checkout (a `stdengine/` folder here) the probe must still run the installed
    # package, not fail with "No module named 'stdengine.bench'".
    from stdengine.bench.compare_llamacpp import peak_rss_mb

    (tmp_path / "stdengine").mkdir()
    (tmp_path / "stdengine" / "__init__.py").write_text("raise ImportError('the shadowing folder')\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert peak_rss_mb(str(smollm2_path), "reference", 1) > 0
    finally:
        os.chdir(cwd)
