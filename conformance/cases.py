"""The golden generation cases, as both kinds of checks read them (checks.py in process,
http.py over --url): finding a case, the texts an answer must never contain, and where two
texts part.

Every golden continuation wins each step by >= 1 nat (golden["generation"]["min_margin"]), so a
correct engine reproduces it exactly at temperature 0.
"""

from __future__ import annotations

import math
from typing import Any

from stdengine.conformance.suite import Context, Skip

FFFD = "\ufffd"


def all_cases(ctx: Context) -> list[dict[str, Any]]:
    """Every golden generation case ([] without golden data)."""
    return list(((ctx.golden or {}).get("generation") or {}).get("cases") or [])


def find_case(ctx: Context, name: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """The golden case called name, or the first of a kind (raw: the generation checks' prompt);
    Skip when there is none."""
    ctx.need_golden("generation")
    for c in all_cases(ctx):
        if c["name"] == name or (name is None and c["kind"] == kind):
            return c
    raise Skip(f"the golden data has no generation case {name or kind!r}")


# The seeds a "this setting makes sampling greedy" check draws with, and its temperature.
GREEDY_SEEDS = (11, 12, 13, 14, 15, 16)
GREEDY_TEMP = 1.5


def chance_of_greedy(case: dict[str, Any], temp: float) -> float:
    """An upper bound on the chance that sampling at temp (top-k or not) draws the case's whole
    greedy continuation: at each step the top token's probability is at most
    1 / (1 + e^(-margin/temp)), the runner-up alone taking the rest."""
    return math.prod(1 / (1 + math.exp(-m / temp)) for m in case.get("margins") or [math.inf])


def least_greedy_raw_case(ctx: Context) -> tuple[dict[str, Any], float]:
    """The raw golden case a sampler that ignores a greedy-making setting is least likely to
    reproduce at GREEDY_TEMP, and the bound on that chance for all GREEDY_SEEDS together. A check
    on the first case alone had no power on a counting prompt the model continues with near
    certainty even at temperature 1.5."""
    ctx.need_golden("generation")
    raw = [c for c in all_cases(ctx) if c["kind"] == "raw"]
    if not raw:
        raise Skip("the golden data has no raw generation case")
    case = min(raw, key=lambda c: chance_of_greedy(c, GREEDY_TEMP))
    return case, chance_of_greedy(case, GREEDY_TEMP) ** len(GREEDY_SEEDS)


def eog_texts(ctx: Context) -> list[str]:
    """The texts of the model's end-of-generation tokens (`<|im_end|>`, `</s>`…): an engine that
    stops on one must not print it."""
    g = ctx.golden or {}
    pieces = g.get("pieces") or {}
    texts = {pieces.get(str(i), "") for i in (g.get("eog") or {}).get("ids", [])}
    texts.add((g.get("chat") or {}).get("eos_token") or "")
    return sorted(t for t in texts if len(t.strip()) > 1 and FFFD not in t)


def first_difference(got: str, want: str) -> str:
    """Where two texts part: the character and word index, and a little of each around it."""
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    word = len(want[:i].split()) + (0 if i == 0 or want[i - 1].isspace() else -1)
    lo = max(0, i - 20)
    return (
        f"differs at character {i} (word {word + 1}): got {'…' if lo else ''}{got[lo : i + 20]!r}, "
        f"want {'…' if lo else ''}{want[lo : i + 20]!r}"
    )


def eog_answer_tokens(eog_case: dict[str, Any]) -> int:
    """The completion tokens of the golden end-of-generation prompt's answer: llama.cpp's greedy
    run ends with the end-of-generation token itself, which is not part of the answer."""
    return len(eog_case["llama_cpp_greedy"]) - 1
