"""Generation semantics specified once for every engine: stop strings and chat templates.

An engine that does not do these natively uses these helpers, so `stop` behaves the same
everywhere: generation ends at the first occurrence of any stop string, the stop string is not
part of the text, and the finish reason is "stop".
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Any, Literal

from stdengine.errors import BadModelFile, InferError, InvalidRequest
from stdengine.options import SAMPLING


def validate_sampling(s: Any) -> None:
    """Refuse sampling values outside the ranges their Options fields declare (ge/le), so a
    request from any source (CLI, server, Python) is checked the same way."""
    problems = []
    for o in SAMPLING.values():
        value = getattr(s, o.name)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{o.name}={value} (must be a finite number; {o.help})")
        elif o.ge is not None and o.le is not None and not o.ge <= value <= o.le:
            problems.append(f"{o.name}={value} (must be in [{_num(o.ge)}, {_num(o.le)}])")
        elif o.ge is not None and value < o.ge:
            problems.append(f"{o.name}={value} (must be >= {_num(o.ge)}; {o.help})")
        elif o.le is not None and value > o.le:
            problems.append(f"{o.name}={value} (must be <= {_num(o.le)}; {o.help})")
    if any(not isinstance(x, str) for x in s.stop):
        problems.append("stop must be a list of strings")
    if problems:
        raise InvalidRequest(
            "invalid sampling parameters: " + "; ".join(problems),
            hint="see spec/options.md for each option's range",
        )


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # 2**63 - 1 in full, 1.0 as 1


def request_tokens(engine: Any, request: Any, bos_id: int | None, add_bos: bool) -> list[int]:
    """The prompt tokens of a GenerateRequest for an engine that tokenizes in-process: the chat
    template's text (with BOS added once when the model wants one and the template did not write
    it), or the raw prompt with the model's special tokens. Checks the sampling values too."""
    validate_sampling(request.sampling)
    if request.messages is not None:
        # tools: for a template that renders them itself (stdengine.server.tools)
        variables = {"tools": request.tools} if request.tools is not None else {}
        text = engine.apply_chat_template(request.messages, **variables)
        prompt = engine.tokenize(text, add_special=False, parse_special=True)
        if add_bos and bos_id is not None and prompt[:1] != [bos_id]:
            prompt = [bos_id, *prompt]
    else:
        if not request.prompt:
            raise InvalidRequest("the prompt is empty", hint="give the model some text to complete")
        prompt = engine.tokenize(request.prompt, add_special=True, parse_special=True)
    if not prompt:
        raise InvalidRequest("the prompt is empty after tokenization")
    return list(prompt)


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.protected = 0  # no match may end within pending[:protected] (text fed with may_stop off)

    def feed(self, text: str, may_stop: bool = True) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string matched or None). With may_stop
        off (the first min_tokens tokens) the text cannot end a stop string, but it may begin one
        that text fed later ends."""
        self.pending += text
        if not may_stop:
            self.protected = len(self.pending)
        hit = self._first_hit() if may_stop else None
        if hit is not None:
            pos, stop = hit
            out, self.pending, self.protected = self.pending[:pos], "", 0
            return out, stop
        keep = self._held_suffix()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.protected = max(0, self.protected - cut)
        return out, None

    def flush(self) -> str:
        """At the end of generation: the held-back text is final."""
        out, self.pending, self.protected = self.pending, "", 0
        return out

    def _first_hit(self) -> tuple[int, str] | None:
        """The earliest stop string that ends past the protected text."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.pending.find(s, max(0, self.protected - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_suffix(self) -> int:
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest


