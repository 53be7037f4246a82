"""The SEAL backend (``tenseal.sealapi``): the CPU server evaluator and the client's key holder."""

from fhe.backends.seal.evaluator import SealEvaluator, make_evaluator

__all__ = ["SealEvaluator", "make_evaluator"]
