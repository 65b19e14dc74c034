"""The conformance suite's own tests: the machinery (statuses, selection, metrics, report bundle),
the exact reference on a tiny synthetic model, and the HTTP checks against small stdlib servers.
No catalogue model is needed here; tests/test_conformance_engines.py runs real engines.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from stdengine.conformance import golden as golden_mod
from stdengine.conformance import metrics
from stdengine.conformance.report import write_bundle
from stdengine.conformance.runner import find_golden, plan, run_suite
from stdengine.conformance.suite import Check, Context, Outcome, Result, exit_status, run_check, select, worst

GOLDEN = Path(golden_mod.GOLDEN_DIR)


# --- statuses and selection -------------------------------------------------------------------
def test_worst_wins():
    assert worst(["pass", "warn", "pass"]) == "warn"
    assert worst(["pass", "fail", "warn"]) == "fail"
    assert worst(["pass", "skip", "not_supported"]) == "pass"  # skips never hide a pass or a fail
    assert worst(["skip", "not_supported"]) == "skip"
    o = Outcome()
    o.expect(True, "a")
    o.expect(False, "b", otherwise="warn")
    assert o.status == "warn" and o.message() == "NOT MET: b"


def _check(id: str, level: str = "core", needs: frozenset[str] = frozenset(), fn: Any = None) -> Check:
    return Check(id, level, fn or (lambda ctx, out: out.add("pass", "ok")), needs)  # type: ignore[arg-type]


def test_select_by_level_and_pattern():
    cs = [_check("tokenizer.ids:case=a"), _check("generation.seed", "optional"), _check("x.y", "ext")]
    assert [c.id for c in select(cs, "core")] == ["tokenizer.ids:case=a"]
    assert len(select(cs, "optional")) == 2 and len(select(cs, "all")) == 3
    assert [c.id for c in select(cs, "all", "gen*")] == ["generation.seed"]
    assert [c.id for c in select(cs, "all", "case=a")] == ["tokenizer.ids:case=a"]  # bare word: anywhere


def test_missing_capability_is_not_supported_and_errors_fail():
    class E:
        capabilities = frozenset({"tokenize"})

    ctx = Context(engine=E())
    r = run_check(_check("logits.kl:text=all", needs=frozenset({"logits"})), ctx)
    assert r.status == "not_supported" and "logits" in r.message

    def boom(ctx: Context, out: Outcome) -> None:
        raise RuntimeError("engine crashed")

    r = run_check(_check("generation.eog", fn=boom), ctx)
    assert r.status == "fail" and "engine crashed" in r.message

    def not_impl(ctx: Context, out: Outcome) -> None:
        raise NotImplementedError

    assert run_check(_check("errors.empty_prompt", fn=not_impl), ctx).status == "not_supported"
    assert (
        run_check(
            _check("chat.template:conv=single,gen=1", fn=lambda c, o: c.need_golden("chat")), ctx
        ).status
        == "skip"
    )


def test_exit_status_counts_only_core_failures():
    def res(level: str, status: str) -> Result:
        return Result("a.b", level, status, "", 0.0)  # type: ignore[arg-type]

    assert exit_status([res("core", "pass"), res("optional", "fail"), res("core", "warn")]) == 0
    assert exit_status([res("core", "fail")]) == 1


# --- metrics ------------------------------------------------------------------------------------
def _golden_text_from(ref_logits: np.ndarray, k: int = 5) -> dict[str, Any]:
    ids, lps, tails = metrics.top_k_record(metrics.log_softmax(ref_logits), k)
    return {"name": "t", "ids": [], "top_ids": ids, "top_logprobs": lps, "tail_logprob": tails}


def test_restricted_kl_is_zero_for_the_reference_and_a_lower_bound_of_full_kl():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(20, 50)) * 3
    text = _golden_text_from(ref)
    same = metrics.restricted_kl(text["top_ids"], text["top_logprobs"], text["tail_logprob"], ref)
    assert np.all(np.abs(same) < 1e-5)
    other = ref + rng.normal(size=ref.shape)
    kl_r = metrics.restricted_kl(text["top_ids"], text["top_logprobs"], text["tail_logprob"], other)
    lp, lq = metrics.log_softmax(ref), metrics.log_softmax(other)
    kl_full = (np.exp(lp) * (lp - lq)).sum(-1)
    assert np.all(kl_r <= kl_full + 1e-5) and kl_r.mean() > 0.01


def test_distance_counts_confident_top1_misses():
    ref = np.zeros((3, 10))
    ref[0, 1] = 5.0  # confident
    ref[1, 2] = 5.0  # confident
    ref[2, 3] = 0.2  # near tie: not confident
    text = _golden_text_from(ref)
    eng = ref.copy()
    eng[1, 7] = 9.0  # the engine picks another token at a confident position
    eng[2, 4] = 1.0  # and at the near tie (not counted)
    d = metrics.distance([text], [eng])
    assert d.n_confident == 2 and d.top1_misses == 1 and d.top1_agreement == 0.5


def test_bounds():
    assert metrics.kl_bound(0.002) == pytest.approx(0.004)  # llama.cpp + 0.002
    assert metrics.kl_bound(0.02) == pytest.approx(0.03)  # 1.5 x llama.cpp
    assert metrics.top1_miss_bound(0.0) == pytest.approx(0.01)


# --- golden data --------------------------------------------------------------------------------
@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_committed_golden_data(alias):
    path = GOLDEN / f"{alias}.json.gz"
    assert path.stat().st_size < 1_000_000
    g = golden_mod.load_golden(path)
    assert g["format"] == golden_mod.FORMAT and len(g["sha256"]) == 64
    texts = g["logits"]["texts"]
    assert sum(len(t["top_ids"]) for t in texts) >= 300
    long = next(t for t in texts if t["name"] == "long")
    assert len(long["ids"]) > 600  # longer than Gemma's 512-token window
    for t in texts:
        assert len(t["top_ids"]) == len(t["ids"]) and len(t["top_ids"][0]) == g["logits"]["k"]
        assert all(lps == sorted(lps, reverse=True) for lps in t["top_logprobs"][:20])
    ll = g["logits"]["llama_cpp"]["all"]
    assert 0 < ll["kl_mean"] < 0.05 and ll["n_confident"] > 100
    assert g["eog"]["case"] and g["eog"]["case"]["llama_cpp_greedy"][-1] in g["eog"]["ids"]
    assert all(c["llama_cpp_python_agrees"] for c in g["chat"]["cases"])
    assert "made" in g and g["made"]["command"].endswith(alias)


def test_golden_found_by_alias_and_refused_for_another_file(tmp_path):
    g, note = find_golden("smollm2-135m-instruct", None)  # a remote engine: trusted by name
    assert g is not None and "by name" in note
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF not the model")
    g, note = find_golden("smollm2-135m-instruct", other)
    assert g is None and "SHA256" in note
    g, note = find_golden("no-such-model", other)
    assert g is None and "no golden data" in note


# --- the exact reference on a tiny synthetic model ----------------------------------------------
def _independent_llama(path: Path, tokens: list[int]) -> np.ndarray:
    """A second, deliberately different implementation: token by token with a KV cache, complex
    numbers for the rotation. Same math as exact.py, none of its code."""
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(path))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.")}
    W = {
        t.name: dequantize(t.data, t.tensor_type)
        .astype(np.float64)
        .reshape(tuple(reversed([int(n) for n in t.shape])))
        for t in r.tensors
    }
    n_layer, n_head, n_kv = (
        f["llama.block_count"],
        f["llama.attention.head_count"],
        f["llama.attention.head_count_kv"],
    )
    d = f["llama.embedding_length"] // n_head
    eps, base = f["llama.attention.layer_norm_rms_epsilon"], f["llama.rope.freq_base"]

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x * w / math.sqrt(float(np.dot(x, x)) / len(x) + eps)

    def rot(v: np.ndarray, pos: int) -> np.ndarray:
        c = v[0::2] + 1j * v[1::2]  # adjacent pairs as complex numbers
        c = c * np.exp(1j * pos * base ** (-np.arange(d // 2) * 2 / d))
        out = np.empty_like(v)
        out[0::2], out[1::2] = c.real, c.imag
        return out

    K: list[list[list[np.ndarray]]] = [[] for _ in range(n_layer)]
    V: list[list[list[np.ndarray]]] = [[] for _ in range(n_layer)]
    rows = []
    for pos, tok in enumerate(tokens):
        x = W["token_embd.weight"][tok].copy()
        for il in range(n_layer):
            p = f"blk.{il}."
            h = norm(x, W[p + "attn_norm.weight"])
            q = (W[p + "attn_q.weight"] @ h).reshape(n_head, d)
            k = (W[p + "attn_k.weight"] @ h).reshape(n_kv, d)
            v = (W[p + "attn_v.weight"] @ h).reshape(n_kv, d)
            K[il].append([rot(k[j], pos) for j in range(n_kv)])
            V[il].append([v[j] for j in range(n_kv)])
            heads = []
            for hh in range(n_head):
                j = hh * n_kv // n_head
                qr = rot(q[hh], pos)
                s = np.array([qr @ K[il][t][j] for t in range(pos + 1)]) / math.sqrt(d)
                a = np.exp(s - s.max())
                a /= a.sum()
                heads.append(sum(a[t] * V[il][t][j] for t in range(pos + 1)))
            x = x + W[p + "attn_output.weight"] @ np.concatenate(heads)
            m = norm(x, W[p + "ffn_norm.weight"])
            g = W[p + "ffn_gate.weight"] @ m
            x = x + W[p + "ffn_down.weight"] @ ((g / (1 + np.exp(-g))) * (W[p + "ffn_up.weight"] @ m))
        rows.append(W["output.weight"] @ norm(x, W["output_norm.weight"]))
    return np.array(rows)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from gguf_factory import write_llama_gguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_llama_gguf(path, weight_type="Q8_0", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    return path


TINY_TOKENS = [1, 5, 9, 17, 33, 4, 60, 12, 8, 40, 41, 42]


def test_exact_reference_matches_an_independent_computation(tiny_llama):
    from stdengine.conformance.exact import ExactModel

    exact = ExactModel(tiny_llama).logits(TINY_TOKENS)
    independent = _independent_llama(tiny_llama, TINY_TOKENS)
    assert exact.shape == independent.shape == (len(TINY_TOKENS), 64)
    np.testing.assert_allclose(exact, independent, rtol=1e-9, atol=1e-9)


def test_exact_reference_matches_llama_cpp_on_the_tiny_model(tiny_llama):
    llama_cpp = pytest.importorskip("llama_cpp")
    from stdengine.conformance.exact import ExactModel

    exact = ExactModel(tiny_llama).logits(TINY_TOKENS)
    llm = llama_cpp.Llama(str(tiny_llama), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(TINY_TOKENS)
    theirs = np.array(llm.scores[: len(TINY_TOKENS)], dtype=np.float64)
    lp, lq = metrics.log_softmax(exact), metrics.log_softmax(theirs)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    # llama.cpp quantizes activations to 8 bits for Q8_0 dots and keeps an f16 KV cache
    assert kl.max() < 1e-3, kl
    # ...but a RoPE or mask error would not be this close: shuffle positions and it is far
    scrambled = ExactModel(tiny_llama).logits(TINY_TOKENS[::-1])[::-1]
    lr = metrics.log_softmax(scrambled)
    assert (np.exp(lp) * (lp - lr)).sum(-1).max() > 10 * kl.max()


def _write_tiny_gemma3(
    path: Path,
    n_layer: int = 6,
    n_embd: int = 64,
    n_head: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    window: int = 4,
) -> None:
    """A tiny gemma3 GGUF: 5 local (sliding window 4) layers and 1 global, random Q8_0 weights."""
    import gguf

    rng = np.random.default_rng(1)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(60)]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3] * 4 + [1] * 60)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)

    def mat(rows: int, cols: int, scale: float = 0.1) -> None:
        return gguf.quants.quantize(
            (rng.standard_normal((rows, cols)) * scale).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
        )

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    Q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", mat(len(tokens), n_embd, 0.05), raw_dtype=Q8)
    w.add_tensor("output_norm.weight", norm(n_embd))
    for il in range(n_layer):
        p = f"blk.{il}."
        for name, shape in (
            ("attn_q", (n_head * head_dim, n_embd)),
            ("attn_k", (head_dim, n_embd)),
            ("attn_v", (head_dim, n_embd)),
            ("attn_output", (n_embd, n_head * head_dim)),
            ("ffn_gate", (n_ff, n_embd)),
            ("ffn_up", (n_ff, n_embd)),
            ("ffn_down", (n_embd, n_ff)),
        ):
            w.add_tensor(p + name + ".weight", mat(*shape), raw_dtype=Q8)
        for name, n in (
            ("attn_norm", n_embd),
            ("attn_q_norm", head_dim),
            ("attn_k_norm", head_dim),
            ("post_attention_norm", n_embd),
            ("ffn_norm", n_embd),
            ("post_ffw_norm", n_embd),
        ):
            w.add_tensor(p + name + ".weight", norm(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_exact_gemma3_matches_llama_cpp_on_a_tiny_model(tmp_path):
    """The gemma3 path (embedding scale, q/k norms, NEOX RoPE, post norms, GELU, sliding window on
    local layers with their own RoPE base) against llama.cpp on a file where the window is 4."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from stdengine.conformance.exact import ExactModel

    path = tmp_path / "tiny-gemma3.gguf"
    _write_tiny_gemma3(path)
    tokens = [2, 10, 20, 30, 40, 50, 11, 21, 31, 41, 51, 12, 22, 32]
    model = ExactModel(path)
    assert [model.is_local(il) for il in range(6)] == [True] * 5 + [False]
    exact = model.logits(tokens)
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(tokens)
    theirs = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    lp, lq = metrics.log_softmax(exact), metrics.log_softmax(theirs)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    assert kl.max() < 2e-3, kl
    # without the window (every layer global) positions past it are far from llama.cpp
    model.hp.window = 0
    lw = metrics.log_softmax(model.logits(tokens))
    kl_nowin = (np.exp(lw) * (lw - lq)).sum(-1)
    assert kl_nowin[6:].max() > 10 * kl.max()


