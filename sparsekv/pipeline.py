"""`pipeline("sparsekv-text-generation")`: one long context compressed once, many questions answered from it.

    from transformers import pipeline
    import sparsekv  # registers the task

    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer, press=SnapKVPress(ratio=0.1))
    out = pipe(context, questions=["Who ...?", "When ...?"], max_new_tokens=32)
    out["answers"], out["kv_bytes"], out["full_kv_bytes"]

Inside `with press(model):` the standard `pipeline("text-generation")` runs compressed as well, since it calls
`model.generate`; this task adds the question-agnostic pattern, where the context's cache outlives one question.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .evaluation.prompts import Sample, encode
from .prefill import Prefill, generate_from
from .stats import cache_footprint

TASK = "sparsekv-text-generation"


class SparseKVPipeline(Pipeline):
    """Prefill and compress a `context` once, then answer each question from that compressed cache.

    The context and each question are laid out with the tokenizer's chat template (one user message, context
    then question), as `sparsekv eval --mode agnostic` does: the context is prefilled alone and compressed by
    `press` (None: the full cache), and every question is decoded greedily from a copy of the compressed cache,
    so no question sees another's tokens.

    Args (at construction or per call):
        press: the press compressing the context (any sparsekv press; None keeps the full cache).
        question / questions: one question, or a list of them.
        max_new_tokens: tokens generated per answer (default 64).

    Returns a dict: `answers` (one string per question, in order), `context_tokens` (the context's length in
    tokens, chat template included), `resident_tokens` (KV slots the compressed context holds per sequence,
    mean over layers), `kv_bytes` (its keys and values) and `full_kv_bytes` (those of the uncompressed context).
    """

    def _sanitize_parameters(self, press=None, question=None, questions=None, max_new_tokens=None):
        preprocess, forward = {}, {}
        if question is not None and questions is not None:
            raise ValueError("give question (one) or questions (a list), not both.")
        if question is not None:
            preprocess["questions"] = [question]
        elif questions is not None:
            preprocess["questions"] = [questions] if isinstance(questions, str) else list(questions)
        if press is not None:
            forward["press"] = press
        if max_new_tokens is not None:
            if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
                raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}.")
            forward["max_new_tokens"] = max_new_tokens
        return preprocess, forward, {}

    def preprocess(self, context: str, questions: list[str] | str | None = None) -> dict:
        if not isinstance(context, str) or not context.strip():
            raise ValueError("context: give the long text to compress, a non-empty string.")
        if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
            raise ValueError("questions: give at least one question (question=\"...\" or questions=[...]), "
                             "each a non-empty string.")
        prompts = [encode(self.tokenizer, Sample(context=context, question=q, answers=[])) for q in questions]
        return {"context_ids": prompts[0].context_ids, "question_ids": [p.question_ids for p in prompts]}

    def _forward(self, inputs, press=None, max_new_tokens=64):
        context = inputs["context_ids"]
        prefill = Prefill.run(self.model, context)
        cache = prefill.cache if press is None else prefill.compress(press)
        resident, _, kv_bytes = cache_footprint(cache)
        generation = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.model.generation_config.eos_token_id)
        answers = []
        for question in inputs["question_ids"]:
            ids = torch.cat([context, question], dim=1)
            answers.append(generate_from(self.model, press, cache, ids, generation)[0, ids.shape[1]:])
        return {"answers": answers, "context_tokens": context.shape[1], "resident_tokens": resident,
                "kv_bytes": kv_bytes, "full_kv_bytes": cache_footprint(prefill.cache)[2]}

    def postprocess(self, outputs: dict) -> dict:
        answers = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs["answers"]]
        return {**outputs, "answers": answers}


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=SparseKVPipeline, pt_model=AutoModelForCausalLM)
