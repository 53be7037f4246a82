"""Moved to :mod:`fhe.backends.seal.keys` (the SEAL key holders ``CKKSClient`` and ``ServerKeys``).

This name stays, as an alias of that module, while the SDK and the private service still import it; new
code imports the backend module.
"""

import sys

from fhe.backends.seal import keys as _keys

sys.modules[__name__] = _keys
