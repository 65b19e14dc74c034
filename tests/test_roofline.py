"""The roofline (stdengine.bench.roofline) and the machine probe (record.machine_probe).

The costs are checked against figures worked out by hand from the models' shapes and ggml's block
sizes (q8_0: 34 bytes per 32 elements, f16 2 bytes, f32 4), not against the module's output.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from gguf_factory import write_llama_gguf
from stdengine.bench import roofline
from stdengine.bench.record import MachineProbe, cache_sizes, machine_probe, probe_buffers

from stdengine.gguf_file import GGUFHeader, TensorInfo, ggml_type

# A llama of 2 layers: n_embd 64, 4 heads of 16, 2 kv heads, n_ff 128, 64 tokens, q8_0 weights.
# Per layer the matmul weights are q 64x64 + k 32x64 + v 32x64 + o 64x64 + gate, up, down 128x64
# = 4096 + 2048 + 2048 + 4096 + 3 * 8192 = 36864 elements; the head 64x64 = 4096.
LAYER_ELEMENTS = 36864
HEAD_ELEMENTS = 4096
Q8_0 = 34 / 32  # bytes per element
KV_PER_POS_F16 = 2 * (32 + 32) * 2  # 2 layers x (32 key + 32 value elements) x 2 bytes = 256


def _tensor(name: str, shape: tuple[int, ...], type_name: str) -> TensorInfo:
    t = ggml_type(type_name)
    n = math.prod(shape)
    return TensorInfo(name, shape, t.id, t.name, 0, n, n // t.block * t.size)


def _header(arch: str, md: dict, tensors: list[TensorInfo]) -> GGUFHeader:
    return GGUFHeader(Path("x.gguf"), 0, 3, "<", 32, 0, {"general.architecture": arch, **md}, tensors)


def test_bytes_and_macs_per_token_of_a_written_model(tmp_path):
    """A q8_0 model written with its own output head: weights of 2 layers + the head per generated
    token, plus the KV cache each token reads; the layers' elements per prompt token."""
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weight_type="q8_0", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    cost = roofline.model_cost(path)
    assert cost.layer_weight_bytes == 2 * LAYER_ELEMENTS * Q8_0 == 78336
    assert cost.head_bytes == HEAD_ELEMENTS * Q8_0 == 4352  # output.weight, not token_embd
    assert cost.layer_macs == 2 * LAYER_ELEMENTS and cost.head_macs == HEAD_ELEMENTS
    # tg4 at depth 0: the tokens attend to 1, 2, 3, 4 positions: 2.5 on average
    assert roofline.tg_bytes_per_token(cost, 4, 0) == 78336 + 4352 + 2.5 * KV_PER_POS_F16
    # at depth 10 in an f32 cache: 11..14 positions, 12.5 on average, 4 bytes an element
    assert roofline.tg_bytes_per_token(cost, 4, 10, "f32", "f32") == 78336 + 4352 + 12.5 * 2 * KV_PER_POS_F16
    # q8_0 keys: 34 bytes per 32 elements
    kv = 2 * (32 * Q8_0 + 32 * 2)
    assert roofline.tg_bytes_per_token(cost, 1, 0, "q8_0", "f16") == pytest.approx(78336 + 4352 + kv)
    # pp512 in one decode call: the head once for 512 tokens; with n_batch 128, four times
    assert roofline.pp_macs_per_token(cost, 512, 2048) == 2 * LAYER_ELEMENTS + HEAD_ELEMENTS / 512
    assert roofline.pp_macs_per_token(cost, 512, 128) == 2 * LAYER_ELEMENTS + 4 * HEAD_ELEMENTS / 512


