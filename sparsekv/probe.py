"""A transformers cache for a press's own forward: the installed hooks hand it each layer's attention events.

A press that reads the prompt through forwards of its own (`Press.after_prompt`, KVzip's reconstruction) runs
them with a `ProbeCache`: the model builds its masks and appends the forward's KV as for any transformers cache,
and the press's hooks, installed for the `with` block (the core installs them for `after_prompt` when the press is
not), call `before(module, hidden_states, position_embeddings)` before each attention and `after(module)` after
it. No hook is registered while forwards run, so concurrent generations on one model never meet, and each
probe's events go to its own cache alone.
"""

from __future__ import annotations

from typing import Callable

from transformers import DynamicCache


class ProbeCache(DynamicCache):
    """A `DynamicCache` whose layers' attention events go to `before` and `after` (see the module docstring)."""

    def __init__(self, config, before: Callable, after: Callable):
        super().__init__(config=config)
        self.before, self.after = before, after
