"""CKKS parameter sets: 128-bit table, depth rule, round trips."""

import pytest

from fhe.errors import ParameterError
from fhe.params import HE_STANDARD_128, CKKSParams, block_depth, ckks_params_for


@pytest.mark.parametrize("kind,r", [("sqexp", 6), ("sqexp", 4), ("2quad", 1)])
def test_params_fit_depth_and_security(kind, r):
    p = ckks_params_for(kind, r)
    assert p.depth >= block_depth(kind, r)
    assert p.total_bits <= HE_STANDARD_128[p.poly_modulus_degree]
    assert p.scale_bits >= 36
    assert CKKSParams.from_dict(p.to_dict()) == p


def test_smallest_ring_is_chosen():
    assert ckks_params_for("2quad", 1).poly_modulus_degree == 16384
    assert ckks_params_for("sqexp", 6).poly_modulus_degree == 32768


def test_insecure_or_bad_params_refused():
    with pytest.raises(ParameterError):
        CKKSParams(8192, (60, 60, 60, 60), 40)             # 240 > 218 bits
    with pytest.raises(ParameterError):
        CKKSParams(12345, (60, 40, 60), 40)
    with pytest.raises(ParameterError):
        CKKSParams.from_dict({"poly_modulus_degree": 8192})
    with pytest.raises(ParameterError):
        ckks_params_for("exact", 0)
