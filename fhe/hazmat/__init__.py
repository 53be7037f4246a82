"""Raw CKKS building blocks (SEAL through ``tenseal.sealapi``). Hazardous: no safety checks.

Use ``fhe.backend`` / ``fhe.attention`` instead unless you know the level and scale of every operand.
"""

from fhe.hazmat.seal import (
                             Kit,
                             SecretKeys,
                             build_context,
                             decrypt,
                             encrypt,
                             from_bytes,
                             galois_elements,
                             generate_keys,
                             to_bytes,
                             translate,
)

__all__ = ["Kit", "SecretKeys", "build_context", "decrypt", "encrypt", "from_bytes", "galois_elements",
           "generate_keys", "to_bytes", "translate"]
