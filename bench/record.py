"""The benchmark record: llama-bench's 38 fields in its order and value formats, then stdengine's.

spec/bench-record.md is the prose. A record is a dict of field -> Python value (str, int, bool,
float) plus `samples_ns`; `values()` gives llama-bench's value strings (std::to_string: bools
0/1, doubles %f) that every printer starts from.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# llama-bench's test::get_fields() (late-2025 llama-bench), with test::get_field_type().
LLAMA_BENCH_FIELDS: list[tuple[str, str]] = [
    ("build_commit", "S"),
    ("build_number", "I"),
    ("cpu_info", "S"),
    ("gpu_info", "S"),
    ("backends", "S"),
    ("model_filename", "S"),
    ("model_type", "S"),
    ("model_size", "I"),
    ("model_n_params", "I"),
    ("n_batch", "I"),
    ("n_ubatch", "I"),
    ("n_threads", "I"),
    ("cpu_mask", "S"),
    ("cpu_strict", "B"),
    ("poll", "I"),
    ("type_k", "S"),
    ("type_v", "S"),
    ("n_gpu_layers", "I"),
    ("n_cpu_moe", "I"),
    ("split_mode", "S"),
    ("main_gpu", "I"),
    ("no_kv_offload", "B"),
    ("flash_attn", "B"),
    ("devices", "S"),
    ("tensor_split", "S"),
    ("tensor_buft_overrides", "S"),
    ("use_mmap", "B"),
    ("embeddings", "B"),
    ("no_op_offload", "I"),
    ("no_host", "B"),
    ("n_prompt", "I"),
    ("n_gen", "I"),
    ("n_depth", "I"),
    ("test_time", "S"),
    ("avg_ns", "I"),
    ("stddev_ns", "I"),
    ("avg_ts", "F"),
    ("stddev_ts", "F"),
]

# stdengine's fields, after llama-bench's.
STDENGINE_FIELDS: list[tuple[str, str]] = [
    ("engine", "S"),
    ("engine_version", "S"),
    ("engine_build", "S"),
    ("n_ctx", "I"),
    ("recipe", "S"),
    ("engine_args", "S"),  # -E key=value,... ("" when none)
    ("gen_sampled", "B"),  # --sample-gen: tg tokens sampled by the engine's sampler
]

FIELDS: list[tuple[str, str]] = LLAMA_BENCH_FIELDS + STDENGINE_FIELDS
FIELD_NAMES: list[str] = [name for name, _ in FIELDS]
FIELD_TYPES: dict[str, str] = dict(FIELDS)

# The values of llama-bench fields that infer-bench has no flag for (llama-bench's defaults).
FIXED: dict[str, Any] = {
    "cpu_mask": "0x0",
    "cpu_strict": False,
    "poll": 50,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": False,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "embeddings": False,
    "no_op_offload": 0,
    "no_host": False,
}


def field_type(name: str) -> str:
    """S, I, B or F; like llama-bench, a name it does not know is a string."""
    return FIELD_TYPES.get(name, "S")


def value_string(name: str, value: Any) -> str:
    """One value as llama-bench writes it (std::to_string): 0/1, integers, %f, or the string."""
    kind = field_type(name)
    if kind == "B":
        return "1" if value else "0"
    if kind == "I":
        return str(int(value))
    if kind == "F":
        return f"{float(value):f}"
    return "" if value is None else str(value)


# Server mode (spec/bench-record.md): the same record, then what a request-level measurement adds.
SERVER_FIELDS: list[tuple[str, str]] = [
    ("url", "S"),
    ("latency_ms", "F"),
    ("ttfr_ms", "F"),
    ("est_ppt_ms", "F"),
    ("e2e_ttft_ms", "F"),
    ("n_prompt_sent", "I"),
]
FIELD_TYPES.update(dict(SERVER_FIELDS))


def values(record: dict[str, Any], names: list[str] | None = None) -> list[str]:
    return [value_string(name, record.get(name)) for name in (names or FIELD_NAMES)]


def record_fields(record: dict[str, Any]) -> list[str]:
    """The fields a record is printed with: a server-mode record has the server fields too."""
    if "ttfr_ms" in record:
        return FIELD_NAMES + [name for name, _ in SERVER_FIELDS]
    return FIELD_NAMES


def samples_ts(record: dict[str, Any]) -> list[float]:
    """ts_i = 1e9 * (n_prompt + n_gen) / ns_i for each repetition."""
    n = record["n_prompt"] + record["n_gen"]
    return [1e9 * n / ns for ns in record["samples_ns"]]


def finish(record: dict[str, Any], samples_ns: list[int]) -> dict[str, Any]:
    """Fill the timing fields from the samples: avg_ts is the mean of the per-repetition rates;
    the standard deviations use n - 1 (0 for one repetition); the ns figures are truncated."""
    record["samples_ns"] = list(samples_ns)
    ts = samples_ts(record)
    record["avg_ns"] = sum(samples_ns) // len(samples_ns)
    record["stddev_ns"] = int(statistics.stdev(samples_ns)) if len(samples_ns) > 1 else 0
    record["avg_ts"] = statistics.fmean(ts)
    record["stddev_ts"] = statistics.stdev(ts) if len(ts) > 1 else 0.0
    return record


def utc_now() -> str:
    """test_time: UTC, %FT%TZ."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- machine and build --------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cpu_info() -> str:
    """The CPU's `model name` from /proc/cpuinfo (what ggml's CPU device reports on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def stdengine_commit() -> str:
    """The short git commit of the stdengine checkout this runs from, or "unknown"."""
    return git_commit(Path(__file__).resolve().parent.parent)


def git_commit(root: Path) -> str:
    """The short git commit of the checkout at root, or "unknown"."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else "unknown"


