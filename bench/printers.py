"""llama-bench's printers: md, csv, json, jsonl and sql, byte for byte for the shared fields.

A printer writes a header, one block per record as soon as the record exists (so `-o jsonl` can
be followed live), and a footer. The md table has stdengine's `engine` column after `backend`.
"""

from __future__ import annotations

from typing import IO, Any

from stdengine.bench.params import DEFAULTS, BenchParams
from stdengine.bench.record import FIELD_NAMES, field_type, record_fields, samples_ts, values


def format_g(x: float) -> str:
    """C++ ostream's default formatting of a double (6 significant digits, like %g)."""
    return f"{x:g}"


def escape_json(text: str) -> str:
    out = []
    for c in text:
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif ord(c) <= 0x1F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def json_value(name: str, text: str) -> str:
    kind = field_type(name)
    if kind == "S":
        return '"' + escape_json(text) + '"'
    if kind == "B":
        return "false" if text == "0" else "true"
    return text


class Printer:
    def __init__(self, out: IO[str], params: BenchParams | None = None) -> None:
        self.out = out
        self.params = params

    def header(self) -> None:
        pass

    def record(self, rec: dict[str, Any]) -> None:
        raise NotImplementedError

    def footer(self) -> None:
        pass

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


class CsvPrinter(Printer):
    """The header is written with the first record (a server-mode record has more fields)."""

    def __init__(self, out: IO[str], params: BenchParams | None = None) -> None:
        super().__init__(out, params)
        self.started = False

    def record(self, rec: dict[str, Any]) -> None:
        names = record_fields(rec)
        if not self.started:
            self.started = True
            self.write(",".join(names) + "\n")
        self.write(",".join('"' + v.replace('"', '""') + '"' for v in values(rec, names)) + "\n")


def _samples(rec: dict[str, Any]) -> tuple[str, str]:
    ns = ", ".join(str(int(x)) for x in rec["samples_ns"])
    ts = ", ".join(format_g(x) for x in samples_ts(rec))
    return ns, ts


class JsonPrinter(Printer):
    def __init__(self, out: IO[str], params: BenchParams | None = None) -> None:
        super().__init__(out, params)
        self.first = True

    def header(self) -> None:
        self.write("[\n")

    def record(self, rec: dict[str, Any]) -> None:
        parts = [] if self.first else [",\n"]
        self.first = False
        parts.append("  {\n")
        names = record_fields(rec)
        for name, text in zip(names, values(rec, names), strict=False):
            parts.append(f'    "{name}": {json_value(name, text)},\n')
        ns, ts = _samples(rec)
        parts.append(f'    "samples_ns": [ {ns} ],\n')
        parts.append(f'    "samples_ts": [ {ts} ]\n')
        parts.append("  }")
        self.write("".join(parts))

    def footer(self) -> None:
        self.write("\n]\n")


class JsonlPrinter(Printer):
    def record(self, rec: dict[str, Any]) -> None:
        parts = ["{"]
        names = record_fields(rec)
        for name, text in zip(names, values(rec, names), strict=False):
            parts.append(f'"{name}": {json_value(name, text)}, ')
        ns, ts = _samples(rec)
        parts.append(f'"samples_ns": [ {ns} ],')
        parts.append(f'"samples_ts": [ {ts} ]')
        parts.append("}\n")
        self.write("".join(parts))


SQL_TYPES = {"S": "TEXT", "B": "INTEGER", "I": "INTEGER", "F": "REAL"}


class SqlPrinter(Printer):
    """llama-bench's table `llama_bench`. Values are single-quoted; a quote inside a value is
    doubled (llama-bench writes it as is, which breaks the statement). The CREATE TABLE statement
    is written with the first record (a server-mode record has more fields)."""

    def __init__(self, out: IO[str], params: BenchParams | None = None) -> None:
        super().__init__(out, params)
        self.started = False

    def create_table(self, names: list[str]) -> None:
        lines = ["CREATE TABLE IF NOT EXISTS llama_bench ("]
        for i, name in enumerate(names):
            comma = "," if i < len(names) - 1 else ""
            lines.append(f"  {name} {SQL_TYPES[field_type(name)]}{comma}")
        lines.append(");")
        self.write("\n".join(lines) + "\n\n")

    def record(self, rec: dict[str, Any]) -> None:
        names = record_fields(rec)
        if not self.started:
            self.started = True
            self.create_table(names)
        vals = ", ".join("'" + v.replace("'", "''") + "'" for v in values(rec, names))
        self.write(f"INSERT INTO llama_bench ({', '.join(names)}) VALUES ({vals});\n")


# --- markdown ------------------------------------------------------------------------------

MD_WIDTHS = {
    "model": -30,
    "t/s": 20,
    "size": 10,
    "params": 10,
    "n_gpu_layers": 3,
    "n_threads": 7,
    "n_batch": 7,
    "n_ubatch": 8,
    "type_k": 6,
    "type_v": 6,
    "split_mode": 5,
    "flash_attn": 2,
    "devices": -12,
    "use_mmap": 4,
    "test": 15,
    "no_op_offload": 4,
    "no_host": 4,
}
MD_NAMES = {
    "n_gpu_layers": "ngl",
    "split_mode": "sm",
    "n_threads": "threads",
    "no_kv_offload": "nkvo",
    "flash_attn": "fa",
    "use_mmap": "mmap",
    "embeddings": "embd",
    "no_op_offload": "nopo",
    "no_host": "noh",
    "devices": "dev",
    "tensor_split": "ts",
    "tensor_buft_overrides": "ot",
}


def md_width(name: str) -> int:
    if name in MD_WIDTHS:
        return MD_WIDTHS[name]
    width = max(len(name), 10)
    return -width if field_type(name) == "S" else width


