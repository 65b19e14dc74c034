"""infer-bench: llama-bench's flags, list and range syntax, semantics and printers.

The printers are checked against text written by hand from llama-bench's format rules
(/work/shared/anchors/llamacpp-anchors.md §1.4), not against the printers' own output.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
from gguf_factory import write_llama_gguf
from stdengine.bench import runner
from stdengine.bench.params import ParamError, instances, parse_args, parse_int_range
from stdengine.bench.printers import make_printer
from stdengine.bench.record import FIELD_NAMES, LLAMA_BENCH_FIELDS, finish, size_label

from stdengine import registry
from stdengine.adapter import Engine, EngineInfo
from stdengine.cli import bench as bench_cli

# --- ranges and lists ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512", [512]),
        ("1,2,3", [1, 2, 3]),
        ("1-4", [1, 2, 3, 4]),
        ("8-32+8", [8, 16, 24, 32]),
        ("1-16*2", [1, 2, 4, 8, 16]),
        ("1-10*3", [1, 3, 9]),
        ("4-4", [4]),
        ("1-3,8,16-32+16", [1, 2, 3, 8, 16, 32]),
    ],
)
def test_int_ranges(text, expected):
    assert parse_int_range(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("8-4", "invalid range"),
        ("1-8+0", "invalid range"),
        ("1-8*1", "invalid range"),
        ("0-8*2", "invalid range"),
        ("a", "invalid range format"),
        ("1-", "invalid range format"),
        ("1-8/2", "invalid range format"),
        ("", "invalid range format"),
        ("-1", "invalid range format"),
    ],
)
def test_bad_ranges(text, message):
    with pytest.raises(ValueError) as e:
        parse_int_range(text)
    assert str(e.value) == message


def test_negative_first_value_only_for_ngl():
    assert parse_args(["-ngl", "-1,0"]).n_gpu_layers == [-1, 0]
    with pytest.raises(ParamError):
        parse_args(["-t", "-1"])


@pytest.mark.parametrize(
    ("flag", "value"), [("-t", "0"), ("-t", "2,0"), ("-b", "0"), ("-ub", "0"), ("-ngl", "-5")]
)
def test_values_out_of_the_options_range_are_bad_parameters(flag, value):
    """Refused with the usage, as llama-bench does, not later as an engine's failure to load."""
    with pytest.raises(ParamError) as e:
        parse_args([flag, value])
    assert e.value.arg == flag and "out of range" in e.value.detail


def test_lists_append_across_repeated_flags_and_defaults_fill_the_rest():
    p = parse_args(
        ["-p", "128,256", "-p", "512-1024*2", "-n", "0", "-e", "a,b", "-e", "c", "-pg", "8,2", "-pg", "4,1"]
    )
    assert p.n_prompt == [128, 256, 512, 1024]
    assert p.n_gen == [0]
    assert p.engines == ["a", "b", "c"]
    assert p.n_pg == [(8, 2), (4, 1)]
    assert p.n_batch == [2048] and p.n_ubatch == [512] and p.reps == 5 and p.n_depth == [0]
    assert p.type_k == ["f16"] and p.flash_attn == [False] and p.use_mmap == [True]
    assert p.given == set()
    q = parse_args(["-t", "1-2", "-fa", "0,1", "-ctk", "q8_0", "--no_warmup", "-mmp", "0"])
    assert q.given == {"threads", "flash_attn", "cache_type_k", "mmap"}
    assert q.no_warmup and q.use_mmap == [False]


def test_every_combination_runs_in_llama_bench_order():
    p = parse_args(
        ["-m", "x", "-e", "a,b", "-p", "16,32", "-n", "4", "-pg", "8,2", "-d", "0,64", "-t", "1,2"]
    )
    insts = instances(p)
    assert len(insts) == 2 * 2 * 2 * 4  # engines x threads x depths x (2 pp + 1 tg + 1 pg)
    first = [(i.engine, i.n_threads, i.n_depth, i.n_prompt, i.n_gen) for i in insts[:8]]
    assert first == [
        ("a", 1, 0, 16, 0),
        ("a", 1, 0, 32, 0),
        ("a", 1, 0, 0, 4),
        ("a", 1, 0, 8, 2),
        ("a", 1, 64, 16, 0),
        ("a", 1, 64, 32, 0),
        ("a", 1, 64, 0, 4),
        ("a", 1, 64, 8, 2),
    ]
    assert insts[8].n_threads == 2 and insts[16].engine == "b"
    # -p 0 and -n 0 skip those tests
    assert [(i.n_prompt, i.n_gen) for i in instances(parse_args(["-p", "0", "-n", "3"]))] == [(0, 3)]


