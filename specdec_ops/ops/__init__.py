"""The ops' contracts, in plain PyTorch (no triton): one module per op family.

Each module's docstring states the semantics; it holds the typed wrappers (`torch.ops.specdec.*` calls), the
plain-PyTorch references, the input checks and one fake kernel per op, registered for all its overloads. Shared
pieces: checks.py (validation), counter_hash.py (the random stream), output.py (the [B, k+1] output row every
verifier returns).
"""
