"""The encrypted step's stage histogram (``cipherlm:private_step_stage_seconds``): bounded labels, times only."""

from __future__ import annotations

from server.metrics import PRIVATE_STEP_STAGES, ServerMetrics


def test_stage_times_are_observed_under_the_fixed_stage_and_kind_labels_only():
    m = ServerMetrics("m")
    m.record_private_stages("prefill", {"body_read": 0.002, "total": 0.05, "worker_compute": 0.01})
    m.record_private_stages("decode", {"total": 0.01, "session=abc": 1.0, "tenant-a": 2.0})   # not stages: dropped
    m.record_private_stages("tenant-a", {"total": 1.0})                                         # not a kind: dropped
    m.record_private_stages("decode", {"queue_wait": -1e-6})                                    # clock skew: 0
    text = m.render().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("cipherlm:private_step_stage_seconds_count")]
    labels = {ln.split("{", 1)[1].split("}", 1)[0] for ln in lines}
    assert labels == {'kind="prefill",stage="body_read"', 'kind="prefill",stage="total"',
                      'kind="prefill",stage="worker_compute"', 'kind="decode",stage="total"',
                      'kind="decode",stage="queue_wait"'}
    assert "abc" not in text and "tenant-a" not in text
    assert 'cipherlm:private_step_stage_seconds_sum{kind="prefill",stage="total"} 0.05' in text
    assert len(PRIVATE_STEP_STAGES) == len(set(PRIVATE_STEP_STAGES)) <= 16
