"""The suite's machinery: checks with stable IDs, levels and statuses, planning and running them.

A check is a function of a `Context` (the engine, the golden data, the server URL). Checks are
planned from the golden data, so a parameterised ID (`tokenizer.ids:case=emoji`) names one input.
A check reports through an `Outcome`: each assertion adds a status and the worst wins. A check
that needs a capability the engine does not declare is `not_supported` and is never run; one
whose inputs are missing (no golden data for this model, no --url) is `skip`.
"""

from __future__ import annotations

import fnmatch
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stdengine.errors import UnsupportedOption

Status = Literal["pass", "warn", "fail", "skip", "not_supported"]
Level = Literal["core", "optional", "ext"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip", "not_supported")
LEVELS: tuple[Level, ...] = ("core", "optional", "ext")

# Worst wins. fail > warn > pass; skip and not_supported only win when nothing ran.
_RANK = {"not_supported": 0, "skip": 1, "pass": 2, "warn": 3, "fail": 4}


def worst(statuses: Iterable[str]) -> Status:
    best: Status = "skip"
    found = False
    for s in statuses:
        if not found or _RANK[s] > _RANK[best]:
            best = s  # type: ignore[assignment]
            found = True
    return best


class Outcome:
    """What one check found: assertions (status + message) and numbers worth reporting."""

    def __init__(self) -> None:
        self.items: list[tuple[Status, str]] = []
        self.details: dict[str, Any] = {}

    def add(self, status: Status, message: str) -> None:
        self.items.append((status, message))

    def expect(self, ok: bool, message: str, *, otherwise: Status = "fail") -> bool:
        """Record a pass when ok, else `otherwise` (fail by default). The message states what
        must hold; a failed one is marked so that it does not read like a pass."""
        self.items.append(("pass", message) if ok else (otherwise, f"NOT MET: {message}"))
        return ok

    @property
    def status(self) -> Status:
        return worst(s for s, _ in self.items) if self.items else "pass"

    def message(self) -> str:
        st = self.status
        bad = [m for s, m in self.items if s == st and st != "pass"]
        if bad:
            return "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        return "; ".join(m for s, m in self.items if s == "pass")[:400]


class Skip(Exception):
    """Raised by a check to report `skip` (its inputs are missing) with a reason."""


class NotSupported(Exception):
    """Raised by a check (or mapped from NotImplementedError) for `not_supported`."""


@dataclass
class Check:
    id: str
    level: Level
    fn: Callable[[Context, Outcome], None]
    needs: frozenset[str] = frozenset()  # engine capabilities
    engine: bool = True  # needs a loaded engine (False: HTTP checks)
    description: str = ""

    @property
    def group(self) -> str:
        return self.id.split(":", 1)[0].split(".", 1)[0]


@dataclass
class Result:
    id: str
    level: Level
    status: Status
    message: str
    duration_ms: float
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "level": self.level,
            "status": self.status,
            "message": self.message,
            "duration_ms": round(self.duration_ms, 1),
            "details": self.details,
        }


@dataclass
class Context:
    """Everything a check may use. `engine` is None when only HTTP checks run."""

    engine: Any = None
    golden: dict[str, Any] | None = None
    golden_note: str = "no golden data"
    model: str | None = None
    model_path: Path | None = None
    url: str | None = None
    api_key: str | None = None
    cache: dict[str, Any] = field(default_factory=dict)  # shared results between checks

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(getattr(self.engine, "capabilities", frozenset()))

    def need_golden(self, section: str) -> Any:
        if self.golden is None:
            raise Skip(self.golden_note)
        value = self.golden.get(section)
        if not value:
            raise Skip(f"the golden data has no '{section}' section")
        return value

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """Compute once per run (e.g. the engine's logits of a golden text) and share."""
        if key not in self.cache:
            try:
                self.cache[key] = make()
            except BaseException as e:  # remember a failure too, so each check reports it
                self.cache[key] = e
        value = self.cache[key]
        if isinstance(value, BaseException):
            raise value
        return value


def level_selected(level: Level, wanted: str) -> bool:
    return wanted == "all" or level == "core" or (wanted == "optional" and level == "optional")


def select(checks: list[Check], level: str = "core", only: str | None = None) -> list[Check]:
    """The checks a run executes: at the level asked for (core; optional adds optional; all adds
    ext) and, with --only, whose ID matches the glob (a bare word matches anywhere)."""
    out = [c for c in checks if level_selected(c.level, level)]
    if only:
        pattern = only if any(ch in only for ch in "*?[") else f"*{only}*"
        out = [c for c in out if fnmatch.fnmatchcase(c.id, pattern)]
    return out


def run_check(check: Check, ctx: Context) -> Result:
    t0 = time.perf_counter()
    out = Outcome()
    missing = sorted(check.needs - ctx.capabilities) if check.engine else []
    if check.engine and ctx.engine is None:
        status: Status = "skip"
        message = "no engine loaded (HTTP-only run)"
    elif missing:
        status, message = "not_supported", f"the engine does not declare {', '.join(missing)}"
    else:
        try:
            check.fn(ctx, out)
            status, message = out.status, out.message()
        except Skip as e:
            status, message = "skip", str(e)
        except (NotSupported, NotImplementedError) as e:
            status, message = "not_supported", str(e) or "not implemented by the engine"
        except UnsupportedOption as e:  # a sampling option the engine declares it cannot honour
            status, message = "not_supported", str(e)
        except Exception as e:  # the engine (or server) broke: that is a failure of this check
            status = "fail"
            message = f"unexpected {type(e).__name__}: {e}"
            out.details["traceback"] = traceback.format_exc(limit=6)
    return Result(check.id, check.level, status, message, (time.perf_counter() - t0) * 1e3, out.details)


def exit_status(results: list[Result]) -> int:
    """0 when no core check failed, 1 otherwise (spec/conformance.md)."""
    return 1 if any(r.status == "fail" and r.level == "core" for r in results) else 0


def counts(results: list[Result]) -> dict[str, int]:
    c: dict[str, int] = {s: 0 for s in STATUSES}
    for r in results:
        c[r.status] += 1
    return c
