"""Property-based API fuzzing: schemathesis generates requests from the app's own OpenAPI schema and
sends them in-process (ASGI) to the app running the real engine; no response may be a 5xx.

The app owns its engine here (built in its lifespan), so the engine and every request share the one
event loop schemathesis runs ASGI apps on. The number of cases is printed (``-s``) and asserted.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi as schemathesis_asgi

from server.app import create_app
from tests.server import app_helpers
from tests.server.app_helpers import auth, build_tiny_model_dir, make_settings

MAX_EXAMPLES = 120  # per operation
CASES: dict[str, int] = {}
STATUSES: dict[int, int] = {}
pytestmark = pytest.mark.slow  # ~1 min on 2 cores


def _fuzz_app():
    import tempfile
    from pathlib import Path

    model_dir = build_tiny_model_dir(Path(tempfile.mkdtemp(prefix="cipherlm-fuzz-")) / "tiny", max_len=512)
    cfg = make_settings(model_dir, engine={"device": "cpu", "num_kv_blocks": 128}, max_n=4,
                        max_prompts_per_request=4)
    for t in cfg.tenants:  # keep every generated request cheap: few tokens, no rate limit in the way
        t.limits = cfg.limits_default.model_copy(update={"max_tokens": 16, "requests_per_minute": None})
    assert [t.id for t in cfg.tenants] == [t.id for t in app_helpers.tenants()]
    return create_app(cfg)


APP = _fuzz_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _report_and_stop():
    yield
    total = sum(CASES.values())
    print(f"\nschemathesis: {total} cases; by status: {dict(sorted(STATUSES.items()))}; by operation: {CASES}")
    schemathesis_asgi.shutdown_lifespans()
    assert total >= 100, "the fuzzer ran too few cases to mean anything"


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    """Every generated request gets a 2xx/4xx in OpenAI's error shape, never a 5xx."""
    key = f"{case.method} {case.path}"
    CASES[key] = CASES.get(key, 0) + 1
    response = case.call(headers=auth("plain"))
    STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
    assert response.status_code < 500, f"{key} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
