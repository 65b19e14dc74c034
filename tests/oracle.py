"""llama.cpp as the tests' oracle: what several test files ask of it, written once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Greedy:
    """llama.cpp's greedy continuation of a prompt, with how clear each of its choices was."""

    prompt: list[int]  # token ids (BOS added, special tokens parsed)
    tokens: list[int]  # the continuation, by argmax over llama.cpp's own logits (no sampler)
    runner_up: list[int]  # its second choice at each step
    margin: list[float]  # its top-1 minus top-2 logit at each step


def llamacpp_greedy(llm: Any, prompts: list[str], n_tokens: int) -> list[Greedy]:
    out = []
    for prompt in prompts:
        llm.reset()
        ptoks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(ptoks)
        g = Greedy(ptoks, [], [], [])
        for _ in range(n_tokens):
            logits = np.asarray(llm.scores[llm.n_tokens - 1])
            second, first = (int(i) for i in np.argsort(logits)[-2:])
            g.tokens.append(first)
            g.runner_up.append(second)
            g.margin.append(float(logits[first] - logits[second]))
            llm.eval([first])
        out.append(g)
    return out


def greedy_partings(ctx: Any, refs: list[Greedy], near_tie: float) -> tuple[int, list[str]]:
    """Our greedy continuations (ctx.sample() with no parameters) of llama.cpp's prompts.

    Two correct engines part at a near-tie: their logits differ by float rounding, which moves a
    top-1/top-2 margin by up to near_tie (measured on a long text; see the callers). So a
    continuation must be llama.cpp's, or part from it first at a step where llama.cpp's margin
    is below near_tie and our token is its runner-up. Returns (how many are llama.cpp's, the
    partings that break this rule).
    """
    same, bad = 0, []
    for g in refs:
        ctx.reset()
        ctx.decode(g.prompt)
        for i, want in enumerate(g.tokens):
            tok = ctx.sample()
            if tok != want:
                print(f"parts at step {i}: llama.cpp's margin {g.margin[i]:.3f}")
                if tok != g.runner_up[i] or g.margin[i] >= near_tie:
                    bad.append(f"step {i}: {tok} for {want} (margin {g.margin[i]:.3f}), prompt {g.prompt}")
                break
            ctx.decode([tok])
        else:
            same += 1
            print("same")
    return same, bad
