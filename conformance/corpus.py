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

# A completion prompt whose greedy continuation is long enough for the generation checks.
COMPLETION_PROMPT = "Once upon a time, in a small village by the sea, there lived"

# A prompt whose greedy continuation is an end-of-generation token: a repeated pattern of short
# lines, each ended by the token E, invites the model to end the next line with E too. The golden
# generator tries the model's end-of-generation tokens in turn and keeps the first that works
# (base models, such as Gemma-3-270M, never predict some of theirs).
EOG_PATTERN = "Colours: red{E}Colours: blue{E}Colours: green{E}Colours: yellow{E}Colours: black"
