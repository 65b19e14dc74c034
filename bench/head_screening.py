"""How much of the output head an exact screen could skip: measured on the catalogue models.

    python -m stdengine.bench.head_screening [--models A,B] [--schedules 4,5,4+5] [--threshold exact]

Issue 22 asks for a screened output head: a cheap pass over a compact copy of the head gives
every row's logit within a guaranteed bound, and only the rows whose upper bound can reach the
top k are computed exactly. This measures, before any kernel is written, what the tightest such
copy of a Q8_0 head leaves to compute, on real hidden states:

- The copy is the head's own bit planes: each int8 weight q = s*hi + lo with s = 2^(8-b),
  hi = floor(q / s) (b bits, signed) and lo in [0, s-1]. The high plane and the block scales
  are the copy (b/8 of the quants' bytes); the low plane completes a row exactly when needed, so
  the split costs no memory beyond the head's.
- The bound (spec/reference-engine.md, "Screening the output head"): with the head's input x
  (as the engine quantized it), each block's sum of lo*x lies in
  [(s-1) * sum of the negative x, (s-1) * sum of the positive x], so every row's logit lies in
  an interval computed from the high plane alone. Rows whose upper end is below the k-th largest
  lower end cannot be in the top k; the others are the candidates.

A screen may also go plane by plane (`4+5`: the 4-bit plane bounds every row, then the 5th bit
is read for the rows still in the running only, and bounds them again).

`--ranks 64,128` adds the other copy the issue names, a low-rank projection: P holds the head's R
leading right singular vectors (from the head alone, not from the inputs), each row keeps its
coefficients c = int8(w P) with one scale, and the row's two error norms e = |w P - c| and
r = |w - w P P^T|. Then |w.x - c.(P^T x)| <= e |P^T x| + r |x - P P^T x| (Cauchy-Schwarz on
the two orthogonal parts), an interval per row from R bytes and three floats.

The head's input is recovered from the engine's logits by least squares (the head has full
column rank; the printed residual shows the recovery is exact to float rounding), over the
conformance suite's logits texts. For each schedule and k (1: greedy; 40: a usual top-k) it
prints the candidates' share of the vocabulary, the share of the head's bytes a screened step
reads (the planes read, and the rest of each candidate's row) and the tg speed-up that those bytes
allow at most (the layers' weights + the head's, against the layers' + the screened head's: the
roofline's reading of a memory-bound step, the KV cache and the screen's arithmetic left out). It
checks that every true top-k row is a candidate, on every position.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
from gguf import GGUFReader
from stdengine.bench.compare_llamacpp import MODELS, machine
from stdengine.bench.printers import md_table
from stdengine.bench.roofline import model_cost
from stdengine.conformance.corpus import LOGIT_TEXTS

from stdengine.events import Emitter
from stdengine.options import Options
from stdengine.registry import engine_class
from stdengine.store import resolve_model

Q8_0_BLOCK = 34  # bytes: an f16 scale and 32 int8 quants
KS = (1, 40)


@dataclass
class Head:
    """A Q8_0 output head as numbers: scales d [V, nb] and quants q [V, nb, 32]."""

    d: np.ndarray
    q: np.ndarray

    @property
    def matrix(self) -> np.ndarray:
        return (self.d[..., None] * self.q).reshape(self.d.shape[0], -1)


def read_head(path: str) -> Head:
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    if t.tensor_type.name != "Q8_0":
        raise SystemExit(f"{path}: the output head is {t.tensor_type.name}; this study reads Q8_0 heads")
    blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, Q8_0_BLOCK)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
    return Head(d, q)


def engine_logits(path: str) -> np.ndarray:
    """Every position's logits of the reference engine over the conformance logits texts."""
    opts = Options(model=path, engine="reference", threads=2, ctx_size=2048)
    engine = engine_class("reference").load(opts, Emitter(stream=io.StringIO()))
    try:
        rows = []
        for text in LOGIT_TEXTS.values():
            engine.reset()
            rows.append(engine.decode(engine.tokenize(text), all_logits=True))
        return np.concatenate(rows).astype(np.float64)
    finally:
        engine.close()