@pytest.mark.parametrize(
    "argv, arg",
    [
        (["-x"], "-x"),
        (["-p"], "-p"),
        (["-p", "8-4"], "-p"),
        (["-o", "xml"], "-o"),
        (["-pg", "1,2,3"], "-pg"),
        (["-fa", "2"], "-fa"),
        (["-ctk", "q9"], "-ctk"),
        (["-r", "0"], "-r"),
        (["--poll", "50"], "--poll"),
    ],
)
def test_bad_flags_print_llama_bench_error_and_usage(argv, arg, capsys):
    with pytest.raises(SystemExit) as e:
        bench_cli.main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"error: invalid parameter for argument: {arg}\n" in err
    assert "usage: infer-bench [options]" in err
    if argv[-1] == "8-4":
        assert err.startswith("error: invalid range\n")


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        bench_cli.main(["-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "first-last*mult" in out and "-e, --engine" in out


# --- printers against hand-written expectations ---------------------------------------------


def fixed_record(**over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "build_commit": "abc1234",
        "build_number": 0,
        "cpu_info": "AMD EPYC",
        "gpu_info": "",
        "backends": "CPU",
        "model_filename": "/m/x.gguf",
        "model_type": "llama 256M Q4_1",
        "model_size": 96576768,
        "model_n_params": 134515008,
        "n_batch": 2048,
        "n_ubatch": 512,
        "n_threads": 2,
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
        "n_prompt": 512,
        "n_gen": 0,
        "n_depth": 0,
        "test_time": "2026-11-29T17:00:00Z",
        "engine": "reference",
        "engine_version": "0.1.0",
        "engine_build": "isa=avx2",
        "n_ctx": 512,
        "recipe": "",
    }
    rec.update(over)
    return finish(rec, rec.pop("samples", [1_000_000_000, 500_000_000]))


def render(fmt: str, records: list[dict[str, Any]], argv: Sequence[str] = ("-t", "2")) -> str:
    out = io.StringIO()
    p = make_printer(fmt, out, parse_args(list(argv)))
    p.header()
    for r in records:
        p.record(r)
    p.footer()
    return out.getvalue()


def test_timing_fields():
    rec = fixed_record()
    assert rec["avg_ns"] == 750_000_000
    assert rec["stddev_ns"] == 353_553_390  # sample sd (n-1) of 1e9 and 5e8, truncated
    assert rec["avg_ts"] == 768.0  # mean of 512 and 1024 t/s, not 1024 tokens / 1.5 s
    assert rec["stddev_ts"] == pytest.approx(362.038672, abs=1e-6)
    assert fixed_record(samples=[2_000_000])["stddev_ts"] == 0.0


def test_markdown_layout():
    two = [
        fixed_record(),
        fixed_record(
            n_prompt=0, n_gen=128, n_depth=512, engine="llamacpp", samples=[1_000_000_000, 1_000_000_000]
        ),
    ]
    # widths: model -30, size 10, params 10, backend -10, engine -10 (ours), threads 7, test 15, t/s 20
    expected = (
        "| model                          |       size |     params | backend    | engine     | threads |"
        "            test |                  t/s |\n"
        "| ------------------------------ | ---------: | ---------: | ---------- | ---------- | ------: |"
        " --------------: | -------------------: |\n"
        "| llama 256M (real 135M) Q4_1    |  92.10 MiB |   134.52 M | CPU        | reference  |       2 |"
        "           pp512 |      768.00 ± 362.04 |\n"
        "| llama 256M (real 135M) Q4_1    |  92.10 MiB |   134.52 M | CPU        | llamacpp   |       2 |"
        "    tg128 @ d512 |        128.00 ± 0.00 |\n"
        "\n"
        "build: abc1234 (0)\n"
    )
    assert render("md", two) == expected


def test_markdown_shows_options_with_several_or_non_default_values():
    rec = fixed_record(
        n_batch=512,
        flash_attn=True,
        model_size=5 * 1024**3,
        model_n_params=7_620_000_000,
        backends="CUDA",
        n_gpu_layers=99,
    )
    text = render("md", [rec], ["-b", "512", "-fa", "1"])
    head, sep, row = text.splitlines()[:3]
    assert head == (
        "| model                          |       size |     params | backend    | engine     | ngl |"
        " n_batch | fa |            test |                  t/s |"
    )
    assert sep == (
        "| ------------------------------ | ---------: | ---------: | ---------- | ---------- | --: |"
        " ------: | -: | --------------: | -------------------: |"
    )
    assert row == (
        "| llama 256M (real 7.6B) Q4_1    |   5.00 GiB |     7.62 B | CUDA       | reference  |  99 |"
        "     512 |  1 |           pp512 |      768.00 ± 362.04 |"
    )


def test_markdown_model_column_says_the_real_parameter_count_beside_a_far_size_class():
    """llama.cpp's size class comes from the layer count (SmolLM2-135M is `llama 256M`); md adds the
    real count where the class is more than 25% off, and the machine formats keep llama-bench's
    model_type (model_n_params has the exact count)."""
    from stdengine.bench.printers import md_model

    assert md_model("llama 256M Q4_1", 134_515_008) == "llama 256M (real 135M) Q4_1"
    assert md_model("gemma3 270M Q4_K - Medium", 268_098_176) == "gemma3 270M Q4_K - Medium"
    assert md_model("llama 8B Q4_0", 8_030_261_248) == "llama 8B Q4_0"
    assert md_model("llama 1B Q8_0", 3_210_000_000) == "llama 1B (real 3.2B) Q8_0"
    assert md_model("llama ?B all F32", 82_240) == "llama ?B all F32"
    rec = fixed_record()
    for fmt in ("csv", "json", "jsonl", "sql"):
        text = render(fmt, [rec])
        assert "llama 256M Q4_1" in text and "real" not in text, fmt


def test_csv():
    text = render("csv", [fixed_record(model_filename='a "quoted" name')])
    header, row = text.splitlines()
    assert header == ",".join(FIELD_NAMES)
    assert header.startswith("build_commit,build_number,cpu_info,gpu_info,backends,model_filename,")
    assert row.startswith(
        '"abc1234","0","AMD EPYC","","CPU","a ""quoted"" name","llama 256M Q4_1","96576768",'
    )
    assert (
        '"2026-11-29T17:00:00Z","750000000","353553390","768.000000","362.038672","reference","0.1.0",' in row
    )
    assert "samples" not in text


def test_json_exact_layout():
    text = render("json", [fixed_record(), fixed_record(cpu_info='x"y\\z\t')])
    assert text.startswith(
        '[\n  {\n    "build_commit": "abc1234",\n    "build_number": 0,\n    "cpu_info": "AMD EPYC",\n'
    )
    assert '    "cpu_strict": false,\n' in text and '    "use_mmap": true,\n' in text
    assert '    "avg_ts": 768.000000,\n    "stddev_ts": 362.038672,\n    "engine": "reference",\n' in text
    assert (
        '    "recipe": "",\n    "engine_args": "",\n    "gen_sampled": false,\n'
        '    "samples_ns": [ 1000000000, 500000000 ],\n    "samples_ts": [ 512, 1024 ]\n  },\n  {\n'
    ) in text
    assert '    "cpu_info": "x\\"y\\\\z\\u0009",\n' in text
    assert text.endswith("  }\n]\n")
    rows = json.loads(text)
    assert len(rows) == 2 and rows[1]["cpu_info"] == 'x"y\\z\t'
    assert list(rows[0])[: len(LLAMA_BENCH_FIELDS)] == [f for f, _ in LLAMA_BENCH_FIELDS]


def test_jsonl_exact_layout():
    text = render("jsonl", [fixed_record(samples=[3_000_000_000, 1_000_000_000, 7_000_000])])
    line = text.splitlines()[0]
    assert line.startswith('{"build_commit": "abc1234", "build_number": 0, ')
    # samples_ts: C++ ostream's 6 significant digits; no space before "samples_ts"
    assert line.endswith(
        '"recipe": "", "engine_args": "", "gen_sampled": false, "samples_ns": [ 3000000000, 1000000000, 7000000 ],'
        '"samples_ts": [ 170.667, 512, 73142.9 ]}'
    )
    assert json.loads(line)["n_prompt"] == 512


def test_sql_loads_into_sqlite():
    text = render("sql", [fixed_record(), fixed_record(model_filename="it's here")])
    assert text.startswith(
        "CREATE TABLE IF NOT EXISTS llama_bench (\n  build_commit TEXT,\n  build_number INTEGER,\n"
        "  cpu_info TEXT,\n"
    )
    assert "  avg_ts REAL,\n  stddev_ts REAL,\n  engine TEXT,\n" in text
    assert (
        "  recipe TEXT,\n  engine_args TEXT,\n  gen_sampled INTEGER\n);\n\nINSERT INTO llama_bench (build_commit, build_number, "
        in text
    )
    assert "VALUES ('abc1234', '0', 'AMD EPYC', '', 'CPU', '/m/x.gguf', " in text
    con = sqlite3.connect(":memory:")
    con.executescript(text)
    rows = con.execute("SELECT model_filename, n_prompt, avg_ts, engine FROM llama_bench").fetchall()
    assert rows == [("/m/x.gguf", 512, 768.0, "reference"), ("it's here", 512, 768.0, "reference")]


def test_size_labels_follow_llama_cpp():
    assert size_label("llama", 30, 49152, 9, 3) == "256M"  # SmolLM2-135M: llama.cpp labels by n_layer
    assert size_label("llama", 32, 32000, 32, 32) == "7B"
    assert size_label("llama", 80, 32000, 64, 8) == "70B"
    assert size_label("gemma3", 18, 262144, 4, 1) == "270M"
    assert size_label("llama", 7, 100, 4, 4) == "?B"
    assert size_label("qwen2", 28, 1, 1, 1) == "?B"


# --- semantics with a counting engine --------------------------------------------------------


class FakeClock:
    """Time advances only while the engine decodes: 1000 ns per token."""

    now = 0

    @classmethod
    def perf_counter_ns(cls) -> int:
        return cls.now

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


class CountingEngine(Engine):
    name = "counting"
    capabilities = frozenset({"logits", "tokenize"})
    option_map: ClassVar[dict[str, str]] = {
        "ctx_size": "",
        "threads": "",
        "batch_size": "",
        "ubatch_size": "",
        "threads_batch": "",
    }
    accepted_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        "flash_attn": (False,),
        "n_gpu_layers": (0,),
        "mmap": (True,),
    }
    log: ClassVar[list[tuple[Any, ...]]] = []
    loads: ClassVar[list[Any]] = []
    bos: ClassVar[int | None] = 1

    def __init__(self, options: Any) -> None:
        self.options = options

    @classmethod
    def load(cls, options, events):
        cls.loads.append(options)
        return cls(options)

    def info(self):
        return EngineInfo(name="counting", version="9.9", build="b4242", model={"n_vocab": 64})

    def tokenize(self, text, add_special=True, parse_special=True):
        return [self.bos] if (add_special and self.bos is not None) else []

    def detokenize(self, tokens):
        return ""

    def decode(self, tokens, all_logits=False):
        assert all(0 <= t < 64 for t in tokens)
        self.log.append(("decode", len(tokens), tokens[0]))
        FakeClock.now += 1000 * len(tokens)
        return np.zeros(64, dtype=np.float32)

    def reset(self):
        self.log.append(("reset",))

    def generate(self, request):
        raise NotImplementedError

    def n_ctx(self):
        return int(self.options.ctx_size)


@pytest.fixture
def counting(tmp_path, monkeypatch):
    model = write_llama_gguf(tmp_path / "tiny.gguf", n_layer=2).path
    registry.register("counting", CountingEngine)
    monkeypatch.setattr(runner, "time", FakeClock)
    CountingEngine.log.clear()
    CountingEngine.loads.clear()
    CountingEngine.bos = 1
    yield str(model)
    registry.unregister("counting")


def bench(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        bench_cli.main(argv)
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_warmup_reps_chunks_and_untimed_depth(counting, capsys):
    code, out, err = bench(
        [
            "-m",
            counting,
            "-e",
            "counting",
            "-p",
            "10",
            "-n",
            "3",
            "-d",
            "5",
            "-b",
            "4",
            "-r",
            "2",
            "-o",
            "jsonl",
        ],
        capsys,
    )
    assert code == 0, err
    D = "decode"
    log = CountingEngine.log
    # test 1 (pp10 @ d5): reset, warm-up prompt (chunks of n_batch=4, BOS first), then per rep:
    # reset, untimed depth prefill (5 tokens: 4 + 1), timed prompt (4 + 4 + 2)
    shape = [e[:2] for e in log]
    pp = [(D, 4), (D, 4), (D, 2)]
    depth = [(D, 4), (D, 1)]
    tg = [(D, 1)] * 3
    expected = [("reset",), *pp] + ([("reset",), *depth, *pp] * 2)
    expected += [("reset",), (D, 1)] + ([("reset",), *depth, *tg] * 2)
    assert shape == expected
    # BOS (id 1) opens every prompt and depth run and every generation run; the rest are random
    starts = [i for i, e in enumerate(log) if e == ("reset",)]
    for i in starts:
        if i + 1 < len(log):
            assert log[i + 1][2] == 1
    recs = [json.loads(line) for line in out.splitlines()]
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in recs] == [(10, 0, 5), (0, 3, 5)]
    # only the timed tokens count: 10 prompt tokens, 3 generated ones (FakeClock: 1000 ns per token)
    assert recs[0]["samples_ns"] == [10_000, 10_000] and recs[1]["samples_ns"] == [3_000, 3_000]
    assert recs[0]["avg_ts"] == pytest.approx(1e6)
    assert recs[0]["engine"] == "counting" and recs[0]["engine_version"] == "9.9"
    assert recs[0]["build_commit"] == "b4242" and recs[0]["build_number"] == 4242
    assert recs[0]["model_type"] == "llama ?B all F32"  # the tiny test model: 2 layers, f32 weights
    # loaded once, with the largest n_ctx of the tests it serves (10 + 5)
    assert len(CountingEngine.loads) == 1
    opts = CountingEngine.loads[0]
    assert opts.ctx_size == 15 and opts.batch_size == 4 and opts.threads == recs[0]["n_threads"]
    assert recs[0]["n_ctx"] == 15


def test_no_warmup_and_no_bos(counting, capsys):
    CountingEngine.bos = None
    code, out, err = bench(
        ["-m", counting, "-e", "counting", "-p", "3", "-n", "0", "-r", "3", "--no-warmup", "-o", "json"],
        capsys,
    )
    assert code == 0, err
    assert [e[:2] for e in CountingEngine.log] == [("reset",)] + [("reset",), ("decode", 3)] * 3
    assert len(json.loads(out)[0]["samples_ns"]) == 3


def test_pg_test_times_prompt_and_generation_together(counting, capsys):
    code, out, err = bench(
        ["-m", counting, "-e", "counting", "-p", "0", "-n", "0", "-pg", "6,2", "-r", "1", "-o", "jsonl"],
        capsys,
    )
    assert code == 0, err
    rec = json.loads(out)
    assert rec["samples_ns"] == [8_000] and rec["avg_ts"] == pytest.approx(1e6)


def test_reload_only_when_the_load_configuration_changes(counting, capsys):
    code, out, err = bench(
        [
            "-m",
            counting,
            "-e",
            "counting",
            "-p",
            "4",
            "-n",
            "2",
            "-d",
            "0,8",
            "-t",
            "1,2",
            "-r",
            "1",
            "-o",
            "jsonl",
        ],
        capsys,
    )
    assert code == 0, err
    assert [o.threads for o in CountingEngine.loads] == [1, 2]
    assert [o.ctx_size for o in CountingEngine.loads] == [12, 12]
    assert len(out.splitlines()) == 8


def test_option_the_engine_cannot_honour_skips_those_rows(counting, capsys):
    code, out, err = bench(
        ["-m", counting, "-e", "counting", "-p", "4", "-n", "0", "-fa", "0,1", "-r", "1", "-o", "jsonl"],
        capsys,
    )
    assert code == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["flash_attn"] for r in recs] == [False]
    assert "engine 'counting' cannot honour flash_attn=1" in err and "skipping 1 test" in err


