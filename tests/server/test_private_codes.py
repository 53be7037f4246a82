"""The one translation of worker failure codes to HTTP errors (``service.task_error``)."""

from __future__ import annotations

import logging

import pytest

from server.private.codes import TaskFailure, WorkerCode
from server.private.service import task_error
from server.private.workers import TaskError

EXPECTED = {
    WorkerCode.BAD_CIPHERTEXT: (400, "bad_ciphertext"),
    WorkerCode.SESSION_UNKNOWN: (410, "session_lost"),
    WorkerCode.SESSION_DESYNC: (410, "session_lost"),
    WorkerCode.KEY_NOT_LOADED: (503, "worker_lost"),
    WorkerCode.INTERNAL: (500, "internal_error"),
}


def test_every_code_has_one_translation():
    assert set(EXPECTED) == set(WorkerCode)
    for code, (status, api_code) in EXPECTED.items():
        err = task_error(TaskError(code.value, "detail", "SomeError"), "req-1")
        assert (err.status_code, err.code) == (status, api_code), code
        assert err.body()["error"]["code"] == api_code


def test_internal_names_the_request_and_logs_no_message(caplog):
    with caplog.at_level(logging.ERROR, logger="cipherlm.private"):
        err = task_error(TaskError("internal", "secret-looking 0xdeadbeef", "ValueError"), "req-42")
    assert err.status_code == 500 and err.headers["X-Request-Id"] == "req-42" and "req-42" in err.message
    assert "0xdeadbeef" not in err.message
    assert "ValueError" in caplog.text and "req-42" in caplog.text and "0xdeadbeef" not in caplog.text


def test_only_known_codes_travel():
    with pytest.raises(ValueError):
        TaskError("ValueError", "an exception class name is not a code")
    assert TaskFailure(WorkerCode.BAD_CIPHERTEXT, "x").code is WorkerCode.BAD_CIPHERTEXT
