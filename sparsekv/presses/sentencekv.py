"""SentenceKV (Zhu et al., 2025, "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching")."""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..attention import AttentionCall, query_norm, rotate, rotate_projections
from ..cache import Forward, KVLayer, SparseCache, StoreLayer
from ..layers import flat_index, gather_rows, offloaded
from ..log import logger
from ..press import check_number
from ..segment import closes_sentence, sentence_ids
from ..state import RowState, padded
from .snapkv import SnapKVPress


@dataclass
class SentenceState(RowState):
    """Per generation: each prompt token's sentence."""

    sentences: torch.Tensor | None = None  # (batch, prompt) sentence index, -1 for padding
    piece_ids: torch.Tensor | None = None  # (batch, read) a prompt read in pieces: its tokens until the last piece
    step_ids: torch.Tensor | None = None  # (batch, q) the last forward's tokens, for `crop`
    stack: LayerStack | None = None  # `plan="step"`: every layer's ranking state, once the layers are compressed
    per_layer: bool = False  # `plan="step"` over layers on several devices: each layer ranks at its query


@dataclass
class LayerStack(RowState):
    """`SentencePress(plan="step")`: the ranking state of every compressed layer, stacked on dim 1 (batch first,
    then layers), so that a step ranks and loads for all layers with one set of ops. The fields are those of
    `SentenceLayerState` with a layer dimension; sentences are padded to the layer with the most (empty ones: no
    tokens, never loaded). Built from the layers' states at the first forward after the prompt, which give theirs
    up (None): from then on this is the one copy.
    """

    ranks: dict[int, int] = field(default_factory=dict)  # layer index -> its index on dim 1
    last: int = -1  # the last stacked layer's index: the step's queries join the sums after it
    query_sum: torch.Tensor | None = None  # (batch, layers, kv_heads, 1, head_dim)
    sentence_keys: torch.Tensor | None = None  # (batch, layers, kv_heads, sentences, head_dim or 2 head_dim)
    sentence_sizes: torch.Tensor | None = None  # (batch, layers, 1, sentences)
    slot_sentence: torch.Tensor | None = None  # (batch, layers, kv_heads, R)
    slot_room: torch.Tensor | None = None  # (batch, layers, 1, R)
    resident: torch.Tensor | None = None  # (batch, layers, kv_heads, R)
    device_slot: torch.Tensor | None = None  # (batch, layers, kv_heads, R)
    step_queries: list | torch.Tensor = field(default_factory=list)  # per layer, the last forward's queries
    # `(batch, kv_heads, q, d)`, or all layers' `(batch, layers, kv_heads, 1, d)` when they were added at once
    projected: list = field(default_factory=list)  # per layer, a one-token step's query projection, until `last`
    rope: torch.Tensor | None = None  # the RoPE matrix of those projections (the step's, shared by its layers)
    store_positions: torch.Tensor | None = None  # (batch, layers, R) the layers' `store_positions`
    loaded_positions: torch.Tensor | None = None  # (batch, layers, kv_heads, loaded) the loaded slots' positions,
    # written for every layer at once; a layer's own are written when read (`OwedPositions`)
    heads: int = 0  # query heads per layer
    before_reset: torch.Tensor | None = None  # query_sum before a sentence end zeroed it, for `crop`

    shared_state: ClassVar[frozenset[str]] = frozenset({"rope"})
    STACKED: ClassVar[tuple[str, ...]] = ("query_sum", "sentence_keys", "sentence_sizes", "slot_sentence",
                                          "slot_room", "resident", "device_slot")


class OwedPositions:
    """The loaded slots' positions a stacked load left unwritten in one layer (`StoreLayer.owed`): the stack
    keeps every layer's (`LayerStack.loaded_positions`, one write for all layers a step, where each layer had an
    index and a write of its own), and they are written into the layer only when something reads its positions
    (`prompt_kept`, `crop`; attention does not)."""

    def __init__(self, stack: LayerStack, rank: int):
        self.stack, self.rank = stack, rank

    def pay(self, layer) -> None:
        layer.owed = None  # first, and the tensor itself below (not `positions`): reading that would pay again
        layer.__dict__["_positions"][..., : layer.state.loaded] = self.stack.loaded_positions[:, self.rank]


