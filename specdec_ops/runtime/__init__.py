"""The runtime around the ops: KV-block bookkeeping and the draft proposer."""
from .kv import NULL_BLOCK, BlockPool
from .proposer import DraftProposer, ProposerConfig

__all__ = ["NULL_BLOCK", "BlockPool", "DraftProposer", "ProposerConfig"]
