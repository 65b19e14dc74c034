"""`GET /metrics`: llama-server's Prometheus metric set, under our prefix `stdengine:`.

llama-server counts from inside its decode loop; we count what the server sees of each request
(its DoneEvent and its tokens), which gives the same numbers for an engine that decodes one token
per step after the prompt. spec/server.md says how each one is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stdengine.adapter import DoneEvent, Engine
from stdengine.batching import BatchStats

PREFIX = "stdengine:"


@dataclass
class Metrics:
    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    busy_slots_sum: int = 0  # busy slots summed over decodes, for n_busy_slots_per_decode
    # tokens each context's KV cache holds after its last request (engines keep it for reuse)
    kv_tokens: dict[int, int] = field(default_factory=dict)
    # latencies the server sees, in seconds: (sum, count) each
    queue: list[float] = field(default_factory=lambda: [0.0, 0])
    ttft: list[float] = field(default_factory=lambda: [0.0, 0])
    itl: list[float] = field(default_factory=lambda: [0.0, 0])

    @staticmethod
    def observe(summary: list[float], seconds: float) -> None:
        summary[0] += seconds
        summary[1] += 1

    def count_decode(self, busy_slots: int) -> None:
        """One decode step (the prompt, or one generated token) while `busy_slots` were busy."""
        self.n_decode_total += 1
        self.busy_slots_sum += busy_slots

    def record(self, ctx: Engine, done: DoneEvent) -> None:
        t = done.timings
        self.prompt_tokens_total += t.prompt_n
        self.prompt_seconds_total += t.prompt_ms / 1e3
        self.tokens_predicted_total += t.predicted_n
        self.tokens_predicted_seconds_total += t.predicted_ms / 1e3
        self.kv_tokens[id(ctx)] = done.usage.prompt_tokens + done.usage.completion_tokens

    def render(
        self, *, n_ctx_total: int, processing: int, deferred: int, batch: BatchStats | None = None
    ) -> str:
        """batch: the scheduler's steps when the slots step together; they are the decodes then."""

        def rate(n: float, s: float) -> float:
            return n / s if s > 0 else 0.0

        kv_tokens = sum(self.kv_tokens.values())
        n_decode, busy_sum = (
            (batch.steps, batch.rows) if batch else (self.n_decode_total, self.busy_slots_sum)
        )
        rows: list[tuple[str, str, float, str]] = [
            ("prompt_tokens_total", "counter", self.prompt_tokens_total, "Prompt tokens evaluated."),
            (
                "prompt_seconds_total",
                "counter",
                self.prompt_seconds_total,
                "Seconds spent evaluating prompts.",
            ),
            ("tokens_predicted_total", "counter", self.tokens_predicted_total, "Tokens generated."),
            (
                "tokens_predicted_seconds_total",
                "counter",
                self.tokens_predicted_seconds_total,
                "Seconds spent generating tokens.",
            ),
            (
                "n_decode_total",
                "counter",
                n_decode,
                "Decode steps (batched: one per step of the slots together).",
            ),
            (
                "n_busy_slots_per_decode",
                "counter",
                rate(busy_sum, n_decode),
                "Busy slots per decode step, on average (batched: sequences per step).",
            ),
            (
                "prompt_tokens_seconds",
                "gauge",
                rate(self.prompt_tokens_total, self.prompt_seconds_total),
                "Prompt tokens per second, on average.",
            ),
            (
                "predicted_tokens_seconds",
                "gauge",
                rate(self.tokens_predicted_total, self.tokens_predicted_seconds_total),
                "Generated tokens per second, on average.",
            ),
            (
                "kv_cache_usage_ratio",
                "gauge",
                rate(kv_tokens, n_ctx_total),
                "Share of all slots' context held by KV caches (1 = full).",
            ),
            ("kv_cache_tokens", "gauge", kv_tokens, "Tokens held by the slots' KV caches."),
            ("requests_processing", "gauge", processing, "Requests holding a slot now."),
            ("requests_deferred", "gauge", deferred, "Requests waiting in the queue for a slot."),
        ]
        if batch is not None:
            rows += [
                (
                    "batch_tokens_per_decode",
                    "gauge",
                    rate(batch.tokens, batch.steps),
                    "Tokens per batched step, on average.",
                ),
                ("batch_size_max", "gauge", batch.max_rows, "Most sequences in one batched step."),
            ]
        out = []
        for name, kind, value, help_text in rows:
            out.append(f"# HELP {PREFIX}{name} {help_text}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            out.append(f"{PREFIX}{name} {_number(value)}")
        summaries = [
            ("queue_seconds", self.queue, "Time requests waited for a slot."),
            ("time_to_first_token_seconds", self.ttft, "Time from a request's arrival to its first token."),
            ("inter_token_latency_seconds", self.itl, "Time between a request's consecutive tokens."),
        ]
        if batch is not None:
            summaries.append(
                (
                    "batch_step_seconds",
                    [batch.seconds, batch.steps],
                    "Time each batched step's evaluation took.",
                )
            )
        for name, (total, count), help_text in summaries:
            out.append(f"# HELP {PREFIX}{name} {help_text}")
            out.append(f"# TYPE {PREFIX}{name} summary")
            out.append(f"{PREFIX}{name}_sum {_number(total)}")
            out.append(f"{PREFIX}{name}_count {_number(count)}")
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