# --- logits.stable on the reference engine and on one that returns its buffer ------------------
@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory):
    """A tiny llama model whose vocabulary spells any text in bytes (the check tokenizes a prompt)."""
    from gguf_factory import write_llama_gguf

    path = tmp_path_factory.mktemp("tiny") / "bytes.gguf"
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    write_llama_gguf(path, weight_type="Q8_0", tokens=tokens, n_embd=64, n_ff=128, n_head=4, n_head_kv=2)
    return path


def _run_logits_stable(engine_cls: Any, path: Path) -> Result:
    from stdengine.conformance.checks import plan

    from stdengine.events import null_emitter
    from stdengine.options import Options

    engine = engine_cls.load(Options(model=str(path), ctx_size=64, threads=1), null_emitter())
    try:
        ctx = Context(engine=engine)
        (check,) = [c for c in plan(ctx) if c.id == "logits.stable"]
        assert check.level == "core"
        return run_check(check, ctx)
    finally:
        engine.close()


def test_logits_stable_passes_an_engine_that_returns_its_own_arrays(tiny_bytes):
    from stdengine.reference.adapter import ReferenceEngine

    r = _run_logits_stable(ReferenceEngine, tiny_bytes)
    assert r.status == "pass", r.message


def test_logits_stable_fails_an_engine_that_returns_its_logits_buffer(tiny_bytes):
    from stdengine.reference.adapter import ReferenceEngine

    class SharesBuffer(ReferenceEngine):
        """The bug of issue 13: the last-token logits are the context's buffer, which the next
        decode() overwrites."""

        def decode(self, tokens: Any, all_logits: bool = False) -> np.ndarray:
            out = self.ctx.decode(list(tokens), all_logits=all_logits)
            self.tokens.extend(tokens)
            return out

    r = _run_logits_stable(SharesBuffer, tiny_bytes)
    assert r.status == "fail"
    assert "share memory" in r.message or "sharing memory" in r.message
    assert "changed:" in r.message and "hint" in r.details


