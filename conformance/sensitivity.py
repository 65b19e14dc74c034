"""How small a fault the suite detects, measured: `python -m stdengine.conformance.sensitivity`.

Three faults of growing size are injected into the reference engine and the checks that should
see them are run on a catalogue model:

- **logit noise**: independent Gaussian noise of standard deviation sigma (nats) on every logit;
  judged by `logits.kl:text=all`.
- **batch-dependent noise**: the same noise only in decode() calls of fewer than 16 tokens (a
  kernel for short batches that rounds differently); judged by `batch.invariance:*`.
- **KV window**: the context keeps only the last W prompt tokens; judged by every core check
  (the induction case and the long text are the ones that can see it).

For each, the table says which sizes the suite fails (exit status 1) and which it passes; the
smallest size detected goes into spec/conformance.md ("Sensitivity").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
from stdengine.conformance.runner import find_golden, run_suite
from stdengine.conformance.suite import Context, exit_status

from stdengine.events import null_emitter
from stdengine.local_engine import Evaluate
from stdengine.options import Options


def reference_engine() -> Any:
    from stdengine.reference.adapter import ReferenceEngine

    return ReferenceEngine


def noisy_logits(sigma: float, below: int = 0, seed: int = 0) -> type:
    """The reference engine with N(0, sigma) added to the logits of decode() (only for calls of
    fewer than `below` tokens when below > 0)."""
    base = reference_engine()
    rng = np.random.default_rng(seed)

    def decode(self: Any, tokens: Any, all_logits: bool = False) -> np.ndarray:
        out = base.decode(self, tokens, all_logits=all_logits)
        if below and len(tokens) >= below:
            return out
        return out + rng.normal(0.0, sigma, size=out.shape).astype(out.dtype)

    return type(f"NoisyLogits{sigma}", (base,), {"decode": decode})


def kv_window(window: int) -> type:
    """The reference engine keeping only the last `window` tokens of each prompt."""
    base = reference_engine()

    def _prefill(self: Any, prompt: list[int], reuse: bool = True) -> Generator[Evaluate, None, int]:
        self._keep_prefix(0)
        yield Evaluate(prompt[-window:])
        return min(len(prompt), window)

    return type(f"KvWindow{window}", (base,), {"_prefill": _prefill})


def detected(cls: Any, model: Path, golden: dict[str, Any], only: str | None, n_ctx: int = 2048) -> bool:
    engine = cls.load(Options(model=str(model), ctx_size=n_ctx), null_emitter())
    try:
        ctx = Context(engine=engine, golden=golden, golden_note="", model_path=model)
        return exit_status(run_suite(ctx, level="core", only=only)) == 1
    finally:
        engine.close()


FAULTS: dict[str, tuple[Any, list[float], str | None]] = {
    "logit noise (sigma, nats)": (noisy_logits, [0.02, 0.05, 0.07, 0.1, 0.2], "logits.kl:text=all"),
    "batch-dependent noise (sigma, nats)": (
        lambda s: noisy_logits(s, below=16),
        [0.02, 0.05, 0.1, 0.2, 0.5],
        "batch.invariance:*",
    ),
    "KV window (tokens kept)": (lambda w: kv_window(int(w)), [1400, 1024, 800, 700, 600, 400], None),
}


def main(argv: list[str] | None = None) -> int:
    from stdengine.store import resolve_model

    ap = argparse.ArgumentParser(prog="python -m stdengine.conformance.sensitivity", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalogue alias")
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    golden, note = find_golden(args.model, path)
    if golden is None:
        print(note, file=sys.stderr)
        return 3
    print(f"model {args.model}; suite run at level core with the checks named per fault\n")
    print("| fault | size | suite |")
    print("|---|---|---|")
    for name, (make, sizes, only) in FAULTS.items():
        for size in sizes:
            verdict = "fails (detected)" if detected(make(size), path, golden, only) else "passes"
            print(f"| {name} | {size:g} | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