class Utf8Stream:
    """Turns token byte pieces into text, emitting only complete UTF-8 sequences."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, piece: bytes) -> str:
        self.buf += piece
        # A UTF-8 sequence is at most 4 bytes: find the longest decodable prefix.
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                text = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return text
        # Not valid UTF-8 even allowing for an incomplete tail: replace, as llama.cpp's detokenizer would.
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text

    def flush(self) -> str:
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


class ModelTemplate(str):
    """A chat template read from the model file (a str): rendering errors that are the template's
    own fault (a limit, a syntax error, runaway recursion) are then bad_model_file rather than
    invalid_request. choose_chat_template marks the file's template this way, so every engine
    that renders its `template` gets the right error without passing the source along."""


# Limits on rendering a chat template (spec/errors.md, "Resource limits"). A template is code from
# the model file or the request: without them two nested range(100000) loops never end and
# 'x' * 2**31 allocates gigabytes. The step budget is deterministic (loop iterations plus calls);
# the deadline catches work that steps do not count (a long filter chain per step).
TEMPLATE_MAX_STEPS = 1_000_000
TEMPLATE_DEADLINE_S = 10.0
# Longest string a template may build or output: this, plus 4 characters per character of input
# (the messages and the template, each message counted TEMPLATE_MESSAGE_CHARS longer for its
# role's markers), so a long conversation never reaches it, even of many short messages.
TEMPLATE_MIN_OUTPUT_CHARS = 1 << 20
TEMPLATE_MESSAGE_CHARS = 32


class TemplateLimit(Exception):
    """A chat template went past one of the limits above."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _bounded_environment(max_chars: int, cancel: Any) -> Any:
    """A Jinja sandbox that counts steps, watches the clock and refuses over-long strings."""
    import functools
    import time

    from jinja2 import nodes, pass_context
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    deadline = time.monotonic() + TEMPLATE_DEADLINE_S
    steps = 0

    def tick() -> None:
        nonlocal steps
        steps += 1
        if steps > TEMPLATE_MAX_STEPS:
            raise TemplateLimit(f"more than {TEMPLATE_MAX_STEPS} loop iterations and calls")
        if time.monotonic() > deadline:
            raise TemplateLimit(f"rendering took more than {TEMPLATE_DEADLINE_S:g} s")
        if cancel is not None and cancel.is_set():
            raise TemplateLimit("rendering was cancelled")

    def check(n: int, what: str) -> None:
        if n > max_chars:
            raise TemplateLimit(f"{what} would be {n} characters or items (the limit is {max_chars})")

    def check_ints(args: Any, kwargs: Any) -> None:
        # a width, count or indent larger than the limit can only build an over-long string
        for v in (*args, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > max_chars:
                check(abs(v), "a width or count argument")

    def estimate(name: str, subject: Any, args: Any) -> int:
        """An upper bound of what a string amplifier (a str method or a filter) returns, computed
        before it runs: subject is the str of a method or the value of a filter."""
        if name == "join":  # str.join(items) or the join filter: items|join(separator)
            sep, items = (
                (subject, args[0]) if isinstance(subject, str) else (args[0] if args else "", subject)
            )
            items = list(items) if isinstance(items, (list, tuple)) else []
            return sum(len(str(x)) for x in items) + len(str(sep)) * len(items)
        if not isinstance(subject, str):
            return _size(subject)
        if name == "replace" and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            return len(subject) + (subject.count(old) if old else len(subject)) * len(new) + len(new)
        if name == "indent":
            width = args[0] if args else 4
            return len(subject) + (subject.count("\n") + 1) * (
                width if isinstance(width, int) else len(str(width))
            )
        if name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            return len(subject) + subject.count("\t") * tab
        return len(subject)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        check(len(seq) * max(n, 0), "a repeated string or list")
            elif operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise TemplateLimit(f"an exponent of {right}")
            elif operator == "+":
                check(_size(left) + _size(right), "a concatenation")
            elif operator == "%" and isinstance(left, str):
                for digits in re.findall(r"\d+", left):
                    check(int(digits), "a %-format width")
            result = super().call_binop(context, operator, left, right)
            check(_size(result), "a result")
            return result

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            tick()
            check_ints(args, kwargs)
            subject = getattr(__obj, "__self__", None)
            check(estimate(getattr(__obj, "__name__", ""), subject, args), "a string method's result")
            result = super().call(__context, __obj, *args, **kwargs)
            check(_size(result), "a call's result")
            return result

        def bounded_join(self, parts: tuple[Any, ...]) -> str:
            # the ~ operator (jinja's Concat node), which call_binop does not see
            out = "".join(str(p) for p in parts)
            check(len(out), "a ~ concatenation")
            return out

        def count_loops(self, source: str) -> Any:
            """The template's syntax tree with every for loop's iterable counted by _bounded_iter."""
            tree = self.parse(source)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, "_bounded_iter", [], [], None, None, lineno=loop.lineno)
            return tree

    class Codegen(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # noqa: N802 (jinja's visitor naming)
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    env = Env(trim_blocks=True, lstrip_blocks=True)
    env.code_generator_class = Codegen

    def bounded_filter(name: str, f: Any) -> Any:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            tick()
            check_ints(args, kwargs)
            i = 1 if getattr(f, "jinja_pass_arg", None) else 0  # a context/environment comes first
            if len(args) > i:
                check(estimate(name, args[i], args[i + 1 :]), f"the {name} filter's result")
            result = f(*args, **kwargs)
            check(_size(result), f"the {name} filter's result")
            return result

        return run

    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}

    @pass_context
    def bounded_iter(context: Any, iterable: Any) -> Any:
        for item in iterable:
            tick()
            yield item

    env.filters["_bounded_iter"] = bounded_iter

    return env


