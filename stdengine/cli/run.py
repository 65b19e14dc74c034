"""`infer run`: one completion, streamed to stdout; timings to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, Timings, TokenEvent, now_ms
from stdengine.cli.common import CLIENT_OPTIONS, canonical_options, load, make_emitter, resolve_cli
from stdengine.errors import InvalidRequest, UsageError, decode_utf8
from stdengine.options import Options
from stdengine.structured import check_constraint

if TYPE_CHECKING:
    from stdengine.structured import Constraint


def utf8_prompt(raw: bytes, source: str) -> str:
    """A prompt must be UTF-8 whichever way it comes (-p, -f, stdin): bytes that are not are a
    usage error naming the source and the offset, rather than guessed at or replaced."""
    return decode_utf8(raw, f"the prompt from {source}", UsageError)


def read_prompt(options: Options) -> str:
    if options.prompt is not None and options.file is not None:
        raise UsageError("give the prompt with -p (or INFER_PROMPT) or with -f (or INFER_FILE), not both")
    if options.file is not None:
        path = Path(options.file)
        if path.is_dir():
            raise UsageError(f"-f {options.file} is a directory", hint="give the path of a text file to -f")
        if not path.is_file():
            raise UsageError(f"prompt file not found: {options.file}", hint="check the path given to -f")
        text = utf8_prompt(path.read_bytes(), f"-f {options.file}")
        return text[:-1] if text.endswith("\n") else text  # as llama.cpp's -f does
    if options.prompt is not None:
        # Python hands argv bytes that are not UTF-8 over as lone surrogates: give them back
        return utf8_prompt(options.prompt.encode("utf-8", "surrogateescape"), "-p")
    if sys.stdin is None:  # started with stdin closed (<&-)
        raise UsageError("no prompt given, and stdin is closed", hint='pass one with -p "..." or -f FILE')
    if not sys.stdin.isatty():
        stdin = getattr(sys.stdin, "buffer", None)
        return utf8_prompt(stdin.read(), "stdin") if stdin is not None else sys.stdin.read()
    raise UsageError("no prompt given", hint='pass one with -p "..." or -f FILE, or pipe it on stdin')


def summary_line(done: DoneEvent) -> str:
    return timings_line(done.timings, done.finish_reason)


def timings_line(timings: Timings, finish: str) -> str:
    t = timings.to_dict()
    return (
        f"prompt: {t['prompt_n']} tokens, {t['prompt_per_second']:.1f} t/s | "
        f"generation: {t['predicted_n']} tokens, {t['predicted_per_second']:.1f} t/s | "
        f"finish: {finish}"
    )


def constraint_options(f: Any) -> Any:
    """--json-schema / --grammar / --regex: what the output must match (spec/structured.md)."""
    f = click.option(
        "--regex", default=None, metavar="REGEX", help="the output must match this regular expression"
    )(f)
    f = click.option(
        "--grammar",
        default=None,
        metavar="FILE",
        help="the output must follow this grammar (.gbnf: GBNF, .lark: Lark)",
    )(f)
    return click.option(
        "--json-schema",
        "json_schema",
        default=None,
        metavar="FILE|JSON",
        help="the output must be JSON valid for this JSON Schema (a file, or the schema itself)",
    )(f)


def constraint_from_cli(kwargs: dict[str, Any]) -> Constraint | None:
    """The constraint the flags ask for (popped from kwargs); at most one; checked before any load."""
    from stdengine.structured import Constraint, load_grammar, load_json_schema

    schema, grammar, regex = kwargs.pop("json_schema"), kwargs.pop("grammar", None), kwargs.pop("regex", None)
    given = [
        n for n, v in (("--json-schema", schema), ("--grammar", grammar), ("--regex", regex)) if v is not None
    ]
    if len(given) > 1:
        raise UsageError(f"give one of {', '.join(given)}, not several")
    if schema is not None:
        return Constraint.json_schema(load_json_schema(schema))
    if grammar is not None:
        return load_grammar(grammar)
    if regex is not None:
        return Constraint.regex(regex)
    return None


@click.command()
@canonical_options(*CLIENT_OPTIONS)
@constraint_options
@click.option("--raw", is_flag=True, help="complete the prompt exactly as given, without the chat template")
@click.option(
    "--json", "as_json", is_flag=True, help="print one JSON result object instead of streaming text"
)
def run(raw: bool, as_json: bool, **kwargs: Any) -> None:
    """Generate a completion for a prompt with any engine (default: the reference engine and the
    smollm2-135m-instruct model, pulled on first use).

    \b
    The prompt is a user message under the model's chat template when the model has one;
    --raw completes the text exactly as given (llama.cpp's -no-cnv). The completion streams to
    stdout; timings go to stderr (prompt and generation tokens per second).

    \b
    Examples:
      infer run -p "Write a haiku about the sea"
      infer run -m gemma-3-270m --raw -n 32 --temp 0 -p "The Nile, the Amazon and the"
      echo "Once upon a time" | infer run --raw -n 32
      infer run --temp 0 --json-schema '{"type": "object"}' -p "Describe Paris as JSON"
    """
    constraint = constraint_from_cli(kwargs)
    resolved = resolve_cli(kwargs, recipes=True)
    options: Options = resolved.options
    events = make_emitter(options)
    events.debug("run.start", command="run", argv=sys.argv[1:])
    events.debug("config.resolved", options=options.model_dump(), sources=resolved.sources)
    prompt = read_prompt(options)
    if prompt == "":
        raise InvalidRequest("the prompt is empty", hint="give some text with -p, -f or stdin")
    engine = load(resolved, events).engine
    try:
        if not raw and engine.has_chat_template():
            messages = [{"role": "system", "content": options.system}] if options.system else []
            messages.append({"role": "user", "content": prompt})
            request = GenerateRequest(
                messages=messages, sampling=SamplingParams.from_options(options), constraint=constraint
            )
        else:
            if options.system:
                raise UsageError(
                    "--system needs a chat template, and this run has none",
                    hint="drop --raw, or put the system text into the prompt",
                )
            request = GenerateRequest(
                prompt=prompt, sampling=SamplingParams.from_options(options), constraint=constraint
            )
        check_constraint(engine, request)
        pieces: list[str] = []
        done: DoneEvent | None = None
        received = 0
        t_start = now_ms()
        t_first: float | None = None
        try:
            for ev in engine.generate(request):
                if isinstance(ev, TokenEvent):
                    if ev.id >= 0:
                        received += 1
                        t_first = t_first or now_ms()
                    pieces.append(ev.text)
                    if not as_json and ev.text:
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                else:
                    done = ev
        except KeyboardInterrupt:
            # Ctrl-C: the timings of what was generated so far, then "interrupted" (exit 130)
            timings = engine.partial_timings()
            if timings is None:  # the engine cannot say: what this loop received
                t_now = now_ms()
                timings = Timings(
                    prompt_ms=(t_first or t_now) - t_start,
                    predicted_n=received,
                    predicted_ms=t_now - t_first if t_first else 0.0,
                )
            if not as_json:
                sys.stdout.write("\n")
                sys.stdout.flush()
            events.info(
                "generation.done",
                finish_reason="interrupted",
                summary=timings_line(timings, "interrupted"),
                timings=timings.to_dict(),
            )
            raise
        assert done is not None, "an engine must end generate() with a DoneEvent"
        if not as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()
        events.info(
            "generation.done",
            finish_reason=done.finish_reason,
            summary=summary_line(done),
            timings=done.timings.to_dict(),
        )
        if as_json:
            info = engine.info()
            click.echo(
                json.dumps(
                    {
                        "engine": info.name,
                        "model": info.model.get("path", options.model),
                        "text": "".join(pieces),
                        "finish_reason": done.finish_reason,
                        "stop": done.stop,
                        "usage": {
                            "prompt_tokens": done.usage.prompt_tokens,
                            "completion_tokens": done.usage.completion_tokens,
                            "total_tokens": done.usage.total_tokens,
                        },
                        "timings": done.timings.to_dict(),
                    },
                    ensure_ascii=False,
                )
            )
    finally:
        engine.close()
        events.close()
