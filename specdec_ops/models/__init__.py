"""Models that the proposer and the generator drive (the interface is in `interface.py`)."""
from .interface import AttentionMetadata, KVCacheSpec
from .llama import BENCH_CONFIG, TINY_CONFIG, DraftModel, DraftModelConfig

__all__ = ["AttentionMetadata", "KVCacheSpec", "DraftModel", "DraftModelConfig", "TINY_CONFIG", "BENCH_CONFIG"]
