"""Models that the proposer and the generator drive (the interface is in `interface.py`)."""
from .attention import paged_attention, paged_attention_reference, paged_attention_triton
from .interface import AttentionMetadata, KVCacheSpec, context_slots
from .llama import (ATTENTION_BACKENDS, BENCH_CONFIG, TINY_CONFIG, DraftModel, DraftModelConfig, LlamaConfig,
                    LlamaModel)
from .loading import (Tokenizer, check_draft_matches_target, config_from_gguf, config_from_hf, load_model,
                      load_tokenizer, smollm2_gguf_path)

__all__ = ["AttentionMetadata", "KVCacheSpec", "context_slots", "LlamaConfig", "LlamaModel", "DraftModel",
           "DraftModelConfig", "TINY_CONFIG", "BENCH_CONFIG", "ATTENTION_BACKENDS", "paged_attention",
           "paged_attention_reference", "paged_attention_triton", "load_model", "load_tokenizer", "Tokenizer",
           "check_draft_matches_target", "smollm2_gguf_path", "config_from_hf", "config_from_gguf"]