# --- the machine probe (spec/bench-record.md, "The machine probe") -------------------------

PROBE_READ_BYTES = 256 << 20  # every cache-resident figure reads this much per repetition
PROBE_DRAM_BYTES = (256 << 20, 1 << 30)  # the DRAM buffer: 4x the L3, within these bounds
PROBE_MAC_ITERS = 1 << 21  # trips of the int8 loop per thread (12 or 6 instructions each)
PROBE_AMX_ITERS = 1 << 18  # rounds of the AMX loop per thread (four tile products each)
PROBE_REPS = 5


def cache_sizes(cpu: int = 0) -> dict[int, int]:
    """The bytes of each data (or unified) cache level of a CPU, as Linux's sysfs reports them:
    {1: 32768, 2: 1048576, 3: 33554432}; empty where sysfs does not say."""
    sizes: dict[int, int] = {}
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/cache")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in sorted(base.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        sizes[level] = max(size, sizes.get(level, 0))
    return sizes


@dataclass(frozen=True)
class MachineProbe:
    """What the C probe (reference_engine/csrc/probe.c) measured: read bandwidth in GB/s (1e9
    bytes per second) per memory level and thread count, and int8 multiply-accumulates per second
    (billions, all threads) of the SIMD path `isa` the reference engine's kernels use (on the amx
    path: its AVX-512 vectors in int8_gmacs, its tiles in amx_gmacs)."""

    isa: str
    cache_bytes: dict[int, int]  # level -> bytes (cache_sizes)
    buffer_bytes: dict[str, int]  # level -> the probe's buffer (probe_buffers; L2's is per thread)
    read_gbs: dict[str, dict[int, float]]  # "dram" / "l3" / "l2" -> threads -> GB/s
    int8_gmacs: dict[int, float]  # threads -> GMAC/s (0: the scalar path, which has none)
    amx_gmacs: dict[int, float] = field(default_factory=dict)  # the same on AMX tiles; empty without

    def lines(self) -> list[str]:
        """The description, one line per figure, for a report."""

        def per_thread(values: dict[int, float], unit: str) -> str:
            return ", ".join(
                f"{v:.1f} {unit} with {t} thread{'s' if t > 1 else ''}" for t, v in values.items()
            )

        out = []
        for level, figures in self.read_gbs.items():
            size = f"{_mib_or_kib(self.buffer_bytes[level])} buffer" + (
                " per thread" if level == "l2" else ""
            )
            out.append(f"read bandwidth, {level.upper()} ({size}): {per_thread(figures, 'GB/s')}")
        path = "avx512 vectors" if self.isa == "amx" else self.isa
        out.append(f"int8 multiply-accumulate ({path}): {per_thread(self.int8_gmacs, 'GMAC/s')}")
        if self.amx_gmacs:
            out.append(f"int8 multiply-accumulate (amx tiles): {per_thread(self.amx_gmacs, 'GMAC/s')}")
        caches = ", ".join(
            f"L{level} {_mib_or_kib(size)}" for level, size in sorted(self.cache_bytes.items())
        )
        out.append(f"caches (cpu0, sysfs): {caches or 'unknown'}")
        return out


def _mib_or_kib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def probe_buffers(caches: dict[int, int]) -> dict[str, int]:
    """The probe's buffer per level: DRAM 4x the L3 (256 MiB to 1 GiB; 512 MiB when the L3 is
    unknown), so that almost every read misses it; L3 half of it (the threads share it); L2 half
    of one per thread (the only per-thread size). A cache the CPU does not report is not probed."""
    lo, hi = PROBE_DRAM_BYTES
    out = {"dram": min(max(4 * caches[3], lo), hi) if 3 in caches else 2 * lo}
    if 3 in caches:
        out["l3"] = caches[3] // 2
    if 2 in caches:
        out["l2"] = caches[2] // 2
    return out


