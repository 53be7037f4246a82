"""A thin wrapper on concrete-ml-extensions' GLWE encrypted x clear matmul — the benchmark peer.

This is the backend Concrete ML's hybrid models use for their encrypted linear layers (see
``concrete.ml.quantization.linear_op_glwe_backend``): the client quantizes its input to 7-bit
unsigned integers and encrypts it as GLWE ciphertexts; the server multiplies by a quantized clear
matrix (uint64) under a compression key; the client decrypts and de-quantizes. Concrete ML itself
cannot share our environment (it pins torch 2.3.1 and more), so this module calls the library
directly, the same way.

Only used by ``bench/fhe_matmul.py``; not part of the serving path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fhe.errors import ShapeError

INPUT_BITS = 7
WEIGHT_BITS = 8


def _quantize(a: np.ndarray, bits: int) -> tuple[np.ndarray, float, float]:
    """Affine unsigned quantization: a ~ scale * q + offset with q in [0, 2^bits - 1]."""
    lo, hi = float(a.min()), float(a.max())
    scale = (hi - lo) / (2 ** bits - 1) or 1.0
    q = np.clip(np.rint((a - lo) / scale), 0, 2 ** bits - 1).astype(np.uint64)
    return q, scale, lo


@dataclass
class GLWEMatmul:
    """Encrypted row vector(s) x clear matrix ``W [n_in, n_out]`` with concrete-ml-extensions."""

    weight: np.ndarray
    _fhext: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import concrete_ml_extensions as fhext  # optional dependency (extra "concrete")

        self._fhext = fhext
        self.params = fhext.MatmulCryptoParameters.deserialize(fhext.default_params())
        self.private_key, self.compression_key = fhext.create_private_key(self.params)
        self.w_q, self.w_scale, self.w_lo = _quantize(np.asarray(self.weight, np.float64), WEIGHT_BITS)
        self.poly_size = 2048

    def encrypt(self, x: np.ndarray):
        """Client: quantize x [n_in] (or [T, n_in]) and encrypt; returns (ciphertext, quantization)."""
        x2 = np.atleast_2d(np.asarray(x, np.float64))
        if x2.shape[1] != self.weight.shape[0]:
            raise ShapeError(f"x has {x2.shape[1]} features, W has {self.weight.shape[0]} rows")
        x_q, scale, lo = _quantize(x2, INPUT_BITS)
        ct = self._fhext.encrypt_matrix(pkey=self.private_key, crypto_params=self.params, data=x_q)
        return ct, (x_q, scale, lo)

    def multiply(self, ct):
        """Server: the encrypted product with the quantized clear matrix."""
        return self._fhext.matrix_multiplication(encrypted_matrix=ct, data=self.w_q,
                                                 compression_key=self.compression_key)

    def decrypt(self, result, quant) -> np.ndarray:
        """Client: decrypt and de-quantize to x @ W ([T, n_out])."""
        x_q, x_scale, x_lo = quant
        n_out = self.weight.shape[1]
        valid = n_out % self.poly_size or self.poly_size
        acc = self._fhext.decrypt_matrix(result, self.private_key, self.params, valid).astype(np.int64)
        acc = acc.reshape(x_q.shape[0], -1)[:, :n_out].astype(np.float64)
        n_in = x_q.shape[1]
        col = self.w_q.astype(np.float64).sum(0)                        # [n_out]
        row = x_q.astype(np.float64).sum(1, keepdims=True)              # [T, 1]
        return (x_scale * self.w_scale * acc + x_scale * self.w_lo * row + x_lo * self.w_scale * col
                + n_in * x_lo * self.w_lo)

    @staticmethod
    def serialized_size(obj) -> int:
        """Bytes of a serialized GLWE object (input or result ciphertext)."""
        return len(obj.serialize())
