"""llama.cpp as the tests' oracle: what several test files ask of it, written once."""

from __future__ import annotations

from typing import Any

import numpy as np


def llamacpp_greedy(llm: Any, prompts: list[str], n_tokens: int) -> list[tuple[list[int], list[int]]]:
    """For each prompt: its token ids (BOS added, special tokens parsed) and llama.cpp's greedy
    continuation of n_tokens, taken by argmax over its own logits (no sampler involved)."""
    out = []
    for prompt in prompts:
        llm.reset()
        ptoks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(ptoks)
        cont = []
        for _ in range(n_tokens):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            cont.append(tok)
            llm.eval([tok])
        out.append((ptoks, cont))
    return out