@dataclass
class SentenceLayerState(RowState):
    """Per layer: the sentence vectors, the mean query, and which store slots are loaded where.

    The layer's working set is `[loaded | sinks + recent window + generated tokens]`: its first `loaded` slots
    hold selected store tokens in no particular order (a row's `fill` real ones, then fillers); only tokens
    that enter the selection are copied in.
    """

    loaded: int = 0  # slots of the loaded region
    sentence_keys: torch.Tensor | None = None  # (batch, kv_heads, sentences, head_dim) eq. 1; (..., 2 head_dim) bounds
    query_sum: torch.Tensor | None = None  # (batch, kv_heads, 1, head_dim): the sentence being generated
    resident: torch.Tensor | None = None  # (batch, kv_heads, R) store slots now loaded
    device_slot: torch.Tensor | None = None  # (batch, kv_heads, R) loaded slot of each resident one
    fill: torch.Tensor | None = None  # (batch, 1, 1) loaded slots a row fills (the others: fillers, last)
    slot_sentence: torch.Tensor | None = None  # (batch, kv_heads, R) sentence of each store slot
    slot_room: torch.Tensor | None = None  # (batch, 1, R) see `loading_room`
    sentence_sizes: torch.Tensor | None = None  # (batch, 1, S) store slots of each sentence
    step_queries: torch.Tensor | None = None  # (batch, kv_heads, q, head_dim) the last forward's, for `crop`
    before_reset: torch.Tensor | None = None  # query_sum before a sentence end zeroed it, for `crop`

    @classmethod
    def joined(cls, states: list[SentenceLayerState]) -> SentenceLayerState:
        """Rows prefilled apart, laid out as a batch prefilled together: sentences padded to the most (unused
        ids: no tokens, never loaded) before each row's empty sentence, which stays last (`_fill_store`); store
        slots padded to the widest (in the empty sentence, no room: never loaded); the loaded region to the
        largest (its fillers last, `StoreLayer.filler_slot`)."""
        if any(state.sentence_keys is None for state in states):  # kept whole: nothing to pad
            return super().joined(states)
        s = max(state.sentence_sizes.shape[-1] for state in states)
        r = max(state.slot_sentence.shape[-1] for state in states)
        twins = []
        for state in states:
            twin, empty = copy.copy(state), state.sentence_sizes.shape[-1] - 1
            twin.loaded = max(other.loaded for other in states)
            twin.sentence_keys = padded(state.sentence_keys, 2, s, 0, at=empty)
            twin.sentence_sizes = padded(state.sentence_sizes, 2, s, 0, at=empty)
            slot_sentence = state.slot_sentence.masked_fill(state.slot_sentence == empty, s - 1)
            for name, value, fill in (("slot_sentence", slot_sentence, s - 1), ("slot_room", state.slot_room, 0),
                                      ("resident", state.resident, False), ("device_slot", state.device_slot, 0)):
                setattr(twin, name, padded(value, 2, r, fill))
            twins.append(twin)
        return super().joined(twins)


