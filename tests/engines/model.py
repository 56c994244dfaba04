"""The engine tests' model: a tiny Llama written by `transformers` from a fixed seed.

No hub, no tokenizer: the servers run with `--skip-tokenizer-init` and take prompt token ids.
The weights are drawn wider than `transformers`' default (`initializer_range`) so greedy tokens
depend on the whole prompt and on every KV page: with near-uniform logits a corrupted page
could leave the argmax where it was, and the negative control would prove nothing.
"""

from __future__ import annotations

from pathlib import Path

LAYERS = 4  # two per stage of a PP 2 prefill
HEADS, KV_HEADS = 4, 2  # TP 2 splits both
VOCAB = 512
SEED = 30


def write_model(path: Path) -> Path:
    """Write config.json and model.safetensors for the tiny Llama into `path`; returns it."""
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
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path
