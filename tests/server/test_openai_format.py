"""server/routers/openai_format.py: the byte-template SSE frames are exactly json.dumps of the chunk dicts."""

from __future__ import annotations

import copy

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from server.routers.openai_format import ChunkBuilder, ResponseMeta, sse

# (delta_text, delta_token_ids, finish_reason): text needing escapes, an empty delta, a finish alone,
# the engine's "abort" (sent as "length"), a repeated finish (not sent twice)
STEPS = [("hé\"\\\n\u2028😀\x00", [3], None), ("", [4], None), ("", [], None), ("", [], "stop"),
         ("x", [5], "abort"), ("", [], "length")]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_frames_equal_the_dict_chunks(chat, n):
    meta = ResponseMeta(id='cmpl-"q"', created=1700000000, model="tiny/ö", n=n, chat=chat, logprobs=None)
    slow, fast = ChunkBuilder(meta, None), ChunkBuilder(meta, None)
    for prompt_index in (0, 1):
        for text, ids, reason in STEPS:
            out = RequestOutput("r", [1], [CompletionOutput(i, [1], "t", text, ids, None, reason, None)
                                           for i in range(n)], reason is not None)
            expected = b"".join(sse(c) for c in slow.chunks(prompt_index, copy.deepcopy(out)))
            assert fast.frames(prompt_index, copy.deepcopy(out)) == expected


def test_frames_with_logprobs_take_the_dict_path():
    meta = ResponseMeta(id="cmpl-1", created=1, model="m", n=1, chat=False, logprobs=1)
    out = RequestOutput("r", [1], [CompletionOutput(0, [5], "a", "a", [5], [{5: -0.5}], None, None)], False)
    frame = ChunkBuilder(meta, lambda t: "a").frames(0, out)
    assert frame.startswith(b"data: {") and b'"logprobs":{' in frame and frame.endswith(b"\n\n")