@dataclass(kw_only=True)
class SentencePress(SnapKVPress):
    """Keep the prompt as sentences in an offload store; at every decoding step, attend to the sentences whose
    keys best match the mean query of the sentence being generated.

    Prefill (paper sec. 4.1): the prompt is split into sentences (`sparsekv.segment`: Punkt, blank lines, long
    sentences cut at mean + 2 std tokens, A.7, and at `max_sentence_tokens`). SnapKV's window scores, summed over
    the heads, keep the best `keep_factor * budget` prompt tokens over all sentences besides the attention sinks
    and the recent window, which stay on the device (A.7's global prefilter); their KV goes to the store on
    `offload_device`, and each sentence's vector per KV head over its kept tokens (relative to the prompt's mean
    key: `centre`) stays on the device: by default its keys' channel-wise bounds (`sentence_vector`), eq. 1's mean
    one option away.
    Decoding (sec. 4.2): the queries of the tokens of the sentence being generated are averaged (eq. 2; reset
    after a token that ends a sentence; started by the prompt's unfinished last sentence: `prompt_sentence`), the
    query heads of each GQA group averaged, and per KV head sentences are ranked by `q . k_s` (bounds: the most
    any of its keys can score); the tokens of the best sentences (the first ones by position of the last
    sentence, which is cut) are loaded until the budget.
    Only tokens entering the selection are copied from the store, in one gather and one write per layer; none
    when it did not change. Each layer's queries are captured after its projection (`on_queries`); by default
    every layer's sentences are ranked and loaded at once when a step begins, from the queries before the step's
    (`plan`). Attention reads sinks + loaded + recent window + generated.

    Choices the paper leaves open or sparsekv makes beyond it (`prompt_sentence`, `centre`, `max_sentence_tokens`,
    `sentence_vector`, `plan` below, each with its measured effect in docs/results.md or docs/decode_vs_oracle.md):
    where the sentence being generated starts, what RoPE does to eq. 1's mean keys, how long a sentence may be,
    what stands for a sentence, and when a step ranks. `SentencePress(max_sentence_tokens=128,
    sentence_vector="mean", plan="layer")` ranks sentences as the paper's eq. 1 and Algorithm 1.
    The sinks and the recent window (32 + 32, from the authors' code; the paper names neither) come on top of
    the tau loaded tokens, as the paper's tau counts retrieved tokens only.

    Args:
        tokenizer: the model's tokenizer (required: sentences are found in the decoded prompt).
        budget: tau, stored prompt tokens loaded and attended at each decoding step (Algorithm 1 line 17:
            "retrieve top-tau tokens"); the `n_sinks` sinks and the recent window are attended besides (the
            authors' code instead loads tau - 64, counting them in tau).
        ratio: tau as a fraction of each prompt, instead of `budget`. A prompt no longer than tau plus the sinks
            and the window is kept whole (every token attended, nothing offloaded).
        keep_factor: r, prompt tokens kept in the store per token of tau (default 2, sec. 4.1 "r = 2 or 3"; the
            paper's NIAH result uses 3).
        n_sinks: first prompt tokens always attended (default 32, the authors' code).
        window_size: SnapKV's observation window, also the recent window always attended (default 32).
        kernel_size: SnapKV's pooling kernel, in tokens (default 15, as `SnapKVPress`; the authors' code uses 7,
            which in the measured cells found as many needles or fewer: docs/results.md, "SnapKV's pooling kernel").
        pooling: SnapKV's pooling, "max" or "avg" (default "max", see `SnapKVPress`).
        offload_device: where the store lives (default "cpu"; pinned memory when the model is on CUDA).
        max_sentence_tokens: longest sentence bucket, in tokens; longer ones are cut into equal pieces (default 32,
            sparsekv's: about the paper's median sentence of 25-30 tokens, A.4). In real prose mean + 2 std (A.7)
            leaves sentences of 50-100 tokens, more than half the tokens of Python's reference manual, and a
            short code inside one is lost in its vector; 128 (sparsekv's earlier default) leaves A.7 alone.
        prompt_sentence: when the prompt ends inside a sentence (an answer prefix such as "The number is"), the
            sentence being generated began in the prompt, and its prompt tokens' queries start the mean query
            (default True). False: an empty sentence cache at the first step, as the paper's Fig. 2 (there, the
            first generated digits' queries alone lose the needle). A prompt that ends a sentence starts empty.
        centre: sentence vectors from each kept key minus the prompt's mean key (taken before RoPE, rotated back
            to the key's position), default True. Without RoPE this ranks sentences as eq. 1 does (`q . mean` is
            the same for all); with RoPE the shared component turns with position and ranks sentences by
            distance, the recent and the first ones on top. False: eq. 1 on the cached keys.
        sentence_vector: what stands for a sentence in the ranking. "bounds" (default, sparsekv's: Quest's page
            bound applied to sentences): each channel's min and max over its kept keys, scored
            `sum_i max(q_i min_i, q_i max_i)`, the most any of its keys can score: one token that matches the
            query lifts its sentence, where a mean dilutes it among the sentence's other tokens (a code inside a
            long prose sentence). Twice the device memory of a mean per sentence. "mean": eq. 1, scored `q . k_s`.
        plan: when the sentences are ranked and loaded. "step" (default, sparsekv's): every layer's at once when a
            step begins, from the mean query of the sentence's tokens before the step's (right after a sentence
            end, each row keeps its selection until a token of the new sentence is seen): one ranking and three
            host reads a step for all layers instead of a ranking and one or two reads per layer, which made a
            step cost 1.33x the oracle's on a CPU against 1.14x (docs/decode_vs_oracle.md); the same answers in
            every cell measured (docs/results.md). "layer" (the paper's Algorithm 1): each layer at each step,
            once it has the step's query, which its mean query includes.
    """

    tokenizer: Any = field(default=None, repr=False, compare=False, kw_only=False)
    keep_factor: float = 2.0
    n_sinks: int = 32
    offload_device: str = "cpu"
    max_sentence_tokens: int = 32
    prompt_sentence: bool = True
    centre: bool = True
    sentence_vector: str = "bounds"
    plan: str = "step"
    reads_input_ids: ClassVar[bool] = True
    joins_rows: ClassVar[bool] = True  # stores and sentences padded per row (`StoreLayer.joined`, the state's)
    paper_name: ClassVar[str] = "SentenceKV"
    reads_step_queries: ClassVar[bool] = True

    def __post_init__(self):
        if self.tokenizer is None:
            raise ValueError("SentencePress: tokenizer is required (the model's tokenizer, to find the prompt's "
                             "sentences): SentencePress(tokenizer, budget=1024).")
        self.keep_factor = check_number("SentencePress", "keep_factor", self.keep_factor, low=1,
                                        unit="r, stored tokens per token of tau")
        self.n_sinks = check_number("SentencePress", "n_sinks", self.n_sinks, integer=True, low=0, unit="tokens")
        self.max_sentence_tokens = check_number("SentencePress", "max_sentence_tokens", self.max_sentence_tokens,
                                                integer=True, low=1, unit="tokens")
        for name in ("prompt_sentence", "centre"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SentencePress: {name} must be True or False; got {getattr(self, name)!r}.")
        if self.plan not in ("layer", "step"):
            raise ValueError(f"SentencePress: plan must be 'layer' (each layer at its query, the paper's) or 'step' "
                             f"(every layer when a step begins); got {self.plan!r}.")
        if self.sentence_vector not in ("mean", "bounds"):
            raise ValueError(f"SentencePress: sentence_vector must be 'mean' (eq. 1) or 'bounds'; got "
                             f"{self.sentence_vector!r}.")
        try:
            torch.device(self.offload_device)
        except (RuntimeError, TypeError):
            raise ValueError(f"SentencePress: offload_device must be a torch device such as 'cpu'; got "
                             f"{self.offload_device!r}.") from None
        try:  # a device this machine has (a CUDA one on a CPU-only torch fails at generate otherwise)
            torch.empty(0, device=self.offload_device)
        except (RuntimeError, AssertionError) as err:
            raise ValueError(f"SentencePress: offload_device={self.offload_device!r} is not available here ({err}); "
                             "use 'cpu' (the default).") from None
        super().__post_init__()

    def min_kept(self) -> tuple[int, str]:
        return 1, "1 loaded token"

    def prompt_tail(self) -> int | None:
        # The window's queries and those of the prompt's last sentence (`prompt_sentence`), never longer than
        # `max_sentence_tokens`; its sentences come from the pieces' tokens, its mean key from the cache.
        return max(self.window_size, self.max_sentence_tokens)

    def new_layer(self, layer_idx: int) -> StoreLayer:
        return StoreLayer(self.offload_device, state=SentenceLayerState())

    def new_state(self, cache: SparseCache) -> SentenceState:
        return SentenceState()

    def begin_forward(self, cache: SparseCache, forward: Forward) -> None:
        state = cache.state
        if state.sentences is None and cache.pieces is not None:  # a prompt read in pieces: sentences at its last
            ids = forward.input_ids if state.piece_ids is None else torch.cat([state.piece_ids, forward.input_ids], 1)
            state.piece_ids = ids if forward.pieces_left else None
            if not forward.pieces_left:
                state.sentences = sentence_ids(self.tokenizer, ids, cache.pieces.valid, self.max_sentence_tokens)
        elif state.sentences is None:  # the prompt
            state.sentences = sentence_ids(self.tokenizer, forward.input_ids, forward.input_valid,
                                           self.max_sentence_tokens)
        # The plan of this forward: which rows' last token ends a sentence (left padding: every row's last token).
        cache.state.step_ids = forward.input_ids
        closing = closes_sentence(self.tokenizer, forward.input_ids[:, -1])  # on the host
        # None: no layer has work to do. Else sent to the device now, while it has little queued to wait for.
        forward.plan = closing.to(forward.input_ids.device) if bool(closing.any()) else None
        if self.plan == "step":
            self._plan_step(cache)

    # --- prefill ---------------------------------------------------------------------------------------------
    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        fixed = self.n_sinks + self.window_size
        taus = self.row_budgets(cache, *self.min_kept(), beside=fixed)
        if bool((taus + fixed >= cache.prompt_lengths).all()):  # every prompt token would be attended anyway
            return
        b, h, n, _ = layer.keys.shape
        device = layer.keys.device
        start = cache.on("prompt_start", device)[:, None]
        valid = call.valid()
        # Attended at every step: each row's first n_sinks tokens and the last window_size. A row too short for both
        # (kept whole beside longer ones) has them overlap, or reach into its padding: those slots are fillers.
        sinks = start + torch.arange(self.n_sinks, device=device)
        recent = (n - self.window_size + torch.arange(self.window_size, device=device)).expand(b, -1)
        keep = torch.cat([sinks, recent], dim=1)  # (b, fixed), by position
        real_slot = torch.cat([sinks < n - self.window_size, recent >= start], dim=1)
        resident = torch.zeros(b, n + 1, dtype=torch.bool, device=device).scatter_(1, keep.where(real_slot, n), True)
        resident, keep = resident[:, :n], keep.clamp(max=n - 1)
        # Global prefilter (A.7): the best r * tau prompt tokens, summed over the heads; sinks and window apart.
        scores = self.window_scores(cache, layer, call).sum(dim=1).masked_fill(resident | ~valid, float("-inf"))
        kept = (taus.double() * self.keep_factor).round().long().to(device)
        store = scores.sort(dim=-1, descending=True, stable=True).indices[:, : int(kept.max())]
        in_store = (torch.arange(store.shape[1], device=device) < kept[:, None]) & scores.gather(1, store).isfinite()
        store = torch.where(in_store, store, n).sort(dim=-1).values  # by position; n: an empty slot, last
        in_store = store < n
        store = store.clamp(max=n - 1)
        shared = self._shared_keys(layer, call, valid, store) if self.centre else 0.0
        self._fill_store(layer, store, in_store, cache.state.sentences.to(device), shared, self.sentence_vector)
        # Device slots: the loaded region (filled below, then at each step), then sinks + window. Rows with fewer
        # stored tokens than slots: the same count of real slots on every head, fillers last and never attended.
        layer.state.loaded = int(taus.max())
        layer.state.fill = torch.minimum(taus.to(device), in_store.sum(-1))[:, None, None]
        real = torch.arange(layer.state.loaded, device=device) < layer.state.fill[:, 0]  # (b, loaded)
        slots = torch.cat([keep.new_zeros(b, layer.state.loaded), keep], dim=1)[:, None].expand(b, h, -1)
        layer.select(slots, torch.cat([real, real_slot & valid.gather(1, keep)], dim=1))
        layer.state.query_sum = torch.zeros(b, h, 1, layer.keys.shape[-1], device=device, dtype=torch.float32)
        if self.prompt_sentence:
            self._seed_queries(cache, layer, call)
        layer.state.device_slot = torch.zeros(b, h, store.shape[1], dtype=torch.long, device=device)
        state = layer.state
        state.slot_room = loading_room(state.slot_sentence[:, :1], state.sentence_sizes, state.fill)
        # A complete cache from the start: the sentences best for the prompt's unfinished one (or the first ones).
        self._load(layer, self._chosen(layer.state))

    @staticmethod
    def _shared_keys(layer, call, valid, store):
        """The prompt's mean key, taken before RoPE, rotated to each stored token's position `(b, h, R, d)`.

        Under RoPE the component every key shares turns with position, so `q . k` carries a term that depends
        on distance alone, large enough to rank sentences by position (the recent ones first). Subtracting this
        leaves `q . k` minus `q . mean`, which for keys without RoPE is eq. 1's ranking exactly.
        """
        weight = valid[:, None, :, None].float()
        plain = rotate(layer.keys.float(), call.position_embeddings, inverse=True)
        mean = (plain * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp(min=1)
        b, r = store.shape
        if call.position_embeddings is None:  # a layer without RoPE: the mean key is every token's
            return mean
        at = [t.expand(b, -1, -1).gather(1, store[..., None].expand(-1, -1, t.shape[-1]))
              for t in call.position_embeddings]
        return rotate(mean.expand(-1, -1, r, -1), at)

    @staticmethod
    def _fill_store(layer, store, in_store, sentences, shared, vector):
        """The prefiltered tokens' KV to the offload store; per sentence, the mean of their keys minus `shared`
        (`vector="bounds"`: each channel's max, then its min, concatenated: `(b, h, S, 2 d)`).

        Only sentences that kept a token are ranked, renumbered in order: the others could take no budget, and
        on long prompts they are most of them (4 in 5 at 8k tokens, r = 2), so each step's sort and similarity
        shrink as much. Empty store slots go to one more, empty, sentence (mean key 0, no tokens), as do the
        ids a row with fewer kept sentences does not use.
        """
        b, h, _, d = layer.keys.shape
        keys, values = (t.gather(2, store[:, None, :, None].expand(b, h, -1, t.shape[-1]))
                        for t in (layer.keys, layer.values))  # (values may be wider than keys)
        bucket = sentences.gather(1, store)
        prompt_sentences = int(sentences.max()) + 1
        present = torch.zeros(b, prompt_sentences + 1, dtype=torch.bool, device=store.device)
        present = present.scatter_(1, bucket.where(in_store, prompt_sentences), True)[:, :prompt_sentences]
        n_sentences = int(present.sum(1).max()) + 1  # the kept ones, and the empty one
        bucket = (present.cumsum(1) - 1).gather(1, bucket).masked_fill(~in_store, n_sentences - 1)
        slot = bucket[:, None, :, None].expand(b, h, -1, d)
        weight = in_store.float()[:, None, :, None]
        centred = keys.float() - shared
        counts = weight.new_zeros(b, n_sentences).scatter_add_(1, bucket, in_store.float())
        if vector == "bounds":  # empty slots are all in the empty sentence, which is never loaded
            high = weight.new_zeros(b, h, n_sentences, d).scatter_reduce_(2, slot, centred, "amax", include_self=False)
            low = weight.new_zeros(b, h, n_sentences, d).scatter_reduce_(2, slot, centred, "amin", include_self=False)
            layer.state.sentence_keys = torch.cat([high, low], dim=-1)
        else:
            sums = weight.new_zeros(b, h, n_sentences, d).scatter_add_(2, slot, centred * weight)
            layer.state.sentence_keys = sums / counts.clamp(min=1)[:, None, :, None]
        layer.state.sentence_sizes = counts.long()[:, None]  # (b, 1, S) stored tokens of each sentence
        layer.state.slot_sentence = bucket[:, None].expand(b, h, -1)
        layer.fill_store(keys, values, store)

    @staticmethod
    def _seed_queries(cache, layer, call):
        """Start each row's sentence query sum (eq. 2) with the queries of its prompt's last sentence when the
        prompt ends inside that sentence: the sentence being generated began in the prompt."""
        closing = cache.forward.plan
        sentences = cache.state.sentences.to(layer.state.query_sum.device)
        last = sentences == sentences[:, -1:]  # left padding: the last column is every row's last real token
        if closing is not None:
            last &= ~closing.to(last.device)[:, None]
        if not bool(last.any()):
            return
        start = int(last.long().argmax(dim=1).where(last.any(dim=1), last.shape[1]).min())
        queries = call.queries(start, grouped=True).float() * last[:, None, start:, None]
        layer.state.query_sum += queries.sum(dim=2, keepdim=True)

    # --- decoding --------------------------------------------------------------------------------------------
    def on_queries(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        if layer.store_keys is None:
            return
        start = time.perf_counter()
        stack = cache.state.stack
        if stack is not None and call.rope is not None and call.input_valid is None \
                and not query_norm(call.module) is not None and (stack.rope is None or stack.rope is call.rope):
            # `plan="step"`, one token: its projection is kept as it is, and every layer's is grouped and rotated
            # at once after the last layer (`_add_queries`): no op here.
            stack.projected[stack.ranks[call.module.layer_idx]], stack.rope = call.projected, call.rope
            return
        queries = call.queries(grouped=True).float()  # (b, kv_heads, q, d), the step's own projection
        if call.input_valid is not None:  # padding tokens add nothing
            queries = queries * call.valid()[:, None, :, None]
        added = queries if queries.shape[2] == 1 else queries.sum(dim=2, keepdim=True)
        if stack is not None:  # `plan="step"`: selected and loaded when the step began; the query joins the sum
            i = stack.ranks[call.module.layer_idx]
            stack.query_sum.select(1, i).add_(added)  # (two ops; `[:, i] +=` takes four)
            stack.step_queries[i], stack.before_reset = queries, None  # kept for `crop`
            cache.seconds["select"] += time.perf_counter() - start
            return
        layer.state.query_sum += added
        layer.state.step_queries, layer.state.before_reset = queries, None  # kept for `crop`, no copy
        chosen = self._chosen(layer.state)
        cache.seconds["select"] += time.perf_counter() - start
        start = time.perf_counter()
        copied = self._load(layer, chosen)
        cache.seconds["load"] += time.perf_counter() - start
        cache.counts["loaded_tokens"] += copied
        cache.counts["loads"] += copied > 0
        cache.counts["selections"] += 1

    @staticmethod
    def similarity(state) -> torch.Tensor:
        """`q . k_s` `(b, h, S)` of each KV head's mean query with each sentence vector (bounds: the bound), from a
        layer's state (or `(b, layers, h, S)` from a `LayerStack`)."""
        # The mean query (eq. 2), its GQA group averaged: a sum ranks the sentences alike (a positive scale).
        query, keys = state.query_sum, state.sentence_keys
        if keys.shape[-1] != query.shape[-1]:  # bounds [max | min]: q_i max_i where q_i > 0, q_i min_i elsewhere
            query = torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=-1)
        # One batched product, never the elementwise product and a sum: that writes and reads a temporary the size
        # of every sentence vector (all layers' with `plan="step"`), 2.5x the time of the product.
        return torch.matmul(keys, query.transpose(-1, -2)).squeeze(-1)

    @classmethod
    def _chosen(cls, state) -> torch.Tensor:
        """The store slots `(b, h, R)` of the best sentences for the current mean query, `fill` per head, from a
        layer's state (or `(b, layers, h, R)` from a `LayerStack`)."""
        similarity = cls.similarity(state)
        # Best sentences first, each taking its kept tokens until the budget (the last one cut): a sort over the
        # sentences, then a per-slot test against a bound fixed at prefill, never a sort over stored tokens.
        ranked = similarity.argsort(dim=-1, descending=True, stable=True)
        through = state.sentence_sizes.expand_as(ranked).gather(-1, ranked).cumsum(-1)
        through = torch.empty_like(through).scatter_(-1, ranked, through)  # back in sentence order
        return through.gather(-1, state.slot_sentence) < state.slot_room

    @staticmethod
    def _load(layer, chosen, one_read: bool | None = None) -> int:
        """Make the store slots `chosen` `(b, h, R)` the loaded ones, copying only those not resident yet (one
        gather from the store and one write per tensor, every head at once). Returns the tokens copied.

        Each entering token takes the device slot of one that leaves: every head holds `fill` chosen slots, so
        per head as many leave as enter and, listed in the same (row, head) order, they pair up. Attention does
        not care about slot order (keys carry their RoPE), so the loaded region needs none.
        """
        resident, layer.state.resident = layer.state.resident, chosen
        if one_read is None:  # on a CPU a host read costs an op; on a GPU each waits for the device to drain
            one_read = chosen.device.type != "cpu"
        if resident is None:  # at compress: the region is free, chosen slots fill it from the front
            row, head, slot = chosen.nonzero().unbind(-1)
            target = (chosen.cumsum(-1) - 1)[chosen]
        elif not one_read:
            row, head, slot = (chosen > resident).nonzero().unbind(-1)
            target = layer.state.device_slot[resident > chosen]  # the slots of those that leave
        else:
            # Those that enter (chosen, not resident) and those that leave, found by one `nonzero` (one read on
            # the host): as many of each per head, so the first half of its rows enters, the second leaves.
            pairs = torch.stack([chosen > resident, resident > chosen]).nonzero()
            n = pairs.shape[0] // 2
            _, row, head, slot = pairs[:n].unbind(-1)
            _, *leaving = pairs[n:].unbind(-1)
            target = layer.state.device_slot[tuple(leaving)]  # the slots of those that leave
        if slot.numel() == 0:  # the selection did not change: everything is resident already
            return 0
        layer.load(row, head, slot, target)
        layer.state.device_slot[row, head, slot] = target
        return slot.numel()

    def after_step(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        closing, state, stack = cache.forward.plan, layer.state, cache.state.stack
        if stack is not None:  # every layer's at once, after the last
            if call.module.layer_idx == stack.last:
                self._add_queries(cache, stack)
                end_sentence(stack, closing)
        elif state.query_sum is not None:
            end_sentence(state, closing)

    def crop(self, cache: SparseCache, length: int) -> None:
        """A rejected draft: its queries leave the mean query, and so does a sentence end it caused; the last kept
        token decides whether a sentence ends instead."""
        ids = cache.state.step_ids  # the last forward's tokens
        layers, stack = cache.compressed_layers(), cache.state.stack
        # `plan="step"`: the layers' sums are one tensor, cropped at once; the next step ranks with them.
        for state in [layer.state for layer in layers] if stack is None else [stack]:
            queries = state.step_queries  # (b, h, q, d); a plan's: a list over its layers, or stacked already
            if stack is not None and isinstance(queries, list):
                queries = None if queries[0] is None else torch.stack(queries, dim=1)
            if queries is None:
                continue
            q, removed = queries.shape[-2], layers[0].logical_len - length
            if removed > q:
                raise ValueError(f"SentencePress: can only crop the last forward's {q} tokens; asked for {removed}.")
            total = state.query_sum if state.before_reset is None else state.before_reset
            state.query_sum = total - queries[..., q - removed:, :].sum(dim=-2, keepdim=True)
            if removed < q:  # the forward's last kept token may end a sentence
                ends = closes_sentence(self.tokenizer, ids[:, q - removed - 1])
                state.query_sum.masked_fill_(as_rows(ends, state.query_sum), 0.0)
            state.before_reset = None
            state.step_queries = None if stack is None else [None] * len(stack.ranks)

    # --- plan="step" ---------------------------------------------------------------------------------------------
    def _plan_step(self, cache: SparseCache) -> None:
        """Rank and load every layer's sentences for the forward about to run, from the sums of the queries so far
        (`plan="step"`); at the first forward after the prompt, stack the layers' states first."""
        stack = cache.state.stack
        if stack is None and not cache.state.per_layer:
            stack = cache.state.stack = self._stack(cache)
        if stack is None:  # the prompt, no layer compressed (every prompt token attended), or layers apart
            return
        start = time.perf_counter()
        chosen = self._chosen(stack)
        # A row whose sentence has no token yet (just ended; or `prompt_sentence=False`) keeps its selection.
        empty = (stack.query_sum == 0).flatten(1).all(1)
        chosen = torch.where(empty[:, None, None, None], stack.resident, chosen)
        cache.seconds["select"] += time.perf_counter() - start
        start = time.perf_counter()
        copied = self._load_all(cache, stack, chosen)
        cache.seconds["load"] += time.perf_counter() - start
        cache.counts["loaded_tokens"] += copied
        cache.counts["loads"] += copied > 0
        cache.counts["selections"] += len(stack.ranks)
        stack.step_queries = [None] * len(stack.ranks)

    @staticmethod
    def _add_queries(cache: SparseCache, stack: LayerStack) -> None:
        """Add the one-token step's queries that `on_queries` kept as projections to every layer's sum: grouped by
        KV head and rotated in one product for all layers (the step's RoPE matrix, tiled over a group), where each
        layer took five ops of its own."""
        kept = [i for i, projected in enumerate(stack.projected) if projected is not None]
        if not kept:
            return
        start = time.perf_counter()
        kv, d, heads = stack.query_sum.shape[2], stack.query_sum.shape[-1], stack.heads
        matrix = cache.forward.tiled(stack.rope, heads // kv)  # (group d, d) or (b, 1, group d, d)
        queries = rotate_projections([stack.projected[i] for i in kept], matrix, heads * d).float()
        if len(kept) == len(stack.projected):  # every layer's (the common case)
            stack.query_sum += queries
            stack.step_queries = queries  # for `crop`, stacked
        else:
            stack.query_sum.index_add_(1, torch.tensor(kept, device=queries.device), queries)
            for j, i in enumerate(kept):
                stack.step_queries[i] = queries[:, j]
        stack.before_reset = None
        stack.projected, stack.rope = [None] * len(stack.projected), None
        cache.seconds["select"] += time.perf_counter() - start

    @staticmethod
    def _stack(cache: SparseCache) -> LayerStack | None:
        """The `LayerStack` of the cache's layers (None while one is not compressed); the layers' states give up
        their ranking state to it. All have the same store width (the budget sets it). Layers on several devices
        (a `device_map` over GPUs) are not stacked: each ranks at its query (`plan="layer"`), and the `sparsekv`
        logger says so."""
        indices = [i for i, layer in enumerate(cache.layers) if isinstance(layer, KVLayer)]
        layers = [cache.layers[i] for i in indices]
        if not layers or any(layer.state.resident is None for layer in layers):
            return None
        devices = {layer.state.resident.device for layer in layers}
        if len(devices) > 1:
            _ranked_per_layer(tuple(sorted(map(str, devices))))
            cache.state.per_layer = True
            return None
        width = max(layer.state.sentence_keys.shape[2] for layer in layers)
        stack = LayerStack(ranks={index: rank for rank, index in enumerate(indices)}, last=indices[-1],
                           heads=cache.config.get_text_config(decoder=True).num_attention_heads)
        for name in LayerStack.STACKED:
            parts = [getattr(layer.state, name) for layer in layers]
            if name == "sentence_keys":
                parts = [nn.functional.pad(t, (0, 0, 0, width - t.shape[2])) for t in parts]
            elif name == "sentence_sizes":
                parts = [nn.functional.pad(t, (0, width - t.shape[2])) for t in parts]
            setattr(stack, name, torch.stack(parts, dim=1))
            for layer in layers:
                setattr(layer.state, name, None)
        stack.store_positions = torch.stack([layer.store_positions for layer in layers], dim=1)
        loaded = layers[0].state.loaded  # every layer's: the budget sets it
        stack.loaded_positions = torch.stack([layer.positions[..., :loaded] for layer in layers], dim=1)
        stack.step_queries, stack.projected = [None] * len(layers), [None] * len(layers)
        return stack

    @staticmethod
    def _load_all(cache: SparseCache, stack: LayerStack, chosen: torch.Tensor) -> int:
        """`_load` for every layer at once: the slots entering and leaving each layer's selection found by one
        `nonzero` over the stack (one read on the host; layers first, so each layer's are consecutive), then each
        layer whose selection changed loads its own. Returns the tokens copied."""
        resident, stack.resident = stack.resident, chosen
        pairs = torch.stack([chosen > resident, resident > chosen]).transpose(1, 2).nonzero()
        n = pairs.shape[0] // 2  # as many leave as enter, per layer, row and head: they pair up in order
        if n == 0:
            return 0
        _, lay, row, head, slot = pairs[:n].unbind(-1)
        _, lay_out, row_out, head_out, slot_out = pairs[n:].unbind(-1)
        target = stack.device_slot[row_out, lay_out, head_out, slot_out]  # the slots of those that leave
        stack.device_slot[row, lay, head, slot] = target
        stack.loaded_positions[row, lay, head, target] = stack.store_positions[row, lay, slot]  # every layer's
        layers = cache.compressed_layers()
        store = layers[0].store_keys  # every layer's has the same shape (the stack's)
        elsewhere = offloaded(store, row.device)
        # An offloaded store: the entering slots copied to its device once for every layer (on a GPU one wait, not
        # one a layer), where each layer's are counted too.
        entering = pairs[:n].to(store.device) if elsewhere else pairs[:n]
        counts = torch.bincount(entering[:, 1], minlength=len(layers)).tolist()
        ranks = [rank for rank, count in enumerate(counts) if count]
        loading, sizes = [layers[rank] for rank in ranks], [counts[rank] for rank in ranks]
        rows = [None] * len(sizes)
        if elsewhere:  # every loading layer's rows gathered into one pinned buffer: one copy to the GPU per tensor
            index = flat_index(store, *entering[:, 2:].unbind(-1)).split(sizes)
            keys, values = (gather_rows([getattr(layer, name) for layer in loading], index)
                            .to(row.device, non_blocking=True).split(sizes) for name in ("store_keys", "store_values"))
            rows = list(zip(keys, values))
        for rank, layer, *part in zip(ranks, loading, *(t.split(sizes) for t in (row, head, slot, target)), rows):
            # each layer's part of the indices (one `split` each, not a slice per layer); positions: the stack's
            layer.load(*part, owed=OwedPositions(stack, rank))
        return n


@functools.lru_cache(maxsize=None)
def _ranked_per_layer(devices: tuple[str, ...]) -> None:
    """Say once per set of devices that `plan="step"` ranks each layer at its query there."""
    logger.warning("SentencePress: the layers are on several devices (%s), so plan='step' cannot rank them at "
                   "once; each layer ranks at its own query instead, as with plan='layer'.", ", ".join(devices))


def end_sentence(state, closing: torch.Tensor | None) -> None:
    """Rows `closing` `(batch,)` ended a sentence: their mean query (a layer's `query_sum`, or a stack's) starts
    anew, and the sums before are kept for `crop`. None: no row did."""
    if closing is not None:
        state.before_reset = state.query_sum.clone()  # for `crop`, at sentence ends only
        state.query_sum.masked_fill_(as_rows(closing, state.query_sum), 0.0)  # a new sentence starts


def as_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row flag `(batch,)` shaped to broadcast over `like` `(batch, ...)`, on its device: a mask to fill
    with, where indexing by it would wait for the device to count the rows."""
    return rows.to(like.device).view(-1, *[1] * (like.dim() - 1))


def loading_room(slot_sentence: torch.Tensor, sizes: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Per store slot `(b, 1, R)`, the bound under which the stored tokens of the sentences ranked up to its own
    (its own included: `through`) must stay for the slot to be loaded: `fill + size - rank`, i.e. the tokens
    ranked before the slot, `through - size + rank`, are fewer than `fill`. 0 for empty slots: never loaded.

    `slot_sentence` `(b, 1, R)` is sorted by position within each sentence; `sizes` `(b, 1, S)` counts each
    sentence's stored tokens; `fill` `(b, 1, 1)` the loaded slots of each row.
    """
    rank = rank_in_sentence(slot_sentence, sizes.shape[-1])
    size = sizes.gather(-1, slot_sentence)
    return torch.where(rank < size, fill + size - rank, 0)


def rank_in_sentence(sentence: torch.Tensor, n_sentences: int) -> torch.Tensor:
    """For slots sorted by position with sentence ids `sentence` `(..., R)` in [0, n_sentences), each slot's index
    among the slots of its sentence."""
    order = sentence.argsort(dim=-1, stable=True)  # grouped by sentence, by position within a sentence
    sizes = torch.zeros(*sentence.shape[:-1], n_sentences, dtype=torch.long, device=sentence.device)
    sizes.scatter_add_(-1, sentence, torch.ones_like(sentence))
    first = sizes.cumsum(-1) - sizes  # index in `order` of each sentence's first slot
    ranks = torch.arange(sentence.shape[-1], device=sentence.device) - first.gather(-1, sentence.gather(-1, order))
    return torch.empty_like(ranks).scatter_(-1, order, ranks)
