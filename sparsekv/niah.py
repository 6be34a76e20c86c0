"""A small needle-in-a-haystack prompt builder (RULER's "niah_single_1" task, in spirit).

A haystack of repeated noise sentences hides one needle, "One of the special magic numbers for {key} is:
{number}.", at a chosen depth; the question at the end asks for the number. Used by the demo and the benchmarks.
"""

from __future__ import annotations

import random

import torch

NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
KEYS = (
    "apple", "anchor", "badger", "bicycle", "canyon", "cobalt", "dolphin", "ember", "falcon", "fjord", "glacier",
    "harbor", "iris", "jasmine", "kettle", "lantern", "maple", "meadow", "nebula", "orchid", "pebble", "quartz",
    "raven", "saffron", "tundra", "umbrella", "velvet", "walnut", "willow", "zephyr",
)


def _encode(tokenizer, text: str, reply: str = "") -> torch.Tensor:
    """`text` as a user message in the tokenizer's chat template (plain text if it has none), followed by the
    start of the assistant's `reply`; `(1, L)` ids."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text + reply, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(f"{text}\n{reply}".rstrip(), return_tensors="pt").input_ids


def build_needle_prompt(
    tokenizer, n_tokens: int, depth: float = 0.5, seed: int = 0, answer_prefix: bool = True
) -> tuple[torch.Tensor, str]:
    """A needle-in-a-haystack prompt of about `n_tokens` model tokens (within 2%) and its answer.

    Args:
        tokenizer: the model's tokenizer; its chat template wraps the prompt as a user message.
        n_tokens: target prompt length in tokens, chat template included.
        depth: where the needle sits in the haystack, 0 (start) to 1 (end), at a sentence boundary.
        seed: picks the key word and the 7-digit number (deterministic).
        answer_prefix: start the assistant's reply with "The special magic number for {key} mentioned in the
            provided text is", as RULER does, so the number is the first thing generated (a few tokens).
            Prompts too short for it (under ~80 tokens) drop the task instructions, then this prefix.

    Returns:
        `(input_ids (1, L), answer)` where `answer` is the 7-digit number as a string.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1]; got {depth!r}.")
    rng = random.Random(seed)
    key, answer = rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))
    needle = f"One of the special magic numbers for {key} is: {answer}."
    question = f"What is the special magic number for {key} mentioned in the provided text?"
    reply = f"The special magic number for {key} mentioned in the provided text is" if answer_prefix else ""
    intro = INTRO + "\n"

    def build(n_sentences: int) -> torch.Tensor:
        haystack = [NOISE[i % len(NOISE)] for i in range(n_sentences)]
        haystack.insert(round(depth * n_sentences), needle)
        return _encode(tokenizer, f"{intro}{' '.join(haystack)}\n{question}", reply)

    base = build(0).shape[1]
    if n_tokens < base:  # very short prompts drop the instructions, then the answer prefix
        intro = ""
        base = build(0).shape[1]
        if n_tokens < 0.98 * base:
            reply = ""
            base = build(0).shape[1]
    if n_tokens < 0.98 * base:
        raise ValueError(f"n_tokens={n_tokens} is shorter than the needle and question alone ({base} tokens).")
    per_sentence = (build(100).shape[1] - base) / 100
    n = max(0, round((n_tokens - base) / per_sentence))
    for _ in range(10):  # a few corrections: sentence boundaries may tokenize differently
        ids = build(n)
        if abs(ids.shape[1] - n_tokens) <= 0.02 * n_tokens:
            break
        n = max(0, n + round((n_tokens - ids.shape[1]) / per_sentence))
    return ids, answer


def score_answer(text: str, answer: str) -> bool:
    """True when the generated `text` contains the `answer`."""
    return answer in text
