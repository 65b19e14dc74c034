"""The HTTP checks that compare a server with the golden data (conformance/http.py): the served
log-probability metric against numpy, `infer serve` passing every HTTP core check, and a
fault-injecting proxy in front of it, one realistic fault at a time, each caught by the check
meant for it (spec/conformance.md, "HTTP checks")."""

from __future__ import annotations

import math

import numpy as np
from stdengine.conformance import metrics


# --- the served-logprobs metric ---------------------------------------------------------------
def _position(
    rng: np.random.Generator, n_vocab: int = 60, k: int = 8
) -> tuple[np.ndarray, list, list, float]:
    ref = metrics.log_softmax(rng.normal(size=(1, n_vocab)) * 3)
    ids, lps, tails = metrics.top_k_record(ref, k)
    return ref[0], ids[0], lps[0], tails[0]


def test_kl_by_text_equals_restricted_kl_for_unique_texts_and_complete_lists():
    rng = np.random.default_rng(0)
    pieces = {str(i): f"t{i}" for i in range(60)}
    for _ in range(20):
        _, ids, lps, tail = _position(rng)
        engine = rng.normal(size=(1, 60)) * 3
        lq = metrics.log_softmax(engine)[0]
        want = metrics.restricted_kl([ids], [lps], [tail], engine)[0]
        served = {pieces[str(i)]: float(lq[i]) for i in range(60)}  # every id, keyed by its text
        assert math.isclose(metrics.restricted_kl_by_text(ids, lps, tail, pieces, served), want, rel_tol=1e-9)
        # the reference served against itself: zero (up to the golden data's rounding)
        own = {pieces[str(i)]: lp for i, lp in zip(ids, lps, strict=True)}
        assert abs(metrics.restricted_kl_by_text(ids, lps, tail, pieces, own)) < 1e-5


def test_kl_by_text_buckets_shared_texts_and_floors_missing_ones():
    # ids 1 and 2 share a text: the reference's bucket is their sum, served once
    pieces = {"0": "a", "1": "b", "2": "b", "3": "c"}
    lps = [math.log(0.5), math.log(0.2), math.log(0.1), math.log(0.1)]
    tail = math.log(0.1)
    served = {"a": math.log(0.5), "b": math.log(0.3), "x": math.log(0.05)}  # "c" is missing
    p = {"a": 0.5, "b": 0.3, "c": 0.1}
    q = {"a": 0.5, "b": 0.3, "c": 0.05}  # c: at most the list's smallest, and given exactly that
    q_tail = 1 - sum(q.values())
    want = sum(p[b] * math.log(p[b] / q[b]) for b in p) + 0.1 * math.log(0.1 / q_tail)
    got = metrics.restricted_kl_by_text([0, 1, 2, 3], lps, tail, pieces, served)
    assert math.isclose(got, want, rel_tol=1e-12)
    # an extra entry beyond the top k (the chosen token some servers add) is not the floor
    extra = {**served, "y": math.log(1e-6)}
    assert math.isclose(metrics.restricted_kl_by_text([0, 1, 2, 3], lps, tail, pieces, extra, k=3), want)
    assert metrics.restricted_kl_by_text([0, 1, 2, 3], lps, tail, pieces, extra) > want