def test_progress_lines_go_to_stderr_and_stdout_stays_clean(counting, capsys):
    code, out, err = bench(
        [
            "-m",
            counting,
            "-e",
            "counting",
            "-p",
            "4",
            "-n",
            "2",
            "-r",
            "2",
            "--progress",
            "-o",
            "json",
            "-oe",
            "md",
        ],
        capsys,
    )
    assert code == 0
    assert json.loads(out)  # stdout: only the json document
    lines = [line for line in err.splitlines() if line.startswith("infer-bench: benchmark")]
    assert lines[:5] == [
        "infer-bench: benchmark 1/2: starting",
        "infer-bench: benchmark 1/2: warmup prompt run",
        "infer-bench: benchmark 1/2: prompt run 1/2",
        "infer-bench: benchmark 1/2: prompt run 2/2",
        "infer-bench: benchmark 2/2: starting",
    ]
    assert "| model " in err and "build: b4242 (4242)" in err  # -oe md


def test_unknown_engine_and_missing_model_are_clear_errors(counting, capsys):
    code, out, err = bench(["-m", counting, "-e", "countnig", "-p", "4"], capsys)
    assert code == 2 and "unknown engine 'countnig'" in err and "did you mean 'counting'" in err and out == ""
    code, out, err = bench(["-m", "/no/such/model.gguf", "-e", "counting", "-p", "4", "-o", "json"], capsys)
    assert code == 3 and "no such file" in err and out == ""