# --- report bundle ------------------------------------------------------------------------------
def test_report_bundle(tmp_path):
    from stdengine.conformance.report import bundle_meta

    results = [
        Result("tokenizer.ids:case=a", "core", "pass", "ok", 1.0),
        Result("logits.kl:text=all", "core", "fail", "mean KL 0.5 <&> bound", 2.0, {"x": 1}),
        Result("generation.seed", "optional", "warn", "seed ignored", 3.0),
        Result("chat.template:conv=single,gen=1", "core", "not_supported", "no chat_template", 0.0),
    ]
    meta = bundle_meta(
        {"name": "toy", "version": "1", "model": {"arch": "llama"}}, "toy", "m", "golden m", None, "all", None
    )
    d = write_bundle(tmp_path / "rep", results, meta)
    data = json.loads((d / "results.json").read_text())
    assert data["exit_status"] == 1 and data["summary"]["fail"] == 1 and data["groups"]["logits"] == "fail"
    assert [r["id"] for r in data["results"]] == [r.id for r in results]
    root = ET.parse(d / "junit.xml").getroot()
    assert root.get("tests") == "4" and root.get("failures") == "1" and root.get("skipped") == "1"
    assert root.find(".//testcase[@name='logits.kl:text=all']/failure") is not None
    summary = (d / "summary.md").read_text()
    assert "FAIL" in summary and "`logits.kl:text=all`" in summary
    yaml_text = (d / "ENGINE.yaml").read_text()
    assert 'engine: "toy"' in yaml_text and "machine:" in yaml_text and 'model: "m"' in yaml_text
    assert f'commit: "{data["commit"]}"' in yaml_text and data["commit"]


