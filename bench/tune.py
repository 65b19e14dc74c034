"""`infer bench tune`: find the fastest options an engine honours for one model on this machine,
check them against the conformance core, and write them as a recipe (spec/recipes.md).

The search is a coordinate search: starting from the engine's defaults, each option in turn is
tried at each value of a small space (threads 1..CPUs, ubatch 64..512, ...) with the others kept
at the best so far; a value replaces the current one only when its median beats it by more than
`min_gain` and its samples are all faster than the current one's (beyond the noise). Passes
repeat until one changes nothing (the gains have flattened) or the budget is spent. Each option
is judged by the test it affects (threads: generation; threads_batch and the batch sizes: the
prompt; the others: both), and the candidates of one option, the current setting among them,
are measured afresh in interleaved rounds (A B C, B C A, ...) so that a machine whose speed
drifts favours none of them: a value is only ever compared with measurements taken beside it,
never with the current setting's from an earlier option or pass. Finally the defaults and the
tuned options are measured in alternation on llama-bench's pp512 and tg128, in the same run:
options that did not help on the test they affect go back to their defaults, so the recipe is
never slower than the defaults beyond noise. Then the conformance core runs with the tuned
options; a setting that fails it loses options (FALLBACK_ORDER) until it passes.

The budget covers all of it: before each measurement the search checks that the measurement, the
final comparison and the conformance check still fit, each estimated from what this run has
measured (the slowest measurement so far; the slowest load and prompt and the slowest generation
rate for the final comparison; for the conformance check, CONFORMANCE_TOKENS single-token decodes
at the best setting's generation rate and one load).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stdengine.bench.runner import TokenSource, bos_token, run_gen, run_prompt

from stdengine.errors import InferError, UsageError

# what each tunable option affects: "pp" the prompt, "tg" generation, "both"
AFFECTS = {
    "threads": "tg",
    "threads_batch": "pp",
    "ubatch_size": "pp",
    "batch_size": "pp",
    "flash_attn": "both",
    "cache_type_k": "both",
    "n_gpu_layers": "both",
}

# The conformance core's cost in single-token decodes of the setting it checks, besides one load
# and prompt: its ~100 checks decode tokens one at a time or in small batches and evaluate the
# exact float64 reference, whose cost grows with the model as the engine's decode time does. On
# the project's 2-core EPYC (quiet, 2026-12-01) the checks took 94-100% of the time this reserved
# (SmolLM2/llamacpp, Gemma-3/reference, Gemma-3/llamacpp; spec/recipes.md, "Budget measurements").
CONFORMANCE_TOKENS = 4000

# injectable for the tests (a fake engine's time is simulated)
clock_ns: Callable[[], int] = time.perf_counter_ns
monotonic: Callable[[], float] = time.monotonic


def space(name: str, cpus: int, n_prompt: int, gpu: bool) -> list[Any]:
    """The values worth trying for an option on this machine."""
    if name in ("threads", "threads_batch"):
        values = {cpus, max(1, cpus // 2), *(n for n in (1, 2, 4, 8, 16, 32, 64) if n <= cpus)}
        return sorted(values)
    if name == "ubatch_size":
        return [u for u in (32, 64, 128, 256, 512) if u <= max(n_prompt, 32)]
    if name == "batch_size":
        # every batch of the prompt's size or more runs it in one call: the same setting for the
        # test, so only the default stands for them (two names for one setting differ by noise)
        return [b for b in (128, 256, 512) if b < n_prompt] + [2048]
    if name == "flash_attn":
        return [False, True]
    if name == "cache_type_k":
        return ["f16", "q8_0"]
    if name == "n_gpu_layers":
        return [0, -1] if gpu else [0]
    raise KeyError(name)


def defaults(cls: Any) -> dict[str, Any]:
    """The options a run without a recipe gets: the standard's defaults, and what the engine
    decides for those left null (threads: physical cores)."""
    from stdengine.options import DEFAULTS, Options

    values = {name: DEFAULTS[name] for name in AFFECTS}
    decided = cls.decided_defaults(Options())
    values["threads"] = decided.get("threads") or _physical()
    values["threads_batch"] = decided.get("threads_batch") or values["threads"]
    return values


def _physical() -> int:
    from stdengine.bench.params import physical_cores

    return physical_cores()


def tunable(cls: Any, gpu: bool) -> list[str]:
    """The options this engine honours (and may change) among those worth tuning."""
    out = []
    for name in AFFECTS:
        if name not in cls.honoured_options():
            continue
        if name == "n_gpu_layers" and not gpu:
            continue
        out.append(name)
    return out


@dataclass
class Samples:
    pp: list[float] = field(default_factory=list)
    tg: list[float] = field(default_factory=list)

    def median(self, test: str) -> float | None:
        xs = self.pp if test == "pp" else self.tg
        return statistics.median(xs) if xs else None


def _key(config: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(config.items()))


class Measurer:
    """Loads the engine with a setting, times one prompt of n_prompt tokens and/or n_gen
    single-token decodes (llama-bench's tests, random tokens, after a short untimed warm-up)."""

    def __init__(
        self, cls: Any, model_path: str | None, events: Any, engine_args: dict[str, str], n_prompt: int
    ) -> None:
        self.cls = cls
        self.model_path = model_path
        self.events = events
        self.engine_args = engine_args
        self.n_prompt = n_prompt
        self.loads = 0
        # what the last run cost: seconds outside the timed generation, generation seconds and tokens
        self.last_other_s = 0.0
        self.last_tg: tuple[float, int] = (0.0, 0)

    def run(
        self, config: dict[str, Any], pp: bool, n_gen: int, tg_cap_s: float = float("inf")
    ) -> tuple[float | None, float | None]:
        """pp and tg t/s (None for a test not run). Generation stops after tg_cap_s seconds (at
        least one token), and its rate is that of the tokens decoded by then: a setting that makes
        generation crawl (threads fighting for a busy machine's cores) costs at most the cap."""
        from stdengine import registry
        from stdengine.options import Options

        values: dict[str, Any] = {
            "engine": self.cls.name,
            "model": self.model_path,
            "engine_args": dict(self.engine_args),
            **config,
        }
        if "ctx_size" in self.cls.honoured_options():
            values["ctx_size"] = self.n_prompt + max(n_gen, 1) + 16
        start = monotonic()
        engine = registry.load(Options.model_validate(values), self.events, set(config)).engine
        self.loads += 1
        tg_s, done = 0.0, 0
        try:
            info = engine.info()
            n_vocab = info.model.get("n_vocab")
            if not n_vocab and self.model_path:
                from stdengine.bench.record import model_fields

                n_vocab = model_fields(self.model_path)["n_vocab"]
            src = TokenSource(int(n_vocab or 2), bos_token(engine))
            run_prompt(engine, min(16, self.n_prompt), int(config.get("batch_size") or 2048), src)
            run_gen(engine, 1, src)
            pp_ts = tg_ts = None
            if pp:
                engine.reset()
                t0 = clock_ns()
                run_prompt(engine, self.n_prompt, int(config.get("batch_size") or 2048), src)
                pp_ts = self.n_prompt * 1e9 / max(clock_ns() - t0, 1)
            if n_gen > 0:
                engine.reset()
                t0 = clock_ns()
                token = src.bos if src.bos is not None else src.random()
                while done < n_gen and (done == 0 or (clock_ns() - t0) / 1e9 < tg_cap_s):
                    engine.decode([token])
                    token = src.random()
                    done += 1
                tg_s = (clock_ns() - t0) / 1e9
                tg_ts = done / max(tg_s, 1e-9)
            return pp_ts, tg_ts
        finally:
            engine.close()
            self.last_tg = (tg_s, done)
            self.last_other_s = monotonic() - start - tg_s


class View:
    """What the tuner reports as it goes (the CLI shows it with rich; tests collect it)."""

    def trying(self, option: str, config: dict[str, Any], round_: int, rounds: int) -> None: ...

    def result(self, option: str, best: dict[str, Any], best_ts: dict[str, float | None]) -> None: ...

    def note(self, text: str) -> None: ...


@dataclass
class Outcome:
    default: dict[str, Any]
    tuned: dict[str, Any]
    table: dict[str, dict[str, float]]  # "default"/"tuned" -> {"pp512": t/s, "tg128": t/s}
    reverted: list[str]
    evaluations: int
    search_s: float
    stopped: str  # why the search ended: "flat", "budget" or "passes" (three, still changing)
    final_rounds: int = 0  # A B rounds of the final comparison
    capped_s: float | None = None  # a generation sample of the final comparison was cut at this
    conformance: str = "not_run"  # the conformance core's verdict on the tuned options
    conformance_s: float = 0.0  # how long it took
    conformance_estimate_s: float = 0.0  # what the budget reserved for it
    total_s: float = 0.0  # search, final comparison and conformance check
    peak_rss_bytes: int = 0  # of the tuning, before the conformance check's own memory
    fell_back: list[str] = field(default_factory=list)  # options put back: the check failed with them


class Tuner:
    def __init__(
        self,
        measurer: Measurer,
        options: list[str],
        start: dict[str, Any],
        spaces: dict[str, list[Any]],
        *,
        budget_s: float,
        reps: int = 3,
        search_gen: int = 32,
        n_gen: int = 128,
        min_gain: float = 0.03,
        view: View | None = None,
        conformance: bool = False,
    ) -> None:
        self.m = measurer
        self.options = options
        self.start = dict(start)
        self.spaces = spaces
        self.budget_s = budget_s
        self.reps = reps
        self.search_gen = search_gen
        self.n_gen = n_gen
        self.min_gain = min_gain
        self.view = view or View()
        # (group, setting) -> its samples; a group is one option's rounds in one pass, and
        # settings are compared only within a group (measured side by side)
        self.samples: dict[tuple[Any, ...], Samples] = {}
        self.failed: set[tuple[Any, ...]] = set()
        self.t0 = monotonic()
        self.eval_s: list[float] = []
        self.other_s: list[float] = []  # each measurement's cost outside generation
        self.tg_token_s: list[float] = []  # seconds per generated token
        self.evaluations = 0
        # a generation sample is cut at these many seconds (search, final comparison)
        self.tg_cap_s = max(5.0, budget_s / 30)
        self.final_cap_s = max(10.0, budget_s / 15)
        self.final_reps = reps  # lowered when the budget is tight
        self.final_rounds = 0
        self.final_capped = False
        self.conformance = conformance  # reserve time for the conformance check
        self.current: dict[str, Any] = dict(start)  # the best setting so far

    # -- budget --
    def elapsed(self) -> float:
        return monotonic() - self.t0

    def eval_estimate(self) -> float:
        """The next search measurement: the slowest so far (a prompt cannot be cut, so a setting
        that slows it must not find the budget spent)."""
        return max(self.eval_s, default=0.0)

    def final_eval_estimate(self) -> float:
        """One measurement of the final comparison: the slowest load and prompt seen so far, and
        n_gen tokens at the slowest rate seen (at most the cap)."""
        other = max(self.other_s, default=0.0)
        tg = min(self.final_cap_s, self.n_gen * max(self.tg_token_s, default=0.0))
        return other + tg

    def token_s(self, config: dict[str, Any]) -> float:
        """Seconds per generated token of a setting: its median, else the median of all."""
        xs = [x for (_, k), s in self.samples.items() if k == _key(config) for x in s.tg]
        if xs:
            return 1.0 / statistics.median(xs)
        return statistics.median(self.tg_token_s) if self.tg_token_s else 0.0

    def conformance_estimate(self) -> float:
        """The conformance check of the best setting so far: one load and prompt (the slowest
        seen), and CONFORMANCE_TOKENS decodes at its generation rate. 0 when it is not run."""
        if not self.conformance:
            return 0.0
        return max(self.other_s, default=0.0) + CONFORMANCE_TOKENS * self.token_s(self.current)

    def reserve(self, rounds: int) -> float:
        """What comes after the search: `rounds` A/B rounds of the final comparison, one more
        for a re-comparison when an option goes back to its default, and the conformance check."""
        return 2 * (rounds + 1) * self.final_eval_estimate() + self.conformance_estimate()

    def can_afford(self) -> bool:
        """Room for one more search measurement and what comes after the search (the final
        comparison's repetitions go down to one before the search stops)."""
        while True:
            if self.elapsed() + self.eval_estimate() + self.reserve(self.final_reps) <= self.budget_s:
                return True
            if self.final_reps == 1:
                return False
            self.final_reps -= 1

    # -- measuring --
    def _evaluate(self, group: Any, config: dict[str, Any], tests: str) -> None:
        t = monotonic()
        try:
            pp, tg = self.m.run(
                config,
                tests in ("pp", "both"),
                self.search_gen if tests in ("tg", "both") else 0,
                self.tg_cap_s,
            )
        except Exception as e:  # a setting the engine refuses or fails with is left out, not fatal
            self.failed.add(_key(config))
            msg = e.message if isinstance(e, InferError) else f"{type(e).__name__}: {e}"
            self.view.note(f"setting {config} failed, left out: {msg}")
            return
        self.eval_s.append(monotonic() - t)
        self._cost()
        self.evaluations += 1
        s = self.samples.setdefault((group, _key(config)), Samples())
        if pp is not None:
            s.pp.append(pp)
        if tg is not None:
            s.tg.append(tg)

    def _cost(self) -> None:
        self.other_s.append(self.m.last_other_s)
        tg_s, done = self.m.last_tg
        if done:
            self.tg_token_s.append(tg_s / done)

    def _score(self, group: Any, config: dict[str, Any], tests: str, base: dict[str, Any]) -> float | None:
        """Speed relative to `base`, measured in the same group, on the tests the option affects
        (geometric mean for both)."""
        s, b = self.samples.get((group, _key(config))), self.samples.get((group, _key(base)))
        if s is None or b is None or _key(config) in self.failed:
            return None
        ratios = []
        for test in ("pp", "tg") if tests == "both" else (tests,):
            x, y = s.median(test), b.median(test)
            if x is None or y is None:
                return None
            ratios.append(x / y)
        return statistics.geometric_mean(ratios)

    def _clear(self, group: Any, config: dict[str, Any], tests: str, base: dict[str, Any]) -> bool:
        """Whether the config beats `base` beyond this group's noise: on one of the tests, its
        slowest sample is faster than base's fastest (the two ranges do not overlap)."""
        s, b = self.samples.get((group, _key(config))), self.samples.get((group, _key(base)))
        if s is None or b is None:
            return False
        for test in ("pp", "tg") if tests == "both" else (tests,):
            xs, ys = (s.pp, b.pp) if test == "pp" else (s.tg, b.tg)
            if xs and ys and min(xs) > max(ys):
                return True
        return False

    def _needed(self, group: Any, config: dict[str, Any], tests: str) -> bool:
        """Whether the config has fewer than reps samples of the tests in this group."""
        s = self.samples.get((group, _key(config)))
        if _key(config) in self.failed:
            return False
        if s is None:
            return True
        have = {"pp": len(s.pp), "tg": len(s.tg), "both": min(len(s.pp), len(s.tg))}[tests]
        return have < self.reps

    # -- the search --
    def search(self) -> tuple[dict[str, Any], str]:
        current = self.current = dict(self.start)
        stopped = "flat"
        for pass_ in range(3):
            changed = False
            for option in self.options:
                values = self.spaces[option]
                if len(values) < 2:
                    continue
                tests = AFFECTS[option]
                group = (pass_, option)
                cands = [{**current, option: v} for v in values]
                if current not in cands:
                    cands.append(dict(current))
                for r in range(self.reps):
                    # rotate the order each round so no candidate always runs first
                    order = cands[r % len(cands) :] + cands[: r % len(cands)]
                    for c in order:
                        if not self._needed(group, c, tests):
                            continue
                        if not self.can_afford():
                            self.view.note(
                                f"budget: the search stops after {self.evaluations} measurements "
                                f"({self.elapsed():.0f} s); the final comparison and the conformance "
                                f"check are estimated at {self.reserve(self.final_reps):.0f} s, the "
                                f"budget is {self.budget_s:.0f} s"
                            )
                            return current, "budget"
                        self.view.trying(option, c, r + 1, self.reps)
                        self._evaluate(group, c, tests)
                scores = [self._score(group, c, tests, current) or 0.0 for c in cands]
                i = max(range(len(cands)), key=lambda k: scores[k])
                best_score, best = scores[i], cands[i]
                gain = best_score > 1 + self.min_gain and self._clear(group, best, tests, current)
                if gain and best != current:
                    current = self.current = best
                    changed = True
                s = self.samples.get((group, _key(current)), Samples())
                self.view.result(option, current, {"pp": s.median("pp"), "tg": s.median("tg")})
            if not changed:
                break
        else:
            stopped = "passes"  # the third pass still changed something
        return current, stopped

    def compare(
        self, default: dict[str, Any], tuned: dict[str, Any], n_prompt: int
    ) -> dict[str, dict[str, float]]:
        """Defaults and tuned in alternation (A B A B) on pp n_prompt and tg n_gen: final_reps
        rounds, fewer when the budget runs out (at least one; the time of the conformance check
        and of a re-comparison is kept)."""
        runs: dict[str, Samples] = {"default": Samples(), "tuned": Samples()}
        self.final_rounds = 0
        for r in range(self.final_reps):
            if r > 0 and self.elapsed() + self.reserve(1) > self.budget_s:
                self.view.note(f"budget spent: the final comparison ran {r} of {self.final_reps} rounds")
                break
            for label, config in (("default", default), ("tuned", tuned)):
                self.view.trying("final", config, r + 1, self.final_reps)
                pp, tg = self.m.run(config, True, self.n_gen, self.final_cap_s)
                self._cost()
                self.final_capped |= self.m.last_tg[1] < self.n_gen
                runs[label].pp.append(pp or 0.0)
                runs[label].tg.append(tg or 0.0)
            self.final_rounds = r + 1
        return {
            label: {f"pp{n_prompt}": s.median("pp") or 0.0, f"tg{self.n_gen}": s.median("tg") or 0.0}
            for label, s in runs.items()
        }


def revert_losers(
    default: dict[str, Any],
    tuned: dict[str, Any],
    table: dict[str, dict[str, float]],
    n_prompt: int,
    n_gen: int,
) -> tuple[dict[str, Any], list[str]]:
    """Options whose test came out slower than the defaults' go back to their default values."""
    slower = {
        "pp": table["tuned"][f"pp{n_prompt}"] < table["default"][f"pp{n_prompt}"],
        "tg": table["tuned"][f"tg{n_gen}"] < table["default"][f"tg{n_gen}"],
    }
    out, reverted = dict(tuned), []
    for name, value in tuned.items():
        if value == default.get(name):
            continue
        affects = AFFECTS.get(name, "both")
        if (affects == "both" and (slower["pp"] or slower["tg"])) or (affects != "both" and slower[affects]):
            out[name] = default[name]
            reverted.append(name)
    return out, reverted


# When the tuned setting fails the conformance core, its options go back to their defaults one at
# a time in this order, those that change the arithmetic most first (a quantized K cache, another
# attention kernel, other batch splits), until it passes.
FALLBACK_ORDER = (
    "cache_type_k",
    "flash_attn",
    "ubatch_size",
    "batch_size",
    "n_gpu_layers",
    "threads_batch",
    "threads",
)

Check = Callable[[dict[str, Any]], tuple[str, list[str]]]


def tune(tuner: Tuner, default: dict[str, Any], n_prompt: int, check: Check | None = None) -> Outcome:
    """The search, the final comparison and (with `check`: the conformance core of a setting,
    its verdict "pass"/"fail" and the failed checks) the conformance check, inside the tuner's
    budget. A setting that fails the check loses its options one at a time (FALLBACK_ORDER),
    each time measured and checked again: this goes beyond the budget, which cannot foresee it."""
    tuned, stopped = tuner.search()
    search_s = tuner.elapsed()
    reverted: list[str] = []
    fell_back: list[str] = []
    verdict, checks_s, estimate, rss = "not_run", 0.0, 0.0, 0
    while True:
        table = tuner.compare(default, tuned, n_prompt)
        final, slower = revert_losers(default, tuned, table, n_prompt, tuner.n_gen)
        if slower:
            reverted += slower
            tuner.view.note(
                f"slower than the defaults in the final comparison, back to default: {', '.join(slower)}"
            )
            tuner.current = final
            table = tuner.compare(default, final, n_prompt)  # what the recipe now says, in the same run
        tuned = final
        rss = rss or peak_rss_bytes()  # of the tuning, before the conformance check's own memory
        if check is None:
            break
        tuner.current = tuned
        estimate = estimate or tuner.conformance_estimate()
        tuner.view.note(
            f"checking the tuned setting with the conformance core (about {tuner.conformance_estimate():.0f} s)"
        )
        t = monotonic()
        verdict, failed = check(tuned)
        checks_s += monotonic() - t
        culprits = [k for k in FALLBACK_ORDER if k in tuned and tuned[k] != default.get(k)]
        if verdict == "pass" or not culprits:
            break
        fell_back.append(culprits[0])
        tuner.view.note(
            f"the tuned setting fails the conformance core ({', '.join(failed[:3])}); "
            f"{culprits[0]} goes back to its default"
        )
        tuned = {**tuned, culprits[0]: default[culprits[0]]}
    capped = tuner.final_cap_s if tuner.final_capped else None
    outcome = Outcome(
        default, tuned, table, reverted, tuner.evaluations, search_s, stopped, tuner.final_rounds, capped
    )
    outcome.peak_rss_bytes = rss
    outcome.conformance, outcome.conformance_s, outcome.conformance_estimate_s = verdict, checks_s, estimate
    outcome.fell_back = fell_back
    outcome.total_s = tuner.elapsed()
    return outcome


def check_conformance(
    cls: Any, model_ref: str, model_path: str | None, config: dict[str, Any], events: Any
) -> tuple[str, list[str]]:
    """The conformance core (in process) with the tuned options: "pass" or "fail", and the IDs
    of the checks that failed."""
    from stdengine.conformance.runner import find_golden, run_suite
    from stdengine.conformance.suite import Context, exit_status

    from stdengine import registry
    from stdengine.options import Options

    values = {"engine": cls.name, "model": model_path, **config}
    if "ctx_size" in cls.honoured_options():
        values["ctx_size"] = 2048  # as `infer conformance` does
    engine = registry.load(Options.model_validate(values), events, set(config)).engine
    try:
        path = Path(model_path) if model_path else None
        golden, note = find_golden(model_ref, path)
        ctx = Context(engine=engine, golden=golden, golden_note=note, model=model_ref, model_path=path)
        results = run_suite(ctx, "core")
    finally:
        engine.close()
    failed = [r.id for r in results if r.status == "fail" and r.level == "core"]
    return ("pass" if exit_status(results) == 0 else "fail"), failed


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def parse_budget(text: str) -> float:
    """`90s`, `5m`, `1h`, or seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            return float(t[:-1]) * units[t[-1]]
        return float(t)
    except ValueError:
        raise UsageError(f"invalid --budget {text!r}", hint="e.g. 90s, 5m, 1h") from None
