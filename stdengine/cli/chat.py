"""`infer chat`: an interactive conversation with history and a system prompt."""

from __future__ import annotations

import sys
from typing import Any

import click

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.cli.common import CLIENT_OPTIONS, canonical_options, load, make_emitter, resolve_cli
from stdengine.cli.run import constraint_from_cli, read_prompt, summary_line, utf8_prompt
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
    -sys/--system sets a system prompt; -p (or -f FILE) sends a first message; --json-schema
    constrains every answer to JSON valid for a schema.
    In the conversation: /exit or Ctrl-D leaves, /reset starts over, Ctrl-C stops an answer.
    With stdin not a terminal (a script), the first error ends the chat with its exit status.
    """
    constraint = constraint_from_cli(kwargs)
    resolved = resolve_cli(kwargs, recipes=True)
    options = resolved.options
    events = make_emitter(options)
    if sys.stdin is None:  # started with stdin closed (<&-): there is no conversation to read
        raise UsageError(
            "stdin is closed, and `infer chat` reads the conversation from it",
            hint="run it in a terminal or pipe the messages in; for one answer use `infer run -p`",
        )
    interactive = sys.stdin.isatty()
    # -p or -f: the first message, read (and checked) before the model loads, as `infer run` does
    first = read_prompt(options) if options.prompt is not None or options.file is not None else None
    loaded = load(resolved, events)
    engine = loaded.engine
    try:
        check_constraint(engine, GenerateRequest(constraint=constraint))
        if not engine.has_chat_template():
            raise UsageError(
                "this model has no chat template, so `infer chat` cannot format a conversation",
                hint="pass one with --chat-template, or use `infer run --raw`",
            )
        system = [{"role": "system", "content": options.system}] if options.system else []
        if options.chat_template:  # the user's template is refused now, not after each message
            engine.apply_chat_template(system + [{"role": "user", "content": "hi"}])
        history: list[dict[str, str]] = []
        if interactive:
            click.echo(f"chatting with {loaded.model_ref} on {engine.info().name}; {HELP}", err=True)
        n_line = 0
        while True:
            try:
                if first is not None:
                    line, first = first, None
                else:
                    n_line += 1
                    try:
                        line = _read_line(interactive, n_line)
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
            except InferError as e:
                # A script must see a failed turn: the error ends the chat with its exit status.
                # At a terminal the user reads it and goes on (e.g. /reset after a context overflow).
                if not interactive:
                    raise
                click.echo(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), err=True)
                answer = None
            if answer is None:  # interrupted or failed: forget the unanswered message
                if history and history[-1]["role"] == "user":
                    history.pop()
            else:
                history.append({"role": "assistant", "content": answer})
    finally:
        engine.close()
        events.close()


def _read_line(interactive: bool, n: int) -> str:
    """The next message; EOFError at the end. Bytes that are not UTF-8 are refused (a usage
    error), never replaced, as in `infer run`'s prompt."""
    source = "the terminal" if interactive else f"stdin (line {n})"
    stdin = getattr(sys.stdin, "buffer", None)
    if interactive or stdin is None:  # input(): line editing at a terminal
        try:
            line = input("> " if interactive else "")
        except UnicodeDecodeError as e:  # a locale whose stdin decodes strictly
            raise UsageError(
                f"the message from {source} is not valid UTF-8 ({e.reason})",
                hint="set the terminal to UTF-8",
            ) from None
        # a UTF-8 locale hands bytes that are not UTF-8 over as lone surrogates: give them back
        return utf8_prompt(line.encode("utf-8", "surrogateescape"), source)
    data = stdin.readline()
    if not data:
        raise EOFError
    return utf8_prompt(data, source).removesuffix("\n").removesuffix("\r")


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
    except InferError:  # e.g. the conversation outgrew the context: the caller says so
        if pieces:  # end the cut-off answer's line
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
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