def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    cancel: Any = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a chat template (as HF transformers and llama.cpp --jinja do), within the limits
    above. tools: OpenAI's tool list, given to the template as its `tools` variable (only when
    given: a template may test `tools is defined`). A problem of the template itself is
    bad_model_file for a ModelTemplate (the model
    file's), invalid_request for one given by the user or a request; a template that refuses the
    conversation (raise_exception) is invalid_request. cancel: a threading.Event that stops it."""
    from jinja2 import TemplateError, TemplateSyntaxError

    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest("each chat message needs a 'role' and a 'content'")
    from_model = isinstance(template, ModelTemplate)
    whose = "the model's chat template" if from_model else "the chat template given"

    def template_fault(what: str) -> InferError:
        if from_model:
            return BadModelFile(
                f"{whose} {what}",
                hint="pass a working template with --chat-template (a built-in name or Jinja text)",
            )
        return InvalidRequest(f"{whose} {what}", hint="see spec/errors.md for the template limits")

    def raise_exception(message: str) -> None:
        raise InvalidRequest(f"the chat template refused the conversation: {message}")

    input_chars = (
        len(template)
        + sum(len(str(m.get("content", ""))) + TEMPLATE_MESSAGE_CHARS for m in messages)
        + len(str(tools or ""))
    )
    max_chars = TEMPLATE_MIN_OUTPUT_CHARS + 4 * input_chars
    env = _bounded_environment(max_chars, cancel)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(env.count_loops(str(template)))
        out: list[str] = []
        n = 0
        variables: dict[str, Any] = {"tools": tools} if tools is not None else {}
        for piece in compiled.generate(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **variables,
        ):
            n += len(piece)
            if n > max_chars:
                raise TemplateLimit(f"output of more than {max_chars} characters")
            out.append(piece)
        return "".join(out)
    except TemplateLimit as e:
        raise template_fault(f"went past a rendering limit: {e}") from None
    except RecursionError:
        raise template_fault("recursed too deeply (a macro that calls itself without end?)") from None
    except MemoryError:
        raise template_fault("ran out of memory") from None
    except TemplateSyntaxError as e:
        raise template_fault(f"is not valid Jinja: {e} (line {e.lineno})") from e
    except TemplateError as e:
        raise InvalidRequest(f"{whose} failed to render: {e}") from e


# Built-in chat templates, selectable by name with --chat-template NAME. Each is our own Jinja
# rendering of a published turn format (the format is a fact; the template text is ours).
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Gemma: no system role (a system message is prepended to the first user turn), and the
    # assistant's role is called "model".
    "gemma": (
        "{{ bos_token }}"
        "{% set system = messages[0].content + '\n\n' if messages and messages[0].role == 'system' else '' %}"
        "{% for m in messages if m.role != 'system' %}"
        "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ system if loop.first else '' }}{{ m.content | trim }}<end_of_turn>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}

# The template to use for an architecture whose GGUF file carries none (llama.cpp guesses the
# same way from the model): Gemma 3 files are often converted without tokenizer.chat_template.
ARCH_DEFAULT_TEMPLATES: dict[str, str] = {"gemma3": "gemma", "gemma2": "gemma", "gemma": "gemma"}


def choose_chat_template(option: str | None, metadata: dict[str, Any]) -> tuple[str | None, str]:
    """The chat template for a run and where it came from: --chat-template (a built-in name or
    Jinja text), else the GGUF's tokenizer.chat_template, else the architecture's built-in one."""
    if option:
        if option in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[option], f"built-in '{option}'"
        if "{" not in option:
            raise InvalidRequest(
                f"--chat-template {option!r} is neither Jinja text nor a built-in template",
                hint=f"built-in templates: {', '.join(BUILTIN_TEMPLATES)}",
            )
        return option, "--chat-template"
    from_file = metadata.get("tokenizer.chat_template")
    if isinstance(from_file, str) and from_file:
        return ModelTemplate(from_file), "model file"
    name = ARCH_DEFAULT_TEMPLATES.get(str(metadata.get("general.architecture")))
    if name:
        return BUILTIN_TEMPLATES[name], f"{FALLBACK_PREFIX}'{name}' (the model file has none)"
    return None, "none"


FALLBACK_PREFIX = "built-in "


def template_level(source: str) -> Literal["info", "warn"]:
    """model.loaded's level: `warn` when a run falls back to a built-in template because the file
    has none (a base model, such as the catalogue's Gemma-3-270M, may not follow it)."""
    return (
        "warn"
        if source.startswith(FALLBACK_PREFIX) and source.endswith("(the model file has none)")
        else "info"
    )