def test_a_tied_head_is_the_token_embedding_and_norms_are_not_matmuls():
    md = {"llama.block_count": 1, "llama.embedding_length": 64, "llama.attention.head_count": 4}
    tensors = [
        _tensor("token_embd.weight", (64, 100), "q4_0"),  # 100 tokens: 6400 elements, 18 bytes / 32
        _tensor("blk.0.attn_norm.weight", (64,), "f32"),
        _tensor("blk.0.attn_q.weight", (64, 64), "q4_0"),
        _tensor("output_norm.weight", (64,), "f32"),
    ]
    cost = roofline.cost_of(_header("llama", md, tensors))
    assert cost.head_bytes == 6400 // 32 * 18 and cost.head_macs == 6400
    assert cost.layer_weight_bytes == 4096 // 32 * 18 and cost.layer_macs == 4096
    # no head_count_kv: every head has its keys and values, 4 x 16 each
    assert cost.kv == (roofline.LayerKV(64, 64, 0),)


def test_gemma3_sliding_window_layers_stop_at_their_window():
    """Every 3rd layer global (pattern 3), the others see 2 positions; one layer's KV per
    position is 1 kv head x (8 + 8) elements = 32 bytes in f16."""
    md = {
        "gemma3.block_count": 6,
        "gemma3.embedding_length": 32,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.sliding_window": 2,
        "gemma3.attention.sliding_window_pattern": 3,
    }
    cost = roofline.cost_of(_header("gemma3", md, []))
    assert [layer.window for layer in cost.kv] == [2, 2, 0, 2, 2, 0]
    # 5 positions: 4 local layers read 2, 2 global ones read 5
    assert roofline.kv_bytes_read(cost, 5, "f16", "f16") == (4 * 2 + 2 * 5) * 32
    assert roofline.kv_bytes_read(cost, 1, "f16", "f16") == 6 * 32
    # the default pattern is 6 (llama.cpp's)
    del md["gemma3.attention.sliding_window_pattern"]
    assert [layer.window for layer in roofline.cost_of(_header("gemma3", md, [])).kv] == [2, 2, 2, 2, 2, 0]


