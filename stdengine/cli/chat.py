"""`infer chat`: an interactive conversation with history and a system prompt."""

from __future__ import annotations

import sys
from typing import Any

import click

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.cli.common import CLIENT_OPTIONS, canonical_options, load, make_emitter, resolve_cli
from stdengine.cli.run import constraint_from_cli, summary_line
from stdengine.errors import InferError, UsageError
from stdengine.structured import Constraint, check_constraint

HELP = "commands: /exit (or Ctrl-D) leaves, /reset forgets the conversation, /help shows this"


@click.command()
@canonical_options(*CLIENT_OPTIONS)
@click.option(
    "--json-schema",
    "json_schema",
    default=None,
    metavar="FILE|JSON",
    help="every answer must be JSON valid for this JSON Schema (a file, or the schema itself)",
)
def chat(**kwargs: Any) -> None:
    """Talk with a model: each answer streams as it is generated, and the whole conversation is
    sent every turn under the model's chat template.

    \b
    -sys/--system sets a system prompt; -p sends a first message; --json-schema constrains
    every answer to JSON valid for a schema.
    In the conversation: /exit or Ctrl-D leaves, /reset starts over, Ctrl-C stops an answer.
    """
    constraint = constraint_from_cli(kwargs)
    resolved = resolve_cli(kwargs, recipes=True)
    options = resolved.options
    events = make_emitter(options)
    engine = load(resolved, events).engine
    check_constraint(engine, GenerateRequest(constraint=constraint))
    if not engine.has_chat_template():
        raise UsageError(
            "this model has no chat template, so `infer chat` cannot format a conversation",
            hint="pass one with --chat-template, or use `infer run --raw`",
        )
    system = [{"role": "system", "content": options.system}] if options.system else []
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    first = options.prompt
    if interactive:
        click.echo(f"chatting with {options.model} on {engine.info().name}; {HELP}", err=True)
    try:
        while True:
            if first is not None:
                line, first = first, None
            else:
                try:
                    line = input("> " if interactive else "")
                except EOFError:
                    break
                except KeyboardInterrupt:
                    click.echo("", err=True)
                    break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history.clear()
                click.echo("(conversation cleared)", err=True)
                continue
            if text == "/help":
                click.echo(HELP, err=True)
                continue
            history.append({"role": "user", "content": line})
            answer = _answer(engine, system + history, options, events, constraint)
            if answer is None:  # interrupted or failed: forget the unanswered message
                history.pop()
            else:
                history.append({"role": "assistant", "content": answer})
    finally:
        engine.close()
        events.close()


def _answer(
    engine: Any, messages: list[dict[str, str]], options: Any, events: Any, constraint: Constraint | None
) -> str | None:
    pieces: list[str] = []
    done: DoneEvent | None = None
    try:
        for ev in engine.generate(
            GenerateRequest(
                messages=messages, sampling=SamplingParams.from_options(options), constraint=constraint
            )
        ):
            if isinstance(ev, TokenEvent):
                pieces.append(ev.text)
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            else:
                done = ev
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        click.echo("(answer stopped)", err=True)
        return None
    except InferError as e:  # e.g. the conversation outgrew the context: say so and go on
        sys.stdout.write("\n")
        click.echo(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), err=True)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if done is not None:
        events.debug(
            "generation.done",
            finish_reason=done.finish_reason,
            summary=summary_line(done),
            timings=done.timings.to_dict(),
        )
    return "".join(pieces)