@functools.lru_cache(maxsize=4)
def machine_probe(threads: tuple[int, ...] = (1, 2)) -> MachineProbe:
    """Run the probe for each thread count (about a second for two). Needs the reference engine's
    C core; the figures are the best of PROBE_REPS runs each."""
    import ctypes

    from stdengine.reference._lib import lib
    from stdengine.reference.core import isa_name

    c = lib()
    if not all(hasattr(c, f) for f in ("se_probe_read_gbs", "se_probe_amx_gmacs")):
        raise RuntimeError(
            "the reference engine's C core was built before this machine probe: rebuild it "
            "(pip install ., or python setup.py build_ext --inplace in a checkout)"
        )
    c.se_probe_read_gbs.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    c.se_probe_read_gbs.restype = ctypes.c_double
    c.se_probe_int8_gmacs.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32]
    c.se_probe_int8_gmacs.restype = ctypes.c_double
    c.se_probe_amx_gmacs.argtypes = c.se_probe_int8_gmacs.argtypes
    c.se_probe_amx_gmacs.restype = ctypes.c_double
    caches = cache_sizes()
    read: dict[str, dict[int, float]] = {}
    buffers = probe_buffers(caches)
    isa = isa_name()
    macs: dict[int, float] = {}
    amx: dict[int, float] = {}
    for t in threads:
        for level, size in buffers.items():
            total = size * t if level == "l2" else size
            passes = max(1, PROBE_READ_BYTES // total)
            gbs = float(c.se_probe_read_gbs(total, t, passes, PROBE_REPS))
            if gbs < 0:
                raise MemoryError(f"the machine probe could not allocate {total} bytes or start {t} threads")
            read.setdefault(level, {})[t] = gbs
        macs[t] = float(c.se_probe_int8_gmacs(t, PROBE_MAC_ITERS, PROBE_REPS))
        if isa == "amx":
            amx[t] = float(c.se_probe_amx_gmacs(t, PROBE_AMX_ITERS, PROBE_REPS))
    return MachineProbe(isa, caches, buffers, read, macs, amx)


def build_of(engine_name: str, build: str, version: str) -> tuple[str, int]:
    """build_commit and build_number: the engine's build. For the reference engine, stdengine's git
    commit (number 0); for others, the first `;`-separated part of the build string the engine
    reports (a `b1234` tag gives the number), else its version."""
    if engine_name == "reference":
        return stdengine_commit(), 0
    text = (build or version or "unknown").split(";")[0].strip() or "unknown"  # its first part: no flag lists
    number = int(text[1:]) if text[:1] == "b" and text[1:].isdigit() else 0
    return text, number


# --- the model -----------------------------------------------------------------------------


def size_label(
    arch: str | None, n_layer: int | None, n_vocab: int | None, n_head: int | None, n_head_kv: int | None
) -> str:
    """llama.cpp's model type name (llm_type_name of the type chosen from the hyperparameters in
    load_hparams) for the architectures stdengine knows; `?B` (LLM_TYPE_UNKNOWN) otherwise.

    llama.cpp picks the type from n_layer, not from the parameter count, so SmolLM2-135M (llama,
    30 layers) is `256M`, the label of SmolDocling-256M that shares its depth."""
    if arch == "llama":
        table = {
            16: "1B",
            22: "1B",
            26: "3B",
            28: "3B",
            30: "256M",
            36: "8B",
            40: "13B",
            48: "34B",
            60: "30B",
        }
        if n_layer == 32:
            return "3B" if n_vocab == 49152 else ("7B" if (n_vocab or 0) < 40000 else "8B")
        if n_layer == 80:
            return "65B" if n_head == n_head_kv else "70B"
        return table.get(n_layer or 0, "?B")
    if arch == "gemma3":
        return {18: "270M", 26: "1B", 34: "4B", 48: "12B", 62: "27B"}.get(n_layer or 0, "?B")
    return "?B"


@functools.lru_cache(maxsize=16)
def model_fields(path: str) -> dict[str, Any]:
    """model_type, model_size (bytes of every tensor) and model_n_params (elements of every tensor)
    of a GGUF file, as llama-bench reports them; n_vocab for the random tokens."""
    from stdengine.modelinfo import model_info

    info = model_info(path)
    label = size_label(info.architecture, info.n_layer, info.n_vocab, info.n_head, info.n_head_kv)
    return {
        "model_type": f"{info.architecture or 'unknown'} {label} {info.file_type_name or 'unknown, may not work'}",
        "model_size": info.memory.weights_bytes,
        "model_n_params": info.n_params,
        "n_vocab": info.n_vocab,
    }
