"""cipherlm's encrypted path: CKKS/TFHE backends, packing, encrypted linear algebra and attention."""

__all__: list[str] = []