def test_results_table_from_bundles(tmp_path, capsys):
    from stdengine.conformance import results_table
    from stdengine.conformance.report import bundle_meta

    def bundle(name: str, build: str, results: list[Result]) -> None:
        info = {"name": name, "version": "1", "build": build}
        meta = bundle_meta(info, name, "m1", "golden m1", None, "core", None)
        write_bundle(tmp_path / f"{name}-m1", results, meta)

    kl = {"engine": {"kl_mean": 0.00201}, "llama_cpp": {"kl_mean": 0.00199}}
    bundle(
        "good",
        "isa=avx512",
        [
            Result("tokenizer.ids:case=a", "core", "pass", "ok", 1.0),
            Result("logits.kl:text=all", "core", "pass", "ok", 1.0, kl),
            Result("chat.template:conv=single,gen=1", "core", "skip", "no template", 0.0),
        ],
    )
    bundle("bad", "CPU AMX_INT8=0", [Result("logits.stable", "core", "fail", "changed", 1.0)])
    assert results_table.main([str(tmp_path)]) == 1  # a bundle with a failing core check
    out = capsys.readouterr().out
    assert out == (tmp_path / "results.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| bad") or line.startswith("| good")]
    assert rows == [
        "| bad | CPU AMX_INT8=0 | m1 | 1 fail | — | `logits.stable` | — |",
        "| good | isa=avx512 | m1 | 2 pass, 1 skip | — | — | 0.00201 (0.00199) |",
    ]
    from stdengine.conformance.report import machine, source_commit

    header = out.splitlines()[0]
    assert f"at commit {source_commit()} on {machine()['cpu']}, {machine()['cores']} cores" in header

    (tmp_path / "bad-m1" / "results.json").unlink()
    assert results_table.main([str(tmp_path)]) == 0


