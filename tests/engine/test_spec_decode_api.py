"""The per-request speculation field through the OpenAI translation the server and the SDK share."""

from __future__ import annotations

import pytest

from engine import openai_api


def _params(body):
    return openai_api.sampling_params(body, chat=False, max_tokens=8)


def test_num_speculative_tokens_reaches_sampling_params():
    assert _params({"num_speculative_tokens": 5}).num_speculative_tokens == 5
    assert _params({"num_speculative_tokens": 0}).num_speculative_tokens == 0
    assert _params({}).num_speculative_tokens is None  # the deployment's default


@pytest.mark.parametrize("value", [-1, 17, 2.5, True, "4"])
def test_bad_num_speculative_tokens_names_the_field(value):
    with pytest.raises(openai_api.OpenAIRequestError) as err:
        _params({"num_speculative_tokens": value})
    assert err.value.param == "num_speculative_tokens"


def test_beam_search_over_the_api_is_refused_naming_the_field():
    with pytest.raises(openai_api.OpenAIRequestError) as err:
        openai_api.check_unsupported({"use_beam_search": True}, chat=True)
    assert err.value.param == "use_beam_search"
    openai_api.check_unsupported({"use_beam_search": False}, chat=False)  # the neutral value is fine
