"""The engine tests' model: a tiny Llama written by `transformers` from a fixed seed.

No hub, no tokenizer: the servers run with `--skip-tokenizer-init` and take prompt token ids.
The weights are drawn wider than `transformers`' default (`initializer_range`) so greedy tokens
depend on the whole prompt and on every KV page: with near-uniform logits a corrupted page
could leave the argmax where it was, and the negative control would prove nothing. Even so a
few greedy steps are near-ties (top two logits 1e-6 apart) that float rounding decides, and
rounding differs between a single server and a PD pair (batch shapes): `min_margin` finds them,
so the tests use only prompts without one (`client.prompts`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

LAYERS = 4  # two per stage of a PP 2 prefill
HEADS, KV_HEADS = 4, 2  # TP 2 splits both
VOCAB = 512
SEED = 30
_reference: list[Any] = []  # the model in this process, built once by `min_margin`


def _build() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).to(torch.float32)


def write_model(path: Path) -> Path:
    """Write config.json and model.safetensors for the tiny Llama into `path`; returns it."""
    _build().save_pretrained(path, safe_serialization=True)
    return path


def min_margin(prompt: list[int], new_tokens: int) -> float:
    """The smallest gap between the top two logits over the greedy continuation of `prompt`
    (`new_tokens` steps), computed by `transformers` on the same weights."""
    import torch

    if not _reference:
        _reference.append(_build().eval())
    model = _reference[0]
    ids, past, smallest = torch.tensor([prompt]), None, math.inf
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(ids, past_key_values=past, use_cache=True)
            top = torch.topk(out.logits[0, -1], 2)
            smallest = min(smallest, float(top.values[0] - top.values[1]))
            ids, past = top.indices[:1].view(1, 1), out.past_key_values
    return smallest
