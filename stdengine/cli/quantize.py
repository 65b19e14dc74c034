"""`infer quantize IN.gguf OUT.gguf --type T`: make a GGUF model smaller (spec/quantize.md)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

# The names --type accepts (reference_engine/quantize.py's FILE_TYPES, listed here so that
# `infer quantize --help` does not load the C core).
TYPE_NAMES = (
    "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_K", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_K",
    "Q4_1", "Q4_0", "Q3_K_M", "Q3_K_S", "Q3_K", "Q2_K", "F16", "F32",
)  # fmt: skip


@click.command()
@click.argument("src", metavar="IN.gguf", type=click.Path(path_type=Path))
# a str, not a Path: a trailing "/" (OUT meant as a directory) would be dropped
@click.argument("dst_arg", metavar="OUT.gguf", type=click.Path())
@click.option(
    "--type", "file_type", required=True, type=click.Choice(TYPE_NAMES, case_sensitive=False),
    help="the file type: one tensor type, or one of llama.cpp's mixes (Q4_K_M ...)",
)  # fmt: skip
@click.option("--pure", is_flag=True, help="every quantizable tensor gets the type (no per-tensor mix)")
@click.option(
    "--imatrix", "imatrix_path", type=click.Path(path_type=Path),
    help="an importance matrix (llama.cpp's imatrix GGUF or .dat) to weight the quantization error",
)  # fmt: skip
@click.option(
    "--imatrix-from", "imatrix_text", type=click.Path(path_type=Path),
    help="make the importance matrix with the reference engine: IN's activations over this text file",
)  # fmt: skip
@click.option(
    "--imatrix-out", "imatrix_out", type=click.Path(path_type=Path),
    help="with --imatrix-from: also write the importance matrix here (llama.cpp's imatrix GGUF)",
)  # fmt: skip
@click.option(
    "--imatrix-chunk", type=click.IntRange(min=2), default=512, show_default=True,
    help="with --imatrix-from: tokens per evaluated chunk (llama-imatrix's -c)",
)  # fmt: skip
@click.option("--threads", type=click.IntRange(min=1), default=None, help="threads (default: every core)")
@click.option("--quiet", "-q", is_flag=True, help="no progress bar or summary on stderr")
def quantize(
    src: Path,
    dst_arg: str,
    file_type: str,
    pure: bool,
    imatrix_path: Path | None,
    imatrix_text: Path | None,
    imatrix_out: Path | None,
    imatrix_chunk: int,
    threads: int | None,
    quiet: bool,
) -> None:
    """Quantize a GGUF model to another type and write it as OUT.gguf.

    IN may be F32, F16, BF16 or any type the reference engine can read (requantizing an already
    quantized model warns: the errors add up). Norms and other 1-D tensors are kept as they are.
    OUT is written to a temporary file next to it and renamed when complete, so a failed or
    interrupted run leaves no OUT. Prints OUT's path on stdout.
    """
    from stdengine.errors import UsageError
    from stdengine.modelinfo import human_bytes
    from stdengine.reference import quantize as q

    dst = _output_file(dst_arg, "OUT")
    if imatrix_out is not None:
        _output_file(str(imatrix_out), "--imatrix-out")
    if src.exists() and dst.exists() and src.resolve() == dst.resolve():
        raise UsageError("OUT must not be IN", hint="write the quantized model to another file")
    err = sys.stderr
    if imatrix_path and imatrix_text:
        raise UsageError("--imatrix and --imatrix-from exclude each other", hint="give one of them")
    if imatrix_out and not imatrix_text:
        raise UsageError("--imatrix-out needs --imatrix-from", hint="--imatrix-from TEXT --imatrix-out FILE")
    imatrix = q.read_imatrix(imatrix_path) if imatrix_path else None
    imatrix_name = imatrix_path.name if imatrix_path else None
    if imatrix_text:
        imatrix = _imatrix_from(src, imatrix_text, imatrix_out, imatrix_chunk, threads, quiet)
        imatrix_name = imatrix_out.name if imatrix_out else f"{imatrix_text.name} (--imatrix-from)"
    bar: Any = None

    def on_start(types: dict[str, str], total: int, n_elements: int) -> None:
        nonlocal bar
        if quiet:
            return
        counts: dict[str, int] = {}
        for t in types.values():
            counts[t] = counts.get(t, 0) + 1
        mix = ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        err.write(
            f"quantize: {src} ({human_bytes(src.stat().st_size)}) -> {dst} as {file_type.upper()}: "
            f"about {human_bytes(total)} ({mix} tensors)\n"
        )
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            bar.start()
            bar.add_task("quantizing", total=n_elements)

    def on_progress(name: str, n: int) -> None:
        if bar is not None:
            bar.update(bar.task_ids[0], advance=n, description=name)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so a killed run removes its temporary file too

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        summary = q.quantize_model(
            src,
            dst,
            file_type,
            pure=pure,
            imatrix=imatrix,
            imatrix_name=imatrix_name,
            threads=threads,
            on_start=on_start,
            on_progress=on_progress,
        )
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if bar is not None:
            bar.stop()
    if not quiet:
        for w in summary["warnings"]:
            err.write(f"quantize: warning: {w}\n")
        err.write(
            f"quantize: wrote {human_bytes(summary['bytes'])} "
            f"({summary['bytes'] / max(summary['source_bytes'], 1):.0%} of the source)\n"
        )
    click.echo(str(dst))


def _output_file(path: str, what: str) -> Path:
    """An output file's path, refused before any work (spec/quantize.md): a directory would fail
    only at the final rename, after the whole model was quantized, and a missing directory is not
    created, so that a typo in the path does not quietly make a directory tree."""
    from stdengine.errors import UsageError

    p = Path(path)
    if not path:
        raise UsageError(f"{what} is empty", hint=f"give {what} a file name")
    if path.endswith(("/", os.sep)) or p.is_dir():
        raise UsageError(
            f"{what} {path} names a directory, not a file",
            hint=f"give {what} a file name, e.g. {p / 'model.gguf'}",
        )
    d = p.parent
    if d.exists() and not d.is_dir():
        raise UsageError(
            f"{what} {path}: {d} is not a directory", hint="give a path in an existing directory"
        )
    if not d.is_dir():
        raise UsageError(
            f"{what} {path}: the directory {d} does not exist",
            hint=f"create it first (mkdir -p {d}), or give a path in an existing directory",
        )
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: cannot write in {d}", hint="give a path in a writable directory")
    return p


def _imatrix_from(
    src: Path, text_path: Path, out: Path | None, chunk: int, threads: int | None, quiet: bool
) -> dict[str, Any]:
    """The importance matrix of IN's activations over a text (reference_engine/imatrix.py)."""
    import time

    from stdengine.errors import UsageError
    from stdengine.reference import imatrix as im

    try:
        text = text_path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read the imatrix text {text_path}: {e.strerror or e}") from e
    t0 = time.perf_counter()

    def on_chunk(done: int, total: int) -> None:
        if not quiet and sys.stderr.isatty():
            sys.stderr.write(f"\rquantize: imatrix: chunk {done}/{total}")

    stats = im.collect(
        src, text, chunk_size=chunk, threads=threads, dataset=text_path.name, on_chunk=on_chunk
    )
    if out is not None:
        im.write_gguf(stats, out)
    if not quiet:
        tokens = stats.chunks * stats.chunk_size
        sys.stderr.write(
            f"\rquantize: imatrix: {len(stats.sums)} weights, {stats.chunks} chunks of {stats.chunk_size} "
            f"tokens ({tokens}) from {text_path.name} in {time.perf_counter() - t0:.1f} s"
            + (f", written to {out}" if out else "")
            + "\n"
        )
    return stats.importance()
