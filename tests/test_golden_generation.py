"""The golden data's stored greedy continuation (`completion.llama_cpp_greedy`) is checked, not
only stored: it is what llama.cpp's greedy decoding gives now, and the reference engine follows
it, in both cases up to a parting at a near-tie of llama.cpp's logits (two correct engines differ
by float rounding; tests/oracle.py)."""

from __future__ import annotations

import pytest
from oracle import greedy_partings, llamacpp_greedy
from stdengine.conformance.golden import golden_path, load_golden
from stdengine.reference.core import Context
from stdengine.reference.model import Model

pytestmark = [pytest.mark.models, pytest.mark.llamacpp]

NEAR_TIE = {"smollm2-135m-instruct": 0.4, "gemma-3-270m": 0.5}  # as in the forward tests


@pytest.mark.parametrize("alias", list(NEAR_TIE))
def test_golden_greedy_is_llamacpps_and_ours(alias, smollm2_path, gemma3_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = smollm2_path if alias.startswith("smollm2") else gemma3_path
    golden = load_golden(golden_path(alias))
    stored = golden["completion"]["llama_cpp_greedy"]
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    (live,) = llamacpp_greedy(llm, [golden["completion"]["prompt"]], len(stored))
    del llm
    # the stored tokens are llama.cpp's greedy choices (this build may part at a near-tie)
    for i, (s, t) in enumerate(zip(stored, live.tokens, strict=False)):
        if s != t:
            assert s == live.runner_up[i] and live.margin[i] < NEAR_TIE[alias], (i, s, t, live.margin[i])
            break
    # and the reference engine's greedy continuation is llama.cpp's, or parts at a near-tie
    with Model.load(path) as m, Context(m, n_ctx=256, n_threads=2) as ctx:
        _, bad = greedy_partings(ctx, [live], NEAR_TIE[alias])
    assert not bad, bad