def md_cell(text: str, width: int) -> str:
    """printf's `%*s`: right-aligned to width, left-aligned to -width, never truncated."""
    return f" {text:<{-width}} |" if width < 0 else f" {text:>{width}} |"


def md_table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """A markdown table whose columns are as wide as their widest cell; the columns at the indices
    `left` are left-aligned, the others right-aligned."""
    widths = []
    for i, name in enumerate(header):
        w = max(len(name), *(len(r[i]) for r in rows)) if rows else len(name)
        widths.append(-w if i in left else w)
    out = ["|" + "".join(md_cell(h, w) for h, w in zip(header, widths, strict=True))]
    out.append("|" + "".join(" " + "-" * (abs(w) - 1) + (":" if w > 0 else "-") + " |" for w in widths))
    out += ["|" + "".join(md_cell(c, w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out) + "\n"


def human_size(n: int) -> str:
    if n < 1024**3:
        return f"{n / 1024.0 / 1024.0:.2f} MiB"
    return f"{n / 1024.0 / 1024.0 / 1024.0:.2f} GiB"


def human_params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1000**3 else f"{n / 1e9:.2f} B"


def md_model(model_type: str, n_params: int) -> str:
    """The md printer's model column: llama.cpp's model_type, with the real parameter count after
    the size class when the class is far from it (llama.cpp picks the class from the layer count,
    so SmolLM2-135M is `llama 256M`): `llama 256M (real 135M) Q4_1`. Other formats keep
    model_type as llama-bench writes it; model_n_params has the exact count."""
    parts = model_type.split(" ", 2)
    if len(parts) < 3 or n_params <= 0 or not parts[1][:-1].replace(".", "", 1).isdigit():
        return model_type
    unit = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(parts[1][-1])
    if unit is None:
        return model_type
    label = float(parts[1][:-1]) * unit
    if abs(label - n_params) <= 0.25 * n_params:
        return model_type
    real = f"{n_params / 1e6:.0f}M" if n_params < 1e9 else f"{n_params / 1e9:.1f}B"
    return f"{parts[0]} {parts[1]} (real {real}) {parts[2]}"


def test_name(n_prompt: int, n_gen: int, n_depth: int) -> str:
    if n_prompt > 0 and n_gen == 0:
        name = f"pp{n_prompt}"
    elif n_gen > 0 and n_prompt == 0:
        name = f"tg{n_gen}"
    else:
        name = f"pp{n_prompt}+tg{n_gen}"
    return name + (f" @ d{n_depth}" if n_depth > 0 else "")


def md_columns(params: BenchParams, backend: str) -> list[str]:
    """llama-bench's column choice: model, size, params, backend, (engine: stdengine's), ngl unless
    the backend is a CPU one, threads (always on a CPU backend), then each option that has several
    values or a non-default one, then test and t/s."""
    cols = ["model", "size", "params", "backend", "engine"]
    is_cpu = "CPU" in backend or "BLAS" in backend
    if not is_cpu:
        cols.append("n_gpu_layers")
    if len(params.n_threads) > 1 or params.n_threads != DEFAULTS.n_threads or is_cpu:
        cols.append("n_threads")
    for name in ("n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "use_mmap"):
        chosen = getattr(params, name)
        if len(chosen) > 1 or chosen != getattr(DEFAULTS, name):
            cols.append(name)
    return cols + ["test", "t/s"]


class MarkdownPrinter(Printer):
    """The header is written with the first record, whose backend decides the ngl column."""

    def __init__(self, out: IO[str], params: BenchParams | None = None) -> None:
        super().__init__(out, params)
        self.columns: list[str] = []
        self.build: tuple[str, int] | None = None

    def _header(self, backend: str) -> None:
        self.columns = md_columns(self.params or DEFAULTS, backend)
        head = "|" + "".join(md_cell(MD_NAMES.get(c, c), md_width(c)) for c in self.columns)
        sep = "|"
        for c in self.columns:
            w = md_width(c)
            sep += " " + "-" * (abs(w) - 1) + (":" if w > 0 else "-") + " |"
        self.write(head + "\n" + sep + "\n")

    def record(self, rec: dict[str, Any]) -> None:
        if not self.columns:
            self._header(str(rec["backends"]))
            self.build = (str(rec["build_commit"]), int(rec["build_number"]))
        line = "|"
        for c in self.columns:
            if c == "model":
                text = md_model(str(rec["model_type"]), int(rec["model_n_params"]))
            elif c == "size":
                text = human_size(int(rec["model_size"]))
            elif c == "params":
                text = human_params(int(rec["model_n_params"]))
            elif c == "backend":
                text = str(rec["backends"])
            elif c == "test":
                text = test_name(int(rec["n_prompt"]), int(rec["n_gen"]), int(rec["n_depth"]))
                text += " sampled" if rec.get("gen_sampled") else ""
            elif c == "engine" and rec.get("engine_args"):
                text = f"{rec['engine']} -E {rec['engine_args']}"
            elif c == "t/s":
                text = f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f}"
            else:
                text = values(rec)[FIELD_NAMES.index(c)]
            line += md_cell(text, md_width(c))
        self.write(line + "\n")

    def footer(self) -> None:
        if self.build is not None:
            self.write(f"\nbuild: {self.build[0]} ({self.build[1]})\n")


PRINTERS: dict[str, type[Printer]] = {
    "md": MarkdownPrinter,
    "csv": CsvPrinter,
    "json": JsonPrinter,
    "jsonl": JsonlPrinter,
    "sql": SqlPrinter,
}


def make_printer(fmt: str, out: IO[str], params: BenchParams | None = None) -> Printer:
    return PRINTERS[fmt](out, params)
