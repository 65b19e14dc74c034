"""The roofline: the speed this machine allows a benchmark test, and the fraction of it reached.

    python -m stdengine.bench.roofline [--threads 1,2] [--models A,B]

prints the machine probe (stdengine.bench.record.machine_probe) and, per model, what one token
costs. `infer bench vs-llamacpp` prints a roofline table beside its results (render()).

- **Generation (tg)** streams every matmul weight once per token: the layers' and the output
  head's (output.weight, or token_embd.weight when the head is tied to it; the embedding row
  lookup is not counted), as stored in the file; and it reads the KV cache of every layer up to
  its position: token i (from 0) of a tg test at depth d attends to d + i + 1 positions, or the
  layer's sliding window if that is smaller. bytes per token = weights + the KV cache read,
  averaged over the test's tokens; limit = read bandwidth / bytes per token. The bandwidth is the
  probe's DRAM figure at the test's thread count, or its L3 figure when the bytes per token fit
  in the L3 (a small model can stay there from one token to the next).
- **Prompt (pp)** is int8 matrix products: each layer weight element is one multiply-accumulate
  per token; the output head runs once per decode call of n_batch tokens (only the last token's
  logits are asked for), so its MACs are spread over them. Attention is not counted (a float
  product that grows with the depth): the limit is an upper bound. limit = int8 MAC throughput /
  MACs per token: the vector dot products' (AVX-512 VNNI or AVX2), or the AMX tiles' for a build
  that multiplies on them (the reference engine's `isa=amx`, llama.cpp's `AMX_INT8=1`); where
  the tiles' rate was not probed, such a build's pp tests get no limit.

The KV cache's element size is the record's type_k / type_v (the reference engine's records from
before it honoured -ctk/-ctv held an f32 cache whatever they say). Reached = the
measured t/s / the limit; achieved = t/s x bytes (GB/s) or x MACs (GMAC/s) per token.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stdengine.bench.printers import md_table, test_name
from stdengine.bench.record import MachineProbe

from stdengine.gguf_file import GGUFHeader, ggml_type, scan_gguf


@dataclass(frozen=True)
class LayerKV:
    """What one layer's KV cache holds per position, in elements, and its sliding window (0: none)."""

    k: int
    v: int
    window: int


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model, from its GGUF header."""

    layer_weight_bytes: int  # the layers' matmul weights as stored
    layer_macs: int  # their elements: one multiply-accumulate each per token
    head_bytes: int  # the output head (output.weight, or token_embd.weight when tied)
    head_macs: int
    kv: tuple[LayerKV, ...]

    @property
    def weight_bytes(self) -> int:
        return self.layer_weight_bytes + self.head_bytes


def _meta_int(md: dict[str, Any], key: str, default: int = 0) -> int:
    value = md.get(key)
    return int(value) if isinstance(value, int) else default


def windows(md: dict[str, Any], n_layer: int) -> list[int]:
    """Each layer's sliding window (0: full attention). gemma3: every `sliding_window_pattern`-th
    layer (default 6) is global, the others see `sliding_window` positions, as llama.cpp and the
    reference engine (reference_engine/model.py) decide; other architectures: none."""
    if md.get("general.architecture") != "gemma3":
        return [0] * n_layer
    window = _meta_int(md, "gemma3.attention.sliding_window")
    pattern = _meta_int(md, "gemma3.attention.sliding_window_pattern", 6) or 6
    return [window if window > 0 and il % pattern < pattern - 1 else 0 for il in range(n_layer)]


def cost_of(header: GGUFHeader) -> ModelCost:
    """The cost of a token of a model: its matmul weights (the 2-D tensors of blk.*, and the head)
    and the KV cache layout from its hyperparameters."""
    md = header.metadata
    arch = md.get("general.architecture")
    tensors = {t.name: t for t in header.tensors}
    layer = [t for t in header.tensors if t.name.startswith("blk.") and len(t.shape) >= 2 and t.shape[1] > 1]
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    n_layer = _meta_int(md, f"{arch}.block_count")
    n_embd = _meta_int(md, f"{arch}.embedding_length")
    n_head = _meta_int(md, f"{arch}.attention.head_count")
    n_head_kv = _meta_int(md, f"{arch}.attention.head_count_kv", n_head)
    head_dim = n_embd // n_head if n_head else 0
    k = n_head_kv * _meta_int(md, f"{arch}.attention.key_length", head_dim)
    v = n_head_kv * _meta_int(md, f"{arch}.attention.value_length", head_dim)
    return ModelCost(
        layer_weight_bytes=sum(t.n_bytes for t in layer),
        layer_macs=sum(t.n_elements for t in layer),
        head_bytes=head.n_bytes if head else 0,
        head_macs=head.n_elements if head else 0,
        kv=tuple(LayerKV(k, v, w) for w in windows(md, n_layer)),
    )


_COSTS: dict[str, ModelCost] = {}


def model_cost(path: str | Path) -> ModelCost:
    key = str(path)
    if key not in _COSTS:
        _COSTS[key] = cost_of(scan_gguf(path))
    return _COSTS[key]


def element_bytes(type_name: str) -> float:
    """Bytes per element of a cache type (a quantized one: its block's bytes / its elements)."""
    t = ggml_type(type_name)
    return t.size / t.block


def kv_bytes_read(cost: ModelCost, n_pos: int, type_k: str, type_v: str) -> float:
    """Bytes of KV cache one token reads when it attends to n_pos positions (windows applied)."""
    kb, vb = element_bytes(type_k), element_bytes(type_v)
    return sum(min(n_pos, layer.window or n_pos) * (layer.k * kb + layer.v * vb) for layer in cost.kv)


def tg_bytes_per_token(
    cost: ModelCost, n_gen: int, n_depth: int, type_k: str = "f16", type_v: str = "f16"
) -> float:
    """Bytes read per generated token, the mean over the n_gen tokens of a test at depth n_depth."""
    kv = sum(kv_bytes_read(cost, n_depth + i + 1, type_k, type_v) for i in range(n_gen)) / n_gen
    return cost.weight_bytes + kv


def pp_macs_per_token(cost: ModelCost, n_prompt: int, n_batch: int) -> float:
    """int8 multiply-accumulates per prompt token: the layers' weights, plus the head once per
    decode call of n_batch tokens."""
    calls = math.ceil(n_prompt / max(1, n_batch))
    return cost.layer_macs + cost.head_macs * calls / n_prompt


@dataclass(frozen=True)
class Bound:
    """A test's limit on this machine: `per_token` bytes (tg) or MACs (pp) per token, the
    machine's figure for it (`machine`: GB/s or GMAC/s, named by `resource`) and limit_ts."""

    kind: str  # "tg" or "pp"
    per_token: float
    resource: str  # "DRAM", "L3", "int8" (vectors) or "AMX int8" (tiles)
    machine: float

    @property
    def limit_ts(self) -> float:
        return self.machine * 1e9 / self.per_token if self.per_token > 0 else math.inf

    def reached(self, ts: float) -> float:
        return ts / self.limit_ts if self.limit_ts > 0 else math.nan

    def achieved(self, ts: float) -> float:
        """GB/s (tg) or GMAC/s (pp) at ts tokens per second."""
        return ts * self.per_token / 1e9


def _on_amx_tiles(record: dict[str, Any]) -> bool:
    build = str(record.get("engine_build", ""))
    return "isa=amx" in build or "AMX_INT8=1" in build


def bound(record: dict[str, Any], cost: ModelCost, probe: MachineProbe) -> Bound | None:
    """The limit of one benchmark record's test; None for pp+tg tests, thread counts the probe
    did not measure and pp tests on AMX tiles when it did not measure them."""
    threads = int(record["n_threads"])
    n_prompt, n_gen, depth = (int(record[f]) for f in ("n_prompt", "n_gen", "n_depth"))
    if n_gen > 0 and n_prompt == 0:
        per_token = tg_bytes_per_token(
            cost, n_gen, depth, record.get("type_k", "f16"), record.get("type_v", "f16")
        )
        l3 = probe.read_gbs.get("l3", {}).get(threads)
        fits = l3 is not None and per_token <= probe.cache_bytes.get(3, 0)
        dram = probe.read_gbs["dram"].get(threads)
        if fits and l3 is not None:
            return Bound("tg", per_token, "L3", l3)
        return Bound("tg", per_token, "DRAM", dram) if dram else None
    if n_prompt > 0 and n_gen == 0:
        tiles = _on_amx_tiles(record)
        macs = (probe.amx_gmacs if tiles else probe.int8_gmacs).get(threads)
        per_token = pp_macs_per_token(cost, n_prompt, int(record.get("n_batch", 2048)))
        return Bound("pp", per_token, "AMX int8" if tiles else "int8", macs) if macs else None
    return None


# --- the report --------------------------------------------------------------------------------


def _per_token(b: Bound) -> str:
    return f"{b.per_token / 1e6:.1f} MB" if b.kind == "tg" else f"{b.per_token / 1e6:.1f} M MACs"


def _machine(b: Bound) -> str:
    return f"{b.resource} {b.machine:.1f} GB/s" if b.kind == "tg" else f"{b.resource} {b.machine:.0f} GMAC/s"


def _achieved(b: Bound, ts: float) -> str:
    return f"{b.achieved(ts):.1f} GB/s" if b.kind == "tg" else f"{b.achieved(ts):.0f} GMAC/s"


def render(
    pairs: list[tuple[dict[str, Any], dict[str, Any]]],
    probe: MachineProbe,
    cost_of_record: Callable[[dict[str, Any]], ModelCost] | None = None,
) -> str:
    """The roofline table of (base, candidate) record pairs of the same test: per engine its t/s,
    the limit, the fraction reached, the work per token and the GB/s or GMAC/s achieved.
    cost_of_record(record) -> ModelCost (default: model_cost of its model_filename)."""
    cost_for = cost_of_record or (lambda r: model_cost(r["model_filename"]))
    header = ["model", "threads", "test", "machine"]
    engines = [pairs[0][0]["engine"], pairs[0][1]["engine"]] if pairs else []
    for name in engines:
        header += [f"{name} t/s", "per token", "limit t/s", "reached", "achieved"]
    rows = []
    for pair in pairs:
        maybe = [bound(r, cost_for(r), probe) for r in pair]
        bounds = [b for b in maybe if b is not None]
        if len(bounds) < len(maybe):
            continue
        base = pair[0]
        row = [
            base["model_type"],
            str(base["n_threads"]),
            test_name(base["n_prompt"], base["n_gen"], base["n_depth"]),
            " / ".join(dict.fromkeys(_machine(b) for b in bounds)),  # both, if the engines' differ
        ]
        for r, b in zip(pair, bounds, strict=True):
            ts = float(r["avg_ts"])
            row += [
                f"{ts:.1f}",
                _per_token(b),
                f"{b.limit_ts:.1f}",
                f"{100 * b.reached(ts):.0f}%",
                _achieved(b, ts),
            ]
        rows.append(row)
    return md_table(header, rows, left=(0, 3))


def describe_cost(cost: ModelCost) -> str:
    """One line: the bytes a generated token reads and the MACs a prompt token does."""
    per_pos = {name: kv_bytes_read(cost, 1, name, name) for name in ("f16", "f32")}
    return (
        f"matmul weights {cost.weight_bytes / 1e6:.1f} MB per generated token "
        f"(output head {cost.head_bytes / 1e6:.1f} MB), plus the KV cache read: "
        f"{per_pos['f16'] / 1e3:.1f} kB per position in f16, {per_pos['f32'] / 1e3:.1f} kB in f32 "
        f"(full-attention layers; sliding-window layers stop at their window); "
        f"{cost.layer_macs / 1e6:.1f} M int8 MACs per prompt token (+ the head's "
        f"{cost.head_macs / 1e6:.1f} M once per decode call)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stdengine.bench.roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--threads", default="1,2", help="thread counts to probe (default 1,2)")
    ap.add_argument("--models", default="", help="catalogue aliases or GGUF paths, comma-separated")
    args = ap.parse_args(argv)
    from stdengine.bench.record import machine_probe

    probe = machine_probe(tuple(int(t) for t in args.threads.split(",") if t))
    for line in probe.lines():
        print(f"- {line}")
    for model in filter(None, args.models.split(",")):
        from stdengine.store import resolve_model

        path = resolve_model(model)
        print(f"- {model}: {describe_cost(model_cost(path))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