class Screen:
    """The b-bit high plane of a head, and the logit intervals it gives."""

    MARGIN = 1e-3  # each end is widened by this: it covers the engine's float32 sums (~1e-5 here)

    def __init__(self, head: Head, bits: int) -> None:
        self.head, self.s = head, 2.0 ** (8 - bits)
        hi = np.floor(head.q / self.s)
        self.centre = (head.d[..., None] * hi * self.s).reshape(head.d.shape[0], -1)  # [V, n_embd]
        # a negative scale swaps the ends of its block's interval
        self.dpos, self.dneg = np.maximum(head.d, 0), np.minimum(head.d, 0)

    def intervals(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lower and upper bounds of every row's logit for inputs x [n, n_embd] (exact arithmetic,
        widened by MARGIN)."""
        s = self.s
        xb = x.reshape(x.shape[0], self.head.d.shape[1], 32)
        centre = x @ self.centre.T  # per position and row: sum over blocks of d * s * (hi . x_b)
        neg = np.minimum(xb, 0).sum(-1) * (s - 1)  # [n, nb]: the low plane's least contribution / d
        pos = np.maximum(xb, 0).sum(-1) * (s - 1)
        lower = centre + neg @ self.dpos.T + pos @ self.dneg.T
        upper = centre + pos @ self.dpos.T + neg @ self.dneg.T
        return lower - self.MARGIN, upper + self.MARGIN


def threshold(lower: np.ndarray, k: int, logits: np.ndarray | None) -> np.ndarray:
    """What a row's upper end must reach, per position: the k-th largest lower end, or with the
    exact logits (the engine's threshold) the least logit of the k rows of largest lower end."""
    if logits is None:
        return -np.partition(-lower, k - 1, axis=1)[:, k - 1]
    top = np.argpartition(-lower, k - 1, axis=1)[:, :k]
    return np.take_along_axis(logits, top, 1).min(1)


def leading_directions(w: np.ndarray) -> np.ndarray:
    """The right singular vectors of a head [V, n_embd] as columns, the leading one first."""
    return np.linalg.eigh(w.T @ w)[1][:, ::-1]  # eigh: ascending eigenvalues


class LowRank:
    """The copy of a head w [V, n_embd] on the directions p [n_embd, R] (see the module's doc)
    and the logit intervals it gives."""

    def __init__(self, w: np.ndarray, p: np.ndarray) -> None:
        self.p = p
        coef = w @ p
        scale = np.abs(coef).max(1, keepdims=True) / 127
        self.c = np.round(coef / np.where(scale > 0, scale, 1)) * scale
        self.e = np.linalg.norm(coef - self.c, axis=1)
        self.r = np.sqrt(np.maximum((w * w).sum(1) - (coef * coef).sum(1), 0))
        self.bytes_per_row = p.shape[1] + 4 * 3

    def intervals(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        px = x @ self.p
        perp = np.sqrt(np.maximum((x * x).sum(1) - (px * px).sum(1), 0))
        centre = px @ self.c.T
        half = np.linalg.norm(px, axis=1)[:, None] * self.e + perp[:, None] * self.r + Screen.MARGIN
        return centre - half, centre + half


def low_rank_chunk(
    lr: LowRank, x: np.ndarray, k: int, logits: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """screen_chunk for a low-rank copy: the candidates [n, V] and the bytes read per position
    (the copy, then each candidate's whole row)."""
    V, nb = lr.c.shape[0], lr.p.shape[0] // 32
    lower, upper = lr.intervals(x)
    read = np.full(x.shape[0], float(V * lr.bytes_per_row))
    if logits is not None:
        read += k * nb * Q8_0_BLOCK
    cand = upper >= threshold(lower, k, logits)[:, None]
    return cand, read + cand.sum(1) * nb * Q8_0_BLOCK


@dataclass
class Row:
    model: str
    schedule: str  # "4+5", or "rank 128"
    k: int
    cand_mean: float  # share of the vocabulary left after the last plane
    cand_max: float
    head_share: float  # of the head's bytes, on average
    ceiling: float  # tg speed-up the bytes allow


def screen_chunk(
    screens: dict[int, Screen], schedule: tuple[int, ...], x: np.ndarray, k: int, logits: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Screen inputs x plane by plane: every row is bounded by the first plane; the rows still in
    the running are bounded again with each next plane (its extra bits read for them only). The
    threshold after each plane is the k-th largest lower end, or with logits (the exact
    threshold, the engine's) the least exact logit of the k rows of largest lower end, those rows
    read whole, and never below the last plane's. Returns the candidates [n, V] and the bytes read
    per position (the low plane of each candidate included)."""
    V, nb = screens[schedule[0]].head.d.shape
    cand = np.ones((x.shape[0], V), dtype=bool)
    read = cand.sum(1) * nb * 2.0  # the scales
    thr = np.full(x.shape[0], -np.inf)
    have = 0
    for bits in schedule:
        read += cand.sum(1) * nb * 4 * (bits - have)  # 32 weights x the new bits / 8
        have = bits
        lower, upper = screens[bits].intervals(x)
        lower[~cand] = -np.inf
        thr = np.maximum(thr, threshold(lower, k, logits))
        if logits is not None:
            read += k * nb * Q8_0_BLOCK
        cand &= upper >= thr[:, None]
    read += cand.sum(1) * nb * 4 * (8 - have)  # the candidates' rows completed
    return cand, read


def study(
    model: str, schedules: list[tuple[int, ...]], exact: bool, ranks: list[int], chunk: int = 32
) -> tuple[list[Row], dict[str, float]]:
    path = str(resolve_model(model))
    head = read_head(path)
    logits = engine_logits(path)
    w = head.matrix
    x = np.linalg.lstsq(w, logits.T, rcond=None)[0].T  # the head's input, [n, n_embd]
    fit = float(np.sqrt(((x @ w.T - logits) ** 2).mean()))
    cost = model_cost(path)
    V, nb = head.d.shape
    screens = {b: Screen(head, b) for b in sorted({b for sch in schedules for b in sch})}
    rows = []
    # each copy of the head as its screen of a chunk: (x, k, logits or None) -> candidates, bytes read
    copies: list[tuple[str, Callable[..., tuple[np.ndarray, np.ndarray]]]] = [
        ("+".join(map(str, sch)), partial(screen_chunk, screens, sch)) for sch in schedules
    ]
    if ranks:
        directions = leading_directions(w)
        copies += [(f"rank {r}", partial(low_rank_chunk, LowRank(w, directions[:, :r]))) for r in ranks]
    for label, screen in copies:
        for k in KS:
            counts, reads = [], []
            for i in range(0, len(x), chunk):
                part = logits[i : i + chunk]
                cand, read = screen(x[i : i + chunk], k, part if exact else None)
                top = np.argpartition(-part, k - 1, axis=1)[:, :k]
                if not np.take_along_axis(cand, top, 1).all():
                    raise SystemExit(f"{model} {label} k={k}: a true top-k row was screened out")
                counts += list(cand.sum(1))
                reads += list(read)
            c = np.array(counts, dtype=np.float64)
            share = float(np.mean(reads) / (V * nb * Q8_0_BLOCK))
            layers, head_bytes = cost.layer_weight_bytes, cost.head_bytes
            ceiling = (layers + head_bytes) / (layers + share * head_bytes)
            rows.append(Row(model, label, k, float(c.mean() / V), float(c.max() / V), share, ceiling))
    facts = {
        "positions": float(len(x)),
        "fit_rms": fit,
        "logit_std": float(logits.std()),
        "head_of_weights": cost.head_bytes / cost.weight_bytes,
    }
    return rows, facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated catalogue aliases or GGUF paths"
    )
    ap.add_argument(
        "--schedules",
        default="4,5,6,4+5,3+4+5,4+5+6",
        help="plane widths to screen with, comma-separated; 4+5: the 4-bit plane for every row, "
        "then the 5th bit for the rows it left (widths 1-7, increasing)",
    )
    ap.add_argument(
        "--threshold",
        choices=["kth-lower", "exact"],
        default="kth-lower",
        help="what a row's upper end must reach: the k-th largest lower end, or the least exact "
        "logit of the k rows of largest lower end (the engine's; those rows read whole)",
    )
    ap.add_argument("--ranks", default="", help="low-rank copies to screen with too, comma-separated: 64,128")
    args = ap.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        ranks = [0]
    if any(r < 1 for r in ranks):
        ap.error("--ranks: comma-separated ranks of at least 1, such as 64,128")
    try:
        schedules = [tuple(int(b) for b in item.split("+")) for item in args.schedules.split(",")]
    except ValueError:
        schedules = [()]
    increasing = all(sch and list(sch) == sorted(set(sch)) for sch in schedules)
    if not increasing or any(not 1 <= b <= 7 for sch in schedules for b in sch):
        ap.error("--schedules: increasing plane widths from 1 to 7, such as 5 or 4+5")
    m = machine()
    print(
        f"machine: {m['cpu']}; {m['date']}; stdengine {m['stdengine_commit']}; threshold {args.threshold}\n"
    )
    table = []
    for model in args.models.split(","):
        rows, facts = study(model, schedules, args.threshold == "exact", ranks)
        print(
            f"{model}: {facts['positions']:.0f} positions, head input recovered to {facts['fit_rms']:.1e} rms "
            f"(logits' std {facts['logit_std']:.2f}); the head is {facts['head_of_weights']:.0%} of the "
            "weights a token reads"
        )
        sys.stdout.flush()
        for r in rows:
            table.append(
                [
                    r.model,
                    r.schedule,
                    str(r.k),
                    f"{r.cand_mean:.2%}",
                    f"{r.cand_max:.2%}",
                    f"{r.head_share:.0%}",
                    f"{r.ceiling:.2f}x",
                ]
            )
    header = ["model", "planes", "k", "candidates", "worst position", "head bytes read", "tg ceiling"]
    print("\n" + md_table(header, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