def _probe(l3_bytes: int = 1 << 20) -> MachineProbe:
    return MachineProbe(
        isa="avx512",
        cache_bytes={2: 1 << 19, 3: l3_bytes},
        buffer_bytes={"dram": 256 << 20, "l3": l3_bytes // 2},
        read_gbs={"dram": {1: 10.0, 2: 16.0}, "l3": {1: 50.0, 2: 90.0}},
        int8_gmacs={1: 100.0, 2: 200.0},
    )


def _record(
    engine: str, n_prompt: int, n_gen: int, depth: int = 0, threads: int = 2, ts: float = 1.0
) -> dict:
    return {
        "engine": engine,
        "model_type": "llama ?B Q8_0",
        "n_threads": threads,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": depth,
        "n_batch": 2048,
        "type_k": "f16",
        "type_v": "f16",
        "avg_ts": ts,
    }


def test_bounds_of_tg_and_pp_tests(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weight_type="q8_0", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    cost = roofline.model_cost(path)
    weights = 78336 + 4352
    # tg4 at 2 threads, model larger than the L3: DRAM's 16 GB/s over the bytes per token
    b = roofline.bound(_record("llamacpp", 0, 4), cost, _probe(l3_bytes=1 << 16))
    assert b is not None and b.resource == "DRAM" and b.machine == 16.0
    assert b.per_token == weights + 2.5 * KV_PER_POS_F16
    assert b.limit_ts == pytest.approx(16e9 / (weights + 640))
    assert b.reached(b.limit_ts / 4) == pytest.approx(0.25)
    assert b.achieved(1000.0) == pytest.approx(1000 * (weights + 640) / 1e9)
    # the cache's element size is the record's (here f32); the model fits a 1 MiB L3
    b = roofline.bound(
        {**_record("reference", 0, 4, threads=1), "type_k": "f32", "type_v": "f32"}, cost, _probe()
    )
    assert b is not None and b.resource == "L3" and b.machine == 50.0
    assert b.per_token == weights + 2.5 * 2 * KV_PER_POS_F16
    # pp512 at 1 thread: 100 GMAC/s over the layers' MACs and a 512th of the head's
    b = roofline.bound(_record("reference", 512, 0, threads=1), cost, _probe())
    assert b is not None and b.resource == "int8"
    assert b.limit_ts == pytest.approx(100e9 / (2 * LAYER_ELEMENTS + HEAD_ELEMENTS / 512))
    # pp+tg has no single limit; a thread count the probe did not measure has none
    assert roofline.bound(_record("reference", 512, 128), cost, _probe()) is None
    assert roofline.bound(_record("reference", 512, 0, threads=4), cost, _probe()) is None
    # a build on AMX tiles: the tiles' rate bounds its pp tests (none when it was not probed),
    # a build on vectors keeps the vector rate; tg tests (memory-bound) are the same for both
    tiles = dataclasses.replace(_probe(), amx_gmacs={1: 1000.0})
    vector = dict(_record("llamacpp", 512, 0, threads=1), engine_build="CPU AVX512=1 AMX_INT8=0")
    assert roofline.bound(vector, cost, tiles).machine == 100.0
    for engine, build in (("reference", "isa=amx"), ("llamacpp", "CPU AVX512=1 AMX_INT8=1")):
        on_tiles = dict(_record(engine, 512, 0, threads=1), engine_build=build)
        b = roofline.bound(on_tiles, cost, tiles)
        assert b is not None and b.resource == "AMX int8" and b.machine == 1000.0
        assert roofline.bound(on_tiles, cost, _probe()) is None
        assert roofline.bound(dict(_record(engine, 0, 4), engine_build=build), cost, tiles).kind == "tg"


def test_the_report_table_has_both_engines_limits_and_fractions(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weight_type="q8_0", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    cost = roofline.model_cost(path)
    limit = 200e9 / (2 * LAYER_ELEMENTS + HEAD_ELEMENTS / 512)
    pairs = [
        (_record("llamacpp", 512, 0, ts=limit / 4), _record("reference", 512, 0, ts=limit / 2)),
        (_record("llamacpp", 512, 128), _record("reference", 512, 128)),  # no row: pp+tg
    ]
    text = roofline.render(pairs, _probe(), cost_of_record=lambda r: cost)
    lines = text.splitlines()
    assert len(lines) == 3  # header, separator, one row
    assert "llamacpp t/s" in lines[0] and "reference t/s" in lines[0] and "reached" in lines[0]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:4] == ["llama ?B Q8_0", "2", "pp512", "int8 200 GMAC/s"]
    assert cells[4:10] == [
        f"{limit / 4:.1f}",
        "0.1 M MACs",
        f"{limit:.1f}",
        "25%",
        "50 GMAC/s",
        f"{limit / 2:.1f}",
    ]
    assert cells[11:] == [f"{limit:.1f}", "50%", "100 GMAC/s"]


def test_probe_buffers_follow_the_caches():
    mib = 1 << 20
    assert probe_buffers({2: mib, 3: 32 * mib}) == {"dram": 128 * mib * 2, "l3": 16 * mib, "l2": mib // 2}
    assert probe_buffers({2: 2 * mib, 3: 300 * mib})["dram"] == 1 << 30  # at most 1 GiB
    assert probe_buffers({}) == {"dram": 512 * mib}  # no cache known: DRAM only


def test_machine_probe_measures_every_level_and_thread_count():
    """The C probe runs (figures positive; no figure is asserted: it depends on the machine) and
    measures the int8 path the kernels use."""
    from stdengine.reference.core import isa_name

    probe = machine_probe((1,))
    levels = {"dram"} | {name for level, name in ((3, "l3"), (2, "l2")) if level in cache_sizes()}
    assert set(probe.read_gbs) == levels
    assert all(figures[1] > 0 for figures in probe.read_gbs.values())
    assert probe.isa == isa_name()
    assert probe.int8_gmacs[1] > 0 if probe.isa != "scalar" else probe.int8_gmacs[1] == 0
    assert any("int8 multiply-accumulate" in line for line in probe.lines())
    # the tiles' figure only on the amx path (where the kernels multiply on them)
    assert (probe.amx_gmacs[1] > 0) if probe.isa == "amx" else probe.amx_gmacs == {}
    assert any("(amx tiles)" in line for line in probe.lines()) == (probe.isa == "amx")
