"""The runtime around the ops: KV-block bookkeeping, graph capture, the draft proposer and the generator."""
from .generator import GenerationMetrics, GenerationOutput, Generator, GeneratorConfig, Request, RequestOutput
from .graphs import StepGraphs
from .kv import NULL_BLOCK, BlockPool, BlockTable
from .proposer import DraftProposer, ProposerConfig

__all__ = ["NULL_BLOCK", "BlockPool", "BlockTable", "StepGraphs", "DraftProposer", "ProposerConfig", "Generator",
           "GeneratorConfig", "Request", "RequestOutput", "GenerationMetrics", "GenerationOutput"]
