"""The distances the logits checks use, defined once for the golden data and the checks.

Golden data keeps, for every scored position t of a text, the exact reference's k most probable
next tokens (ids and log-probabilities, most probable first) and the log of the mass left over
(the tail). An engine's distribution Q at t is softmax(logits_t) over the whole vocabulary.

- **Restricted KL** at t: both distributions are coarsened to k + 1 buckets (the reference's
  top-k tokens, and everything else), then KL(P_b || Q_b) = sum_b P_b (log P_b - log Q_b).
  Coarsening never increases KL (data-processing inequality), so this is a lower bound of the full
  KL that needs only k + 1 numbers per position. `kl_mean` is its mean over all scored positions.
- **Confident positions**: where the reference's top-1 log-probability exceeds its top-2 by at
  least CONFIDENT_MARGIN nats (the top token is at least e times as likely as the next). There
  the next token is not a near tie, so a correct engine should pick the same top token.
- **Top-1 agreement**: the fraction of confident positions where argmax(engine logits) is the
  reference's top-1 token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIDENT_MARGIN = 1.0
TAIL_FLOOR = 1e-30  # a tail probability is never taken as exactly zero (log 0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_k_record(ref_logprobs: np.ndarray, k: int) -> tuple[list[list[int]], list[list[float]], list[float]]:
    """Per row: the k best ids and their log-probs (descending) and the tail's log-probability."""
    ids_out, lps_out, tails = [], [], []
    for row in ref_logprobs:
        idx = np.argpartition(-row, k)[:k]
        idx = idx[np.argsort(-row[idx], kind="stable")]
        lps = row[idx]
        tail = max(1.0 - float(np.exp(lps).sum()), TAIL_FLOOR)
        ids_out.append([int(i) for i in idx])
        lps_out.append([round(float(v), 6) for v in lps])
        tails.append(round(math.log(tail), 6))
    return ids_out, lps_out, tails


def restricted_kl(
    top_ids: list[list[int]], top_lps: list[list[float]], tail_lps: list[float], engine_logits: np.ndarray
) -> np.ndarray:
    """Restricted KL(reference || engine) at each position; engine_logits is (T, n_vocab)."""
    lq = log_softmax(engine_logits)
    out = np.empty(len(top_ids), dtype=np.float64)
    for t, (ids, lps, tail) in enumerate(zip(top_ids, top_lps, tail_lps, strict=True)):
        lp = np.asarray(lps, dtype=np.float64)
        p = np.exp(lp)
        lq_top = lq[t, ids]
        q_tail = max(1.0 - float(np.exp(lq_top).sum()), TAIL_FLOOR)
        p_tail = math.exp(tail)
        out[t] = float((p * (lp - lq_top)).sum()) + p_tail * (tail - math.log(q_tail))
    return out


def confident_mask(top_lps: list[list[float]]) -> np.ndarray:
    return np.array([lps[0] - lps[1] >= CONFIDENT_MARGIN for lps in top_lps], dtype=bool)


@dataclass
class Distance:
    kl_mean: float
    kl_max: float
    n_positions: int
    top1_agreement: float
    n_confident: int
    top1_misses: int

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def distance(texts: list[dict[str, Any]], engine_logits: list[np.ndarray]) -> Distance:
    """The engine's distance from the reference over every scored position of every text."""
    kls, agree, conf = [], 0, 0
    for text, logits in zip(texts, engine_logits, strict=True):
        kls.append(restricted_kl(text["top_ids"], text["top_logprobs"], text["tail_logprob"], logits))
        mask = confident_mask(text["top_logprobs"])
        top1 = np.array([ids[0] for ids in text["top_ids"]])
        hits = np.asarray(logits).argmax(axis=-1) == top1
        agree += int(hits[mask].sum())
        conf += int(mask.sum())
    allkl = np.concatenate(kls) if kls else np.zeros(0)
    return Distance(
        kl_mean=float(allkl.mean()) if allkl.size else 0.0,
        kl_max=float(allkl.max()) if allkl.size else 0.0,
        n_positions=int(allkl.size),
        top1_agreement=agree / conf if conf else 1.0,
        n_confident=conf,
        top1_misses=conf - agree,
    )


# --- the bounds (spec/conformance.md explains the choice) -----------------------------------------
def kl_bound(llamacpp_kl: float) -> float:
    """An engine's mean restricted KL may be at most max(1.5 x llama.cpp's, llama.cpp's + 0.002).
    (Suite 1.x allowed 2x and + 0.005, which let Gaussian logit noise of 0.1 nats through.)"""
    return max(1.5 * llamacpp_kl, llamacpp_kl + 0.002)


def top1_miss_bound(llamacpp_miss_rate: float) -> float:
    """An engine's top-1 miss rate on confident positions may be at most
    max(2 x llama.cpp's, llama.cpp's + 0.01)."""
    return max(2.0 * llamacpp_miss_rate, llamacpp_miss_rate + 0.01)


def restricted_kl_by_text(
    top_ids: list[int],
    top_lps: list[float],
    tail_lp: float,
    pieces: dict[str, str],
    served: dict[str, float],
    k: int | None = None,
) -> float:
    """Restricted KL(reference || engine) at one position when the engine's distribution is known
    only as a server serves it: its most probable tokens' texts -> log-probabilities (OpenAI's
    `top_logprobs`, a dict keyed by token text).

    Buckets are token texts on both sides: the reference's top-k ids are mapped to their texts
    (`pieces`, golden data) and ids sharing a text are summed; everything else is the tail. A
    reference bucket that the served list lacks has a probability no larger than the list's
    smallest, and gets exactly that (the charitable choice: a correct engine whose list simply
    stopped before that token is not penalised beyond what the list shows). With k, only the k
    largest served values make the list (some servers add the chosen token to its top-k, and that
    extra entry bounds nothing). The engine's tail is
    what the reference buckets leave (floored at TAIL_FLOOR). When texts are unique and the served
    list holds every reference id, this equals `restricted_kl`. A server whose dict collapses two
    ids of one text keeps one of them, which can only raise the KL (rare: byte tokens)."""
    p: dict[str, float] = {}
    for i, lp in zip(top_ids, top_lps, strict=True):
        text = pieces[str(i)]
        p[text] = p.get(text, 0.0) + math.exp(lp)
    floor = sorted(served.values(), reverse=True)[: k or len(served)][-1]
    lq = {b: served.get(b, floor) for b in p}
    q_tail = max(1.0 - sum(math.exp(v) for v in lq.values()), TAIL_FLOOR)
    kl = sum(pb * (math.log(pb) - lq[b]) for b, pb in p.items())
    return kl + math.exp(tail_lp) * (tail_lp - math.log(q_tail))
