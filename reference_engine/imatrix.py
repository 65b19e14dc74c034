"""Importance matrices made with the reference engine (`infer quantize --imatrix-from TEXT`).

An importance matrix holds, for each weight matrix, the mean squared activation of each input
column over a text: an error in the weights of column j moves the matmul's output by that error
times a_j, so E[a_j²] says how much the column's errors cost (spec/quantize.md). `collect` runs
the engine's forward pass over the text with the C core's activation statistics on
(se_context_set_act_stats in engine.h) and returns the sums; `write_gguf` writes them in
llama.cpp's imatrix GGUF format (what llama-imatrix writes and llama-quantize reads).

The text is split the way llama-imatrix splits it: tokenized once (with BOS when the model adds
one), cut into chunks of chunk_size tokens (a shorter rest is dropped; a text shorter than one
chunk is one chunk), each chunk evaluated in a fresh context with its first token replaced by BOS.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
from stdengine.reference._lib import lib

from stdengine.errors import InvalidRequest

# The matmul inputs the C core counts per layer, in its order (engine.h), and the weights that
# read each one.
GROUPS = (
    ("attn_q", "attn_k", "attn_v"),
    ("attn_output",),
    ("ffn_gate", "ffn_up"),
    ("ffn_down",),
)


@dataclass
class ActStats:
    """Per weight name: sums of squared input activations per column (float64) and rows counted."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    chunks: int = 0
    chunk_size: int = 0
    datasets: list[str] = field(default_factory=list)

    def importance(self) -> dict[str, np.ndarray]:
        """Mean squared activation per column (sum / count; 1 where nothing was counted), as
        llama.cpp's quantizer reads an imatrix, for quantize_model(imatrix=...)."""
        return {
            n: (s / self.counts[n] if self.counts[n] else np.ones_like(s)).astype(np.float32)
            for n, s in self.sums.items()
        }


@cache
def _set_stats() -> Callable[..., int]:
    f = lib().se_context_set_act_stats
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return f


def collect(
    path: str | os.PathLike[str],
    text: str | None = None,
    tokens: Sequence[int] | None = None,
    *,
    chunk_size: int = 512,
    threads: int | None = None,
    dataset: str = "",
    max_chunks: int = 0,
    on_chunk: Callable[[int, int], None] | None = None,
) -> ActStats:
    """Activation statistics of the model at path over text (or token ids; not both).

    max_chunks: evaluate at most this many chunks (0: all). on_chunk(done, total) after each
    chunk. InvalidRequest when there is nothing to evaluate.
    """
    from stdengine.reference.core import Context
    from stdengine.reference.model import Model
    from stdengine.reference.quantize import default_threads
    from stdengine.reference.tokenizer import Tokenizer, scan_for_tokenizer

    if (text is None) == (tokens is None):
        raise TypeError("collect() takes text or tokens")
    if chunk_size < 2:
        raise InvalidRequest(f"the chunk size must be at least 2 tokens, not {chunk_size}")
    header = scan_for_tokenizer(path)
    model = Model.load(path, header)
    bos = None
    if text is not None:
        tok = Tokenizer.from_header(header)
        ids = list(tok.encode(text, add_special=True, parse_special=False))
        bos = tok.bos_id if tok.add_bos else None
    else:
        ids = [int(t) for t in tokens or ()]
    if len(ids) < 2:
        raise InvalidRequest("the imatrix text has fewer than 2 tokens")
    size = min(chunk_size, len(ids))
    n_chunks = len(ids) // size if not max_chunks else min(max_chunks, len(ids) // size)
    hp = model.hparams
    E, Dq, F = hp.n_embd, hp.n_head * hp.head_dim, hp.n_ff
    widths = (E, Dq, E, F)
    per_layer = sum(widths)
    sum2 = np.zeros(hp.n_layer * per_layer, dtype=np.float64)
    count = np.zeros(hp.n_layer * 4, dtype=np.int64)
    n = threads or default_threads()
    ctx = Context(model, n_ctx=size, n_threads=n, n_batch=size, n_ubatch=size)
    try:
        if _set_stats()(ctx._h, sum2.ctypes.data, count.ctypes.data) != 0:
            raise RuntimeError("se_context_set_act_stats refused the buffers")
        for c in range(n_chunks):
            chunk = ids[c * size : (c + 1) * size]
            if bos is not None:
                chunk[0] = bos
            ctx.reset()
            ctx.decode(chunk)
            if on_chunk:
                on_chunk(c + 1, n_chunks)
        _set_stats()(ctx._h, None, None)
    finally:
        ctx.close()
        model.close()
    out = ActStats(chunks=n_chunks, chunk_size=size, datasets=[dataset] if dataset else [])
    for il in range(hp.n_layer):
        off = il * per_layer
        for g, (names, width) in enumerate(zip(GROUPS, widths, strict=True)):
            for name in names:
                full = f"blk.{il}.{name}.weight"
                if full in model.tensors:
                    out.sums[full] = sum2[off : off + width].copy()
                    out.counts[full] = int(count[il * 4 + g])
            off += width
    return out


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(stats: ActStats, path: str | os.PathLike[str]) -> None:
    """stats as llama.cpp's imatrix GGUF: general.type "imatrix", imatrix.datasets (strings),
    imatrix.chunk_count and imatrix.chunk_size (uint32); per weight NAME, in name order, the f32
    tensors NAME.in_sum2 (the sums, one row) and NAME.counts (one value: the rows counted)."""
    kvs = [
        _str("general.type") + struct.pack("<I", 8) + _str("imatrix"),
        _str("imatrix.datasets")
        + struct.pack("<IIQ", 9, 8, len(stats.datasets))
        + b"".join(_str(d) for d in stats.datasets),
        _str("imatrix.chunk_count") + struct.pack("<II", 4, stats.chunks),
        _str("imatrix.chunk_size") + struct.pack("<II", 4, stats.chunk_size),
    ]
    align = 32
    tensors: list[tuple[str, np.ndarray]] = []
    for name in sorted(stats.sums):
        tensors.append((f"{name}.in_sum2", stats.sums[name].astype(np.float32).reshape(1, -1)))
        tensors.append((f"{name}.counts", np.array([[stats.counts[name]]], dtype=np.float32)))
    infos, data, off = [], [], 0
    for name, a in tensors:
        ne = (a.shape[1], a.shape[0])  # GGUF lists the row length first
        infos.append(_str(name) + struct.pack("<I2QIQ", 2, *ne, 0, off))  # type 0: f32
        raw = a.tobytes()
        pad = -len(raw) % align
        data.append(raw + b"\0" * pad)
        off += len(raw) + pad
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head + b"\0" * (-len(head) % align))
        for d in data:
            f.write(d)
    os.replace(tmp, path)