def test_nothing_to_measure_is_a_usage_error_before_loading(counting, capsys):
    code, out, err = bench(["-m", counting, "-e", "counting", "-p", "0", "-n", "0", "-pg", "0,0"], capsys)
    assert code == 2 and "nothing to measure" in err and "-p, -n or -pg" in err and out == ""
    assert CountingEngine.loads == []


class NoLogitsEngine(CountingEngine):
    name = "nologits"
    capabilities = frozenset({"stream"})


def test_an_engine_that_cannot_decode_is_refused(counting, capsys):
    registry.register("nologits", NoLogitsEngine)
    try:
        code, out, err = bench(["-m", counting, "-e", "counting,nologits", "-p", "4"], capsys)
    finally:
        registry.unregister("nologits")
    assert (
        code == 2 and "engine nologits cannot decode in-process" in err and "server mode" in err and out == ""
    )


def test_compare_plot_without_matplotlib_is_a_usage_error_before_the_table(tmp_path):
    import os
    import subprocess
    import sys

    base, cand = tmp_path / "base.jsonl", tmp_path / "cand.jsonl"
    base.write_text(json.dumps(fixed_record(engine="llamacpp")) + "\n")
    cand.write_text(json.dumps(fixed_record()) + "\n")
    code = (
        "import sys\nsys.modules['matplotlib'] = None  # as if matplotlib were not installed\n"
        "from stdengine.cli.bench import main\nmain()\n"
    )
    argv = ["compare", str(base), str(cand), "--plot", str(tmp_path / "cmp.png")]
    r = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=dict(os.environ)
    )
    assert r.returncode == 2, r.stderr  # spec/errors.md's usage status
    assert r.stdout == ""  # no table first
    assert "error: --plot needs matplotlib" in r.stderr
    assert "hint: pip install 'stdengine[plot]'" in r.stderr
    assert not (tmp_path / "cmp.png").exists()
    # without --plot the same files compare
    r = subprocess.run([sys.executable, "-c", code, *argv[:3]], capture_output=True, text=True)
    assert r.returncode == 0 and "speedup" in r.stdout, r.stderr


