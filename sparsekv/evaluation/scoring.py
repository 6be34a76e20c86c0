"""RULER's scoring: does the reply contain the expected strings (case-insensitive)?

- "all" (RULER's string_match_all): the fraction of the expected strings found in the reply, so 1 only when
  every one is there. Used by every synthetic task.
- "any" (RULER's string_match_part): 1 when at least one is found (question answering, several reference answers).

Scores are in [0, 1] per sample; `aggregate` reports their mean as a percentage, as RULER does.
"""

from __future__ import annotations

import re

METRICS = ("all", "any")


def clean(reply: str) -> str:
    """The reply with control characters turned into newlines and the ends stripped (RULER's post-processing)."""
    return re.sub(r"[\x00-\x1f]", "\n", reply).strip()


def score(reply: str, answers: list[str], metric: str) -> float:
    """Score of one reply against its expected `answers` with `metric` ("all" or "any")."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}; got {metric!r}.")
    if not answers:
        raise ValueError("answers: at least one expected string is needed.")
    text = clean(reply).lower()
    found = [answer.lower() in text for answer in answers]
    return sum(found) / len(found) if metric == "all" else float(any(found))


def aggregate(scores: list[float]) -> float:
    """Mean score as a percentage (0 to 100); 0 for no samples."""
    return 100.0 * sum(scores) / len(scores) if scores else 0.0
