"""A symbolic CKKS evaluator: plaintext values inside, levels, sizes and scales checked like SEAL.

For tests: it runs any program written against :class:`fhe.evaluator.Evaluator` without encrypting,
and fails where SEAL would (level or scale mismatch, rotation without its key, size-3 rotation) and where
a real ciphertext would silently break (a message that overflows its level's modulus).
"""

from fhe.backends.symbolic.evaluator import (
    SymbolicCiphertext,
    SymbolicClient,
    SymbolicEvaluator,
    SymbolicKeys,
    make_evaluator,
    seal_primes,
)

__all__ = ["SymbolicCiphertext", "SymbolicClient", "SymbolicEvaluator", "SymbolicKeys", "make_evaluator",
           "seal_primes"]
