"""The fixed inputs of the golden data: texts, tokenizer cases, conversations and prompts.

Changing anything here changes the golden data: regenerate it (spec/conformance.md says how).
The texts were written for this suite; the long one is longer than Gemma 3's 512-token sliding
window so that local-attention layers really slide.
"""

from __future__ import annotations

# Texts whose next-token distributions are compared with the exact reference (logits checks).
LOGIT_TEXTS: dict[str, str] = {
    "prose": (
        "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small "
        "can of oil, a clean rag and a notebook in which he wrote the weather, the ships he saw and "
        "the time the lamp was lit. In forty years he had missed only one night, during the storm "
        "that took the roof off the boathouse, and even then he had lit the lamp by hand."
    ),
    "code": (
        "def fibonacci(n: int) -> list[int]:\n"
        '    """Return the first n Fibonacci numbers."""\n'
        "    numbers = [0, 1]\n"
        "    while len(numbers) < n:\n"
        "        numbers.append(numbers[-1] + numbers[-2])\n"
        "    return numbers[:n]\n\n\n"
        "for i, value in enumerate(fibonacci(10)):\n"
        '    print(f"{i}: {value}")\n'
    ),
    "facts": (
        "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital "
        "of Spain. Rome is the capital of Italy. The days of the week are Monday, Tuesday, "
        "Wednesday, Thursday, Friday, Saturday and Sunday. One, two, three, four, five, six, seven."
    ),
    "long": (
        "Water moves around the planet in a cycle that has no beginning and no end. The sun warms "
        "the surface of the oceans, lakes and rivers, and some of that water rises into the air as "
        "vapour. Plants add more water to the air through their leaves, a process called "
        "transpiration. As the warm, moist air rises it cools, and the vapour condenses into tiny "
        "droplets around particles of dust and salt. Billions of these droplets together form the "
        "clouds that we see drifting across the sky.\n\n"
        "When the droplets in a cloud collide and merge, they grow heavier. Eventually they become "
        "too heavy to stay in the air, and they fall to the ground as rain, or as snow and hail when "
        "the air is cold enough. Some of this precipitation soaks into the soil and becomes "
        "groundwater, which can stay underground for thousands of years. Some of it runs off the "
        "land into streams and rivers, which carry it back to the sea. Snow that falls on high "
        "mountains may be stored as ice in glaciers, and released slowly as meltwater in the spring "
        "and summer.\n\n"
        "People depend on every part of this cycle. Farmers need rain at the right time of year to "
        "grow their crops, and cities draw their drinking water from rivers, reservoirs and wells. "
        "Engineers build dams to store water in wet seasons and release it in dry ones, and they "
        "design drains and canals to carry away the water from heavy storms. Because the amount of "
        "fresh water on the planet is limited, it is important to use it carefully, to keep it "
        "clean, and to understand how it moves from one place to another.\n\n"
        "Scientists study the water cycle with satellites, weather stations and instruments that "
        "measure the flow of rivers and the depth of snow. They use computer models to predict "
        "floods and droughts, and to understand how a warmer climate may change the pattern of "
        "rainfall. Warmer air can hold more water vapour, so storms may become more intense, while "
        "some regions may become drier as the rain moves elsewhere. Learning how these changes "
        "will affect rivers, forests and farms is one of the great challenges of our time.\n\n"
        "The next time you see a puddle dry up on a sunny afternoon, or watch clouds gather before "
        "a summer storm, remember that you are watching a small part of a very old and very large "
        "system. The water in that puddle may once have fallen on a mountain far away, flowed "
        "through a great river, rested for centuries in the deep ocean, and risen again into the "
        "sky. It will keep moving long after the puddle is gone, carried by the sun and the wind "
        "from one part of the world to another, again and again, without ever stopping.\n\n"
        "Long before anyone understood these processes, people told stories about them. Some "
        "believed that rivers flowed from springs deep inside the mountains, fed by a hidden sea "
        "beneath the earth. Others thought that rain was sent by the gods as a reward, and drought "
        "as a punishment. It was only a few hundred years ago that careful measurements showed that "
        "the rain and snow falling on a river basin are enough to explain all the water that flows "
        "out of it. That simple calculation, made with buckets, rulers and patience, changed the way "
        "people thought about the natural world, and it is still a good example of how science works."
    ),
}

# Tokenizer cases: ids must match llama.cpp's exactly; each must survive detokenize(tokenize(x)).
TOKENIZER_TEXTS: dict[str, str] = {
    "plain": "Hello world",
    "sentence": "The quick brown fox jumps over the lazy dog.",
    "leading_space": " leading space",
    "spaces": "two  spaces,   three and    four",
    "whitespace": "tabs\tand\nnewlines\n\n\ttogether  \n",
    "numbers": "3.14159 and 1234567890 and 42nd",
    "punctuation": "Wait... what?! (yes) [no] {maybe} \"quoted\" 'single'",
    "contractions": "I'm sure you'll see they've done it, don't you think?",
    "accents": "café naïve résumé Ångström São Paulo",
    "cjk": "日本語のテキストと中文文本",
    "emoji": "robots 🤖 and parties 🎉🎉 and flags 🇫🇷",
    "code": "if (x != y) { return a->b[i] + 0x1F; }",
    "mixed_case": "camelCase snake_case SCREAMING_CASE kebab-case",
    "url": "https://example.com/path?query=1&other=two#frag",
    "long_word": "antidisestablishmentarianism pneumonoultramicroscopic",
    "empty": "",
    # texts that Unicode normalisation (NFC, NFKC) would change: a tokenizer must take the bytes
    # as they are
    "combining": "cafe\u0301 nai\u0308ve man\u0303ana",
    "fullwidth": "\uff21\uff22\uff23 \uff46\uff55\uff4c\uff4c \uff11\uff12\uff13",
    "ligatures": "\ufb01ne \ufb02our o\ufb03ce",
    "superscripts": "x\u00b2 + y\u00b3 = z\u2074 and H\u2082O",
    "nbsp": "ten\u00a0kilometres at 5\u00a0%",
    "ellipsis": "wait\u2026 and then\u2026",
    "crlf": "first line\r\nsecond line\r\n",
}

