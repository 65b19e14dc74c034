"""Make the golden data for a catalogue model: `python -m stdengine.conformance.golden --model ALIAS`.

Sources (independent of every engine under test, and of each other):
- token ids: llama.cpp's tokenizer (llama-cpp-python), the tokenizer oracle;
- next-token log-probabilities: the exact float64 reference (exact.py) over the dequantized weights;
- chat templates: the GGUF's `tokenizer.chat_template` rendered here with jinja2, cross-checked
  against llama-cpp-python's own jinja rendering;
- llama.cpp's distance from the exact reference on the same positions (metrics.py), which scales
  the logits bounds, and the end-of-generation token ids from llama.cpp's vocabulary.

The file is conformance/golden/ALIAS.json.gz. It takes a few minutes per model on 2 cores.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from stdengine.conformance import corpus
from stdengine.conformance.metrics import CONFIDENT_MARGIN, distance, log_softmax, top_k_record

GOLDEN_DIR = Path(__file__).parent / "golden"
FORMAT = 2  # 2: generation cases, pieces, tokenizer normalisation cases
TOP_K = 20


def golden_path(alias: str) -> Path:
    return GOLDEN_DIR / f"{alias}.json.gz"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def render_template(
    template: str, messages: list[dict[str, str]], bos: str, eos: str, add_generation_prompt: bool
) -> str:
    """Render a chat template the way HF transformers does (trim_blocks, lstrip_blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, bos_token=bos, eos_token=eos, add_generation_prompt=add_generation_prompt
    )


def _llama(path: Path) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        str(path),
        n_ctx=4096,  # the induction prompt has about 1200 tokens
        n_batch=512,
        logits_all=True,
        n_threads=os.cpu_count() or 1,
        verbose=False,
        seed=0,
    )


