"""Our own CKKS evaluator on torch tensors (CUDA when available, else CPU): issue 16.

Bit-identical to SEAL on SEAL's ciphertexts and keys; see :mod:`fhe.backends.gpu.evaluator`.
"""

from fhe.backends.gpu.evaluator import GpuCiphertext, GpuEvaluator, GpuPlaintext, make_evaluator
from fhe.backends.gpu.keys import GpuKeys

__all__ = ["GpuCiphertext", "GpuEvaluator", "GpuKeys", "GpuPlaintext", "make_evaluator"]