# Texts that contain a model's special tokens written out (parse_special matters for them).
SPECIAL_TEXTS: dict[str, dict[str, str]] = {
    "llama": {"special": "<|im_start|>user\nHi<|im_end|>\n"},
    "gemma3": {"special": "<start_of_turn>user\nHi<end_of_turn>\n"},
}

# Conversations rendered with the model's chat template (chat checks).
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
}

# A completion prompt with near ties in its greedy continuation (margins of 0.0-0.1 nats at its
# 3rd, 4th and 18th tokens): the tie-aware checks judge an engine's own continuation of it by the
# exact reference, token by token.
COMPLETION_PROMPT = "Once upon a time, in a small village by the sea, there lived"


# A text read only as filler between the two copies of the induction case.
FILLER_TEXT = (
    "The bakery on the corner opened before sunrise. Its owner, a tall woman with flour on her "
    "sleeves, lit the ovens at four and shaped the first loaves while the street outside was "
    "still dark and quiet. By six the smell of warm bread had reached the bus stop, and the "
    "drivers on the early routes bought rolls through the side door. She sold rye, white and "
    "seeded loaves, small sweet buns on Sundays, and a dense fruit cake at the end of the year "
    "that people ordered weeks in advance. Her recipes were written in pencil in a school "
    "exercise book with a torn blue cover, and she had changed very little in thirty years: a "
    "little less salt, a longer rise for the rye, a hotter oven for the crust. When the book "
    "finally fell apart she copied every page by hand into a new one, and she gave the old one to"
    " her granddaughter, who had started to help on Saturday mornings and who wanted, one day, to"
    " run the shop herself."
)


def _induction_text() -> str:
    """The long text, then about 440 tokens of other texts, then the long text's first 60 words
    again: continuing it means copying from about 1100 tokens back, further than any window of
    1024 tokens or less (the prompt has 1150-1190 tokens); without the first copy the
    continuation is not predictable."""
    long = LOGIT_TEXTS["long"]
    head = " ".join(long.split()[:60])
    between = (LOGIT_TEXTS["prose"], FILLER_TEXT, LOGIT_TEXTS["facts"], LOGIT_TEXTS["code"])
    return "\n\n".join((long, *between, head))


# Candidates for the golden generation cases, in order. The golden generator keeps each whose
# exact greedy continuation has a top-1 margin of at least 1 nat at 24 or more consecutive tokens
# (a raw prompt may first be extended by up to 24 of its own greedy tokens to get past near
# ties), so that every correct engine must reproduce it exactly. Roles: the first raw case is the
# prompt of the generation checks; `induction` needs the whole context; `cjk`/`emoji` continue
# with multi-byte tokens; a chat case with a system message tests that the message is used.
GENERATION_CANDIDATES: dict[str, str | list[dict[str, str]]] = {
    "raw:count": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "raw:induction": _induction_text(),
    # a repeated block of multi-byte text: copying it is confident, and its tokens split
    # characters (an engine that decodes each token's bytes alone shows U+FFFD)
    "raw:cjk": (
        "日本語: 東京は日本の首都です。北京は中国の首都です。ソウルは韓国の首都です。"
        "パリはフランスの首都です。ローマはイタリアの首都です。\n"
        "日本語: 東京は日本の首都です。北京は中国の首都です。ソウルは韓国の首都です。"
        "パリはフランスの首都です。ローマはイタリアの首都です。\n"
        "日本語: 東京は"
    ),
    "raw:emoji": (
        "Weather report: ☀️ sunny in Tokyo (東京), 🌧️ rain in Paris, ❄️ snow in Oslo, "
        "🌈 a rainbow over Dublin, 🌪️ wind in Chicago, 🌫️ fog in London (倫敦).\n"
        "Weather report: ☀️ sunny in Tokyo (東京), 🌧️ rain in Paris, ❄️ snow in Oslo, "
        "🌈 a rainbow over Dublin, 🌪️ wind in Chicago, 🌫️ fog in London (倫敦).\n"
        "Weather report: ☀️ sunny in Tokyo"
    ),
    "chat:sequence": [
        {"role": "user", "content": "Continue the sequence: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"}
    ],
    # with a system message and an earlier exchange: a chat path that drops either sends fewer
    # prompt tokens (usage.prompt_tokens must equal the golden count)
    "chat:system": [
        {"role": "system", "content": "You continue number sequences."},
        {"role": "user", "content": "2, 4, 6, 8,"},
        {"role": "assistant", "content": "10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30"},
        {"role": "user", "content": "1, 2, 3, 4, 5, 6, 7, 8,"},
    ],
}

# A prompt whose greedy continuation is an end-of-generation token: a repeated pattern of short
# lines, each ended by the token E, invites the model to end the next line with E too. The golden
# generator tries the model's end-of-generation tokens in turn and keeps the first that works
# (base models, such as Gemma-3-270M, never predict some of theirs).
EOG_PATTERN = "Colours: red{E}Colours: blue{E}Colours: green{E}Colours: yellow{E}Colours: black"