def _llama_logits(llm: Any, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def _eog_ids(llm: Any) -> list[int]:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    return [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def _greedy(llm: Any, ids: list[int], n: int, stop_ids: set[int]) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        if tok in stop_ids:
            break
        llm.eval([tok])
    return out


GEN_MIN_MARGIN = 1.0  # nats between the exact top-1 and top-2 at every golden generation step
GEN_MIN_TOKENS = 24
GEN_MAX_TOKENS = 32
GEN_MAX_EXTEND = 24  # greedy tokens a raw prompt may absorb to get past near ties


def _generation_case(
    name: str,
    spec: str | list[dict[str, str]],
    exact: Any,
    llm: Any,
    tok: Any,
    piece_bytes: Any,
    render: Any,
    eog: set[int],
    add_bos: bool,
    bos_id: int,
) -> dict[str, Any] | None:
    """One golden generation case, or None when the exact greedy continuation has no run of
    GEN_MIN_TOKENS confident steps. llama.cpp proposes the greedy continuation; one exact forward
    pass over prompt + proposal confirms it step by step (where the exact argmax differs, the
    proposal ends), so the case is the exact reference's own greedy output."""
    chat = isinstance(spec, list)
    if chat:
        prompt = render(spec)
        prompt_ids = tok(prompt, False, True)
        if add_bos and prompt_ids[:1] != [bos_id]:
            prompt_ids = [bos_id, *prompt_ids]
    else:
        prompt = str(spec)
        prompt_ids = tok(prompt, True, True)
    proposal = _greedy(llm, prompt_ids, GEN_MAX_TOKENS + GEN_MAX_EXTEND, eog)
    lp = log_softmax(exact.logits(prompt_ids + proposal, last=len(proposal) + 1))[:-1]
    ids: list[int] = []
    margins: list[float] = []
    for row, want in zip(lp, proposal, strict=True):
        top2 = np.argsort(row)[-2:]
        if int(top2[-1]) != want or want in eog:
            break
        ids.append(want)
        margins.append(float(row[top2[-1]] - row[top2[-2]]))
    # skip a short run of near ties at the start (raw prompts only: the prompt absorbs them)
    start = 0
    if not chat:
        low = [i for i, m in enumerate(margins[:GEN_MAX_EXTEND]) if m < GEN_MIN_MARGIN]
        start = low[-1] + 1 if low else 0
        if start:
            try:
                extended = prompt + b"".join(piece_bytes(i) for i in ids[:start]).decode("utf-8")
            except UnicodeDecodeError:
                return None
            if tok(extended, True, True) != prompt_ids + ids[:start]:
                return None
            prompt, prompt_ids = extended, prompt_ids + ids[:start]
    run = 0
    while start + run < len(ids) and margins[start + run] >= GEN_MIN_MARGIN:
        run += 1
    ids, margins = ids[start : start + min(run, GEN_MAX_TOKENS)], margins[start : start + run]
    # end on whole characters, so that the text is the same however an engine streams it
    while ids:
        try:
            text = b"".join(piece_bytes(i) for i in ids).decode("utf-8", "strict")
            break
        except UnicodeDecodeError:
            ids.pop()
    if len(ids) < GEN_MIN_TOKENS:
        return None
    return {
        "name": name,
        "kind": "chat" if chat else "raw",
        "prompt": prompt,
        "messages": spec if chat else None,
        "prompt_ids": prompt_ids,
        "ids": ids,
        "text": text,
        "margins": [round(m, 3) for m in margins[: len(ids)]],
    }


def make_golden(alias: str, path: Path, log: Any = print) -> dict[str, Any]:
    import llama_cpp
    from stdengine.conformance.exact import ExactModel

    from stdengine.gguf_file import scan_gguf

    t0 = time.time()
    metadata = scan_gguf(path).metadata
    arch = str(metadata["general.architecture"])
    template = metadata.get("tokenizer.chat_template")
    llm = _llama(path)

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [
            int(i) for i in llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
        ]

    def piece(i: int) -> str:
        return bytes(llm.detokenize([i], special=True)).decode("utf-8", errors="replace")

    # --- tokenizer ------------------------------------------------------------------------------
    cases = []
    texts = dict(corpus.TOKENIZER_TEXTS) | corpus.SPECIAL_TEXTS.get(arch, {})
    for name, text in texts.items():
        for add_special, parse_special in ((True, True), (False, False)):
            ids = tok(text, add_special, parse_special)
            cases.append(
                {
                    "name": name,
                    "text": text,
                    "add_special": add_special,
                    "parse_special": parse_special,
                    "ids": ids,
                }
            )
    log(f"tokenizer: {len(cases)} cases")

    # --- logits ---------------------------------------------------------------------------------
    exact = ExactModel(path)
    ltexts = []
    llama_logits = []
    for name, text in corpus.LOGIT_TEXTS.items():
        ids = tok(text, True, False)
        t1 = time.time()
        ref = log_softmax(exact.logits(ids))
        top_ids, top_lps, tails = top_k_record(ref, TOP_K)
        ltexts.append(
            {"name": name, "ids": ids, "top_ids": top_ids, "top_logprobs": top_lps, "tail_logprob": tails}
        )
        llama_logits.append(_llama_logits(llm, ids))
        log(f"logits: text {name}: {len(ids)} positions, exact reference {time.time() - t1:.1f}s")
    dist = distance(ltexts, llama_logits)
    per_text = {t["name"]: distance([t], [lg]).to_dict() for t, lg in zip(ltexts, llama_logits, strict=True)}
    log(f"llama.cpp distance: {dist.to_dict()}")

    # --- chat -----------------------------------------------------------------------------------
    eog = _eog_ids(llm)
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    bos = piece(bos_id) if bos_id >= 0 else ""
    eos = piece(eos_id) if eos_id >= 0 else ""
    chat: dict[str, Any] = {"template_sha256": None, "bos_token": bos, "eos_token": eos, "cases": []}
    if template:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        chat["template_sha256"] = hashlib.sha256(template.encode()).hexdigest()
        for name, messages in corpus.CONVERSATIONS.items():
            for agp in (True, False):
                text = render_template(template, messages, bos, eos, agp)
                theirs = Jinja2ChatFormatter(
                    template, eos_token=eos, bos_token=bos, add_generation_prompt=agp
                )(messages=messages).prompt
                chat["cases"].append(
                    {
                        "name": name,
                        "messages": messages,
                        "add_generation_prompt": agp,
                        "text": text,
                        "llama_cpp_python_agrees": theirs == text,
                    }
                )
        log(f"chat: {len(chat['cases'])} renderings")

    # --- generation -----------------------------------------------------------------------------
    def piece_bytes(i: int) -> bytes:
        return bytes(llm.detokenize([i], special=True))

    def render(messages: list[dict[str, str]]) -> str:
        return render_template(template or "", messages, bos, eos, True)

    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)))
    generation = []
    for name, spec in corpus.GENERATION_CANDIDATES.items():
        if isinstance(spec, list) and not template:
            continue
        case = _generation_case(name, spec, exact, llm, tok, piece_bytes, render, set(eog), add_bos, bos_id)
        if case is not None and case["messages"] and case["messages"][0]["role"] == "system":
            # the system message must matter: without it the exact greedy answer differs
            alone = _generation_case(
                name, case["messages"][1:], exact, llm, tok, piece_bytes, render, set(eog), add_bos, bos_id
            )
            case["system_changes_answer"] = alone is None or alone["ids"] != case["ids"]
        log(f"generation: {name}: " + (f"{len(case['ids'])} tokens {case['text']!r}" if case else "no case"))
        if case is not None:
            generation.append(case)

    # --- end of generation ----------------------------------------------------------------------
    eog_case: dict[str, Any] | None = None
    for e in [eos_id] + [i for i in eog if i != eos_id]:
        prompt = corpus.EOG_PATTERN.replace("{E}", piece(e))
        out = _greedy(llm, tok(prompt, True, True), 16, set(eog))
        if out and out[-1] in eog:
            eog_case = {"prompt": prompt, "token": e, "llama_cpp_greedy": out}
            break
    log(f"eog: {eog_case}")

    completion_ids = tok(corpus.COMPLETION_PROMPT, True, False)
    return {
        "format": FORMAT,
        "model": alias,
        "file": path.name,
        "sha256": sha256_file(path),
        "architecture": arch,
        "made": {
            "command": f"python -m stdengine.conformance.golden --model {alias}",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "llama_cpp_python": llama_cpp.__version__,
            "gguf": importlib.metadata.version("gguf"),  # the package has no __version__
            "numpy": np.__version__,
            "python": platform.python_version(),
            "seconds": round(time.time() - t0, 1),
        },
        "tokenizer": {"source": "llama.cpp (llama-cpp-python)", "cases": cases},
        "logits": {
            "source": "exact float64 reference (stdengine.conformance.exact)",
            "k": TOP_K,
            "confident_margin": CONFIDENT_MARGIN,
            "texts": ltexts,
            "llama_cpp": {"all": dist.to_dict(), "by_text": per_text},
        },
        "chat": chat,
        "eog": {"ids": eog, "case": eog_case},
        "completion": {
            "prompt": corpus.COMPLETION_PROMPT,
            "prompt_ids": completion_ids,
            "llama_cpp_greedy": _greedy(llm, completion_ids, 32, set(eog)),
        },
        "generation": {
            "source": "exact float64 reference, greedy (llama.cpp proposes, the reference confirms)",
            "min_margin": GEN_MIN_MARGIN,
            "cases": generation,
        },
        # the text of every token the checks name (top ids, generated ids, end-of-generation ids),
        # so that a server's top_logprobs, keyed by text, can be matched to the golden ids
        "pieces": {
            str(i): piece_bytes(i).decode("utf-8", errors="replace")
            for i in sorted(
                {i for t in ltexts for row in t["top_ids"] for i in row}
                | {i for c in generation for i in c["ids"]}
                | set(eog)
            )
        },
    }


def load_golden(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def write_golden(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    # mtime=0: the same data gives the same bytes, so a re-run shows no spurious git diff
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(raw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stdengine.conformance.golden",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="catalogue alias (pulled if needed)")
    ap.add_argument("--path", help="use this GGUF file instead of resolving the alias")
    ap.add_argument("--out", help="output file (default conformance/golden/ALIAS.json.gz)")
    args = ap.parse_args(argv)
    from stdengine.store import resolve_model

    path = Path(args.path) if args.path else resolve_model(args.model)
    data = make_golden(args.model, path, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out) if args.out else golden_path(args.model)
    write_golden(data, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
