"""Progress on stderr: a rich bar when stderr is a terminal, llama-bench's `--progress` lines
otherwise (`infer-bench: benchmark 2/6: prompt run 1/5`), nothing when neither applies.
stdout only ever carries the results."""

from __future__ import annotations

import sys
from typing import IO, Any


class LineProgress:
    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr

    def step(self, index: int, total: int, what: str) -> None:
        self.stream.write(f"infer-bench: benchmark {index}/{total}: {what}\n")
        self.stream.flush()

    def advance(self) -> None:
        pass


class BarProgress:
    """One bar over every timed or warm-up run of every test."""

    def __init__(self, runs: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.progress.add_task("infer-bench", total=runs)

    def __enter__(self) -> BarProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def step(self, index: int, total: int, what: str) -> None:
        self.progress.update(self.task, description=f"benchmark {index}/{total}: {what}")

    def advance(self) -> None:
        self.progress.advance(self.task)

    def print(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False, end="")