def test_sample_speed_times_every_sampler(tmp_path, capsys):
    """bench/sample_speed.py runs on any GGUF file and prints a positive time for each sampler."""
    from stdengine.bench import sample_speed

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, tokens=["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(200)], seed=1)
    assert sample_speed.main(["--models", str(path), "--samples", "5", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if str(path) in line]
    assert len(rows) == len(sample_speed.SAMPLERS)
    assert all(float(r.rstrip(" |").rsplit("|", 1)[1]) > 0 for r in rows)


# ---- the load sweep's rounds (bench/load_sweep.py): ratios within each round, from made-up runs


def _sweep_run(rnd: int, c: int, tps: float, itl_p99: float, server: str = "after") -> dict[str, Any]:
    return {
        "round": rnd,
        "model_alias": "m",
        "server": server,
        "concurrency": c,
        "requests": 4 * c,
        "output_throughput": tps,
        "ttft_ms": {"median": 10.0, "p99": 20.0},
        "itl_ms": {"median": 5.0, "p99": itl_p99},
        "tokens_per_cpu_s": 1.0,
        "total_output_tokens": 100 * c,
        "client_cpu_s": 0.01 * c,  # 0.1 ms a token
        "errors": 0,
    }


def test_load_sweep_rounds_give_each_rounds_ratio_to_the_lowest_concurrency():
    from stdengine.bench.load_sweep import ratio_lines, render

    runs = [
        _sweep_run(1, 1, 100.0, 10.0),
        _sweep_run(1, 8, 400.0, 20.0),
        _sweep_run(2, 1, 50.0, 10.0),  # a slow round: its ratio is its own
        _sweep_run(2, 8, 250.0, 15.0),
        _sweep_run(3, 1, 80.0, 8.0),
        _sweep_run(3, 8, 360.0, 24.0),
    ]
    lines = ratio_lines(runs)
    assert lines[2] == "| m | after | 8 / 1 | 4.00, 5.00, 4.50 | 4.50x | 2.00, 1.50, 3.00 | 2.00x |"
    assert len(lines) == 3
    text = render(runs, "cmd", "")
    assert "| 2 | m | after | 8 | 32 | 250.0 |" in text and "| 1.0 | 0.100 | 0 |" in text
    assert lines[2] in text
    # one round: no ratio table; a round cut short (no concurrency 8) is left out of the medians
    assert ratio_lines(runs[:2]) == []
    assert ratio_lines(runs[:5])[2] == "| m | after | 8 / 1 | 4.00, 5.00 | 4.50x | 2.00, 1.50 | 1.75x |"


def test_load_sweep_records_the_checkout_each_server_imports(tmp_path):
    """A server given another checkout on its PYTHONPATH runs that checkout's stdengine: the
    results name its commit, not the sweep's."""
    import subprocess

    from stdengine.bench.load_sweep import render, server_code

    other = tmp_path / "other"
    (other / "stdengine").mkdir(parents=True)
    (other / "stdengine" / "__init__.py").write_text("")
    git = ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "old"], check=True)
    commit = subprocess.run(
        [*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    env = dict(os.environ, PYTHONPATH=str(other))
    assert server_code("infer", [], env, str(other)) == f"stdengine {commit} ({other})"
    (other / "stdengine" / "__init__.py").write_text("x = 1\n")
    assert (
        server_code("infer", [], env, str(other)) == f"stdengine {commit} with uncommitted changes ({other})"
    )
    run = dict(_sweep_run(1, 1, 100.0, 10.0, server="before"), server_code=f"stdengine {commit} ({other})")
    assert f"- server before ran: stdengine {commit} ({other})" in render([run], "cmd", "")


def test_load_sweep_refuses_zero_rounds(capsys):
    from stdengine.bench.load_sweep import main

    with pytest.raises(SystemExit) as e:
        main(["-m", "x", "--server", "a=infer", "--rounds", "0"])
    assert e.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1,x", "0", "8,-1", ""])
def test_load_sweep_refuses_a_concurrency_that_is_not_positive_numbers(capsys, value):
    from stdengine.bench.load_sweep import main

    with pytest.raises(SystemExit) as e:
        main(["-m", "x", "--server", "a=infer", "--concurrency", value])
    assert e.value.code == 2
    assert "give positive whole numbers separated by commas" in capsys.readouterr().err
