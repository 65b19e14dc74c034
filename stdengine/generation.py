"""Generation semantics specified once for every engine: stop strings and chat templates.

An engine that does not do these natively uses these helpers, so `stop` behaves the same
everywhere: generation ends at the first occurrence of any stop string, the stop string is not
part of the text, and the finish reason is "stop".
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from stdengine.errors import InvalidRequest


def validate_sampling(s: Any) -> None:
    """Refuse sampling values outside their meaning (the same ranges as the canonical options),
    so a request from any source (CLI, server, Python) is checked the same way."""
    problems = []
    if s.temp < 0:
        problems.append(f"temp={s.temp} (must be >= 0)")
    if s.top_k < 0:
        problems.append(f"top_k={s.top_k} (must be >= 0; 0 turns it off)")
    if not 0.0 <= s.top_p <= 1.0:
        problems.append(f"top_p={s.top_p} (must be in [0, 1])")
    if not 0.0 <= s.min_p <= 1.0:
        problems.append(f"min_p={s.min_p} (must be in [0, 1])")
    if s.repeat_penalty < 0:
        problems.append(f"repeat_penalty={s.repeat_penalty} (must be >= 0)")
    if s.repeat_last_n < -1:
        problems.append(f"repeat_last_n={s.repeat_last_n} (must be >= -1)")
    if s.n_predict < -1:
        problems.append(f"n_predict={s.n_predict} (must be >= -1; -1 means no limit)")
    if any(not isinstance(x, str) for x in s.stop):
        problems.append("stop must be a list of strings")
    if problems:
        raise InvalidRequest(
            "invalid sampling parameters: " + "; ".join(problems),
            hint="see spec/options.md for each option's range",
        )


def request_tokens(engine: Any, request: Any, bos_id: int | None, add_bos: bool) -> list[int]:
    """The prompt tokens of a GenerateRequest for an engine that tokenizes in-process: the chat
    template's text (with BOS added once when the model wants one and the template did not write
    it), or the raw prompt with the model's special tokens. Checks the sampling values too."""
    validate_sampling(request.sampling)
    if request.messages is not None:
        text = engine.apply_chat_template(request.messages)
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

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string matched or None)."""
        self.pending += text
        hit = self._first_hit()
        if hit is not None:
            pos, stop = hit
            out, self.pending = self.pending[:pos], ""
            return out, stop
        keep = self._held_suffix()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, None

    def flush(self) -> str:
        """At the end of generation: the held-back text is final."""
        out, self.pending = self.pending, ""
        return out

    def _first_hit(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.pending.find(s)
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


def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """Render a model's Jinja chat template (as HF transformers and llama.cpp --jinja do)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidRequest(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest("each chat message needs a 'role' and a 'content'")
    try:
        return env.from_string(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as e:
        raise InvalidRequest(f"the model's chat template failed to render: {e}") from e


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
        return from_file, "model file"
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