def test_results_table_run_fails_when_a_run_does_not_complete(tmp_path):
    from stdengine.conformance import results_table

    stale = tmp_path / "nosuch-m1"
    stale.mkdir()
    (stale / "results.json").write_text("{}")
    bad = results_table.run_all(tmp_path, "core", (("nosuch", "m1"),))
    assert bad == ["nosuch on m1 (exit status 2)"]  # unknown engine: a usage error
    assert not stale.exists()  # a stale bundle is never reported as this run's


# --- the command's usage errors -----------------------------------------------------------------
def _infer_conformance(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "conformance", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_refuses_a_report_path_before_running(tiny_llama, tmp_path):
    # an existing file failed with an internal error (exit 1, as for a failed check) after the suite
    (tmp_path / "file").write_text("keep")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").mkdir()
    for report, message in [
        (tmp_path / "file", "is not a directory"),
        (tmp_path / "file" / "sub", "is not a directory"),
        ("", "is not a directory"),
        (tmp_path / "old", "results.json is not a file"),
    ]:
        r = _infer_conformance(
            "-e", "reference", "-m", str(tiny_llama), "--only", "logits", "--report", str(report)
        )
        assert r.returncode == 2, (report, r.stderr)
        assert message in r.stderr and "hint:" in r.stderr, (report, r.stderr)
        assert "model.loaded" not in r.stderr and "internal error" not in r.stderr  # refused first
    assert (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "old"]


def test_cli_only_that_selects_no_check_is_a_usage_error(tiny_llama, tmp_path):
    # it ran zero checks and printed PASS, exit 0
    rep = tmp_path / "rep"
    r = _infer_conformance(
        "-e", "reference", "-m", str(tiny_llama), "--only", "nosuchxyz", "--report", str(rep)
    )
    assert r.returncode == 2, r.stderr
    assert "--only 'nosuchxyz' matches no check" in r.stderr and "groups are batch, chat," in r.stderr
    assert "PASS" not in r.stdout and "conformance.check" not in r.stderr and not rep.exists()
    r = _infer_conformance("-e", "reference", "-m", str(tiny_llama), "--only", "tokeniser", "--list")
    assert r.returncode == 2 and "closest: tokenizer" in r.stderr and r.stdout == ""


def test_only_matching_another_level_says_which():
    from stdengine.cli.conformance import _no_check_selected
    from stdengine.errors import UsageError

    cs = [_check("tokenizer.ids:case=a"), _check("generation.seed", "optional"), _check("x.y", "ext")]
    with pytest.raises(UsageError, match="matches 1 optional check") as e:
        _no_check_selected(cs, "core", "seed")
    assert e.value.hint == "add --level optional"
    with pytest.raises(UsageError, match="matches 1 ext check") as e:
        _no_check_selected(cs, "optional", "x.y")
    assert e.value.hint == "add --level all"


# --- HTTP checks against small stdlib servers ---------------------------------------------------
_busy = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    broken = False
    key = "sekrit"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: Any, ctype: str = "application/json") -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _error(self, status: int, message: str) -> None:
        if self.broken:  # the framework's default instead of the OpenAI envelope
            self._send(422 if status == 400 else status, {"detail": message})
        else:
            self._send(
                status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}
            )

    def do_GET(self) -> None:
        models = [{"id": "toy", "object": "model"}]
        self._send(200, {"data": models} if self.broken else {"object": "list", "data": models})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            return self._error(401, "bad key")
        try:
            body = json.loads(raw)
        except ValueError:
            return self._error(400, "bad json")
        if not isinstance(body.get("temperature", 0), (int, float)):
            return self._error(400, "bad temperature")
        chat = self.path.endswith("/chat/completions")
        if chat and "messages" not in body:
            return self._error(400, "no messages")
        if not self.broken and ("response_format" in body or "tools" in body):
            # the broken toy ignores them instead
            return self._error(400, "response_format and tools are not supported")
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if self.broken and chat:
            # one request at a time: a second concurrent one is turned away
            if not _busy.acquire(blocking=False):
                return self._send(503, {"error": {"message": "busy", "type": "server_error"}})
            try:
                time.sleep(0.3)
            finally:
                _busy.release()
        if not body.get("stream"):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": "hi there", "finish_reason": "stop"}
            )
            return self._send(
                200,
                {
                    "id": "x",
                    "object": ("chat.completions" if self.broken else "chat.completion")
                    if chat
                    else "text_completion",
                    "created": 1,
                    "model": "toy",
                    "choices": [choice],
                    "usage": usage,
                },
            )
        obj = "chat.completion.chunk" if chat else "text_completion"
        chunks = []
        for i, word in enumerate(["hi", " there"]):
            delta = {"delta": {"content": word}} if chat else {"text": word}
            chunks.append(
                {
                    "id": "x",
                    "object": obj,
                    "created": 1,
                    "choices": [{"index": 0, **delta, "finish_reason": "stop" if i == 1 else None}],
                }
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({"id": "x", "object": obj, "created": 1, "choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
        if not self.broken:
            text += "data: [DONE]\n\n"
        self._send(200, text.encode(), "text/event-stream")


def _serve(broken: bool):
    handler = type("H", (_Handler,), {"broken": broken})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("broken", [False, True])
def test_http_checks(broken):
    server = _serve(broken)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        results = run_suite(Context(url=url, api_key="sekrit", model="toy"), level="all")
    finally:
        server.shutdown()
    status = {r.id: r.status for r in results}
    assert set(status) == {c.id for c in plan(Context(url=url))}
    # the toy model has no golden data: the checks that compare with it skip, saying so
    # (tests/test_conformance_http.py runs them against a real model)
    skipped = {r.id for r in results if r.status == "skip"}
    assert all(r.message == "no golden data" for r in results if r.status == "skip")
    assert {i.split(":")[0] for i in skipped} == {
        "http.generation.golden",
        "http.temperature0.repeat",
        "http.max_tokens",
        "http.stop",
        "http.stream.equals",
        "http.stream.incremental",
        "http.logprobs.kl",
        "http.logprobs.chat",
        "http.sampler",
        "http.seed",
        "http.eog",
    }
    structured = {i for i in status if i.startswith("http.structured.")}
    assert structured
    if not broken:
        # the toy refuses response_format and tools (400): not supported, never a failure
        assert {status[i] for i in structured} == {"not_supported"}
        assert all(s == "pass" for i, s in status.items() if i not in skipped | structured), [
            r.to_dict() for r in results if r.status not in ("pass", "skip")
        ]
    else:
        failing = {i for i, s in status.items() if s == "fail"}
        # the broken toy ignores response_format and tools: its answers are not JSON
        assert failing == structured | {
            "http.models",
            "http.chat",
            "http.concurrent:n=4",
            "http.chat.stream",
            "http.completions.stream",
            "http.chat.stream.usage",
            "http.errors.bad_json",
            "http.errors.bad_param",
            "http.errors.auth",
        }


def test_http_auth_check_skips_without_a_key():
    server = _serve(False)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        results = run_suite(Context(url=url), level="all", only="http.errors.auth")
    finally:
        server.shutdown()
    assert [r.status for r in results] == ["skip"]
