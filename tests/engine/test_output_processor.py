"""Stop strings on streamed text: no delta ever shows text at or past a stop string."""

from __future__ import annotations

from engine.output_processor import SeqText


class PieceTokenizer:
    """Token id i decodes to PIECES[i] (enough of the Tokenizer surface for SeqText)."""

    PIECES = ["Hel", "lo", " wor", "ld", "!", " S", "TO", "P", " more"]

    def detokenizer(self, prompt_ids, skip_special_tokens=True):
        pieces = self.PIECES

        class Detok:
            def step(self, ids):
                return "".join(pieces[i] for i in ids)

        return Detok()


def stream(tokens, stops):
    st = SeqText(PieceTokenizer(), [], stops)
    deltas, stop = [], None
    for t in tokens:
        stop = st.add(t)
        deltas.append(st.take_delta(finished=stop is not None))
        if stop:
            break
    return deltas, stop, st


def test_stop_string_split_across_tokens_is_never_streamed():
    deltas, stop, st = stream([0, 1, 2, 3, 5, 6, 7, 8], ["STOP"])
    assert stop == "STOP"
    assert "".join(deltas) == st.full == "Hello world "
    assert not any("S" in d for d in deltas)      # the stop string's first letter never leaked
    assert deltas[:3] == ["", "He", "llo "]        # the last len("STOP") - 1 characters are held back


def test_held_back_text_is_flushed_at_the_end():
    deltas, stop, st = stream([0, 1, 2, 3], ["STOP", "world!"])
    assert stop is None
    assert "".join(deltas) == "Hello "       # "world" could still become "world!": held back
    assert st.take_delta(finished=True) == "world"


def test_earliest_stop_wins():
    deltas, stop, _ = stream([0, 1, 2, 3, 4], ["world", "lo"])
    assert stop == "lo" and "".join(deltas) == "Hel"


def test_without_stop_strings_text_is_decoded_when_taken_in_one_call():
    """No stop string: tokens wait in the sequence's text state and the detokenizer gets them all in one call
    when an output takes its delta (a held streamed delta under load, or the finish), with the same text."""
    calls = []

    class Counting(PieceTokenizer):
        def detokenizer(self, prompt_ids, skip_special_tokens=True):
            inner = super().detokenizer(prompt_ids, skip_special_tokens)

            class Detok:
                def step(self, ids):
                    calls.append(list(ids))
                    return inner.step(ids)

            return Detok()

    st = SeqText(Counting(), [], [])
    for t in [0, 1, 2]:
        assert st.add(t) is None
    assert calls == [] and st.full == ""
    assert st.take_delta(finished=False) == "Hello wor" and calls == [[0, 1, 2]]
    assert st.take_delta(finished=False) == "" and len(calls) == 1  # nothing new: no call
    st.add(3)
    st.add(4)
    assert st.take_delta(finished=True) == "ld!" and calls[-2:] == [[3], [4]]  # the finish: one by one
    assert st.full == "Hello world!"


def test_a_stream_cut_inside_a_character_keeps_the_text_before_it(default_model_dir):
    """The finish detokenizes token by token: an output cut short inside a multi-byte character (max_tokens)
    loses only that character, on both detokenizer paths, held streamed deltas or not."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(default_model_dir)
    ids = tok.encode("caf\u00e9 \U0001F389\U0001F680 done", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))  # inside an emoji
    want = None
    for native in (True, False):
        for hold in (1, 2, cut):  # tokens per held delta: every step (detokenized one by one), pairs, all at the end
            st = SeqText(tok, [], [])
            if not native:
                st.detok._stream = None
            text = ""
            for i, t in enumerate(ids[:cut]):
                st.add(t)
                last = i == cut - 1
                if last or (i + 1) % hold == 0:
                    text += st.take_delta(finished=last)
            want = want or text
            assert text == want, (native, hold)
    assert want == "caf\u00e9"  # the last token (" " + an emoji's first byte) is held back whole


def test_delta_only_outputs_carry_the_same_deltas_and_no_cumulative_fields():
    """The engine core's mode (``cumulative = False``): per output the same deltas, empty token_ids / text."""
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import SamplingParams
    from tests.engine.engine_helpers import make_seq

    runs = {}
    for cumulative in (True, False):
        proc = OutputProcessor(PieceTokenizer(), [], 1024)
        proc.cumulative = cumulative
        seq = make_seq([0], params=SamplingParams(max_tokens=8, ignore_eos=True))
        outs = []
        for tok in [0, 1, 2, 3, 4]:
            seq.append_token(tok)
            assert proc.check_finish(seq, tok) is None
            outs.append(proc.build(seq.request).outputs[0])
        runs[cumulative] = outs
    assert [(o.delta_token_ids, o.delta_text) for o in runs[False]] == \
        [(o.delta_token_ids, o.delta_text) for o in runs[True]]
    assert runs[True][-1].token_ids == [0, 1, 2, 3, 4] and runs[True][-1].text == "Hello world!"
    assert all(o.token_ids == [] and o.text == "" for o in runs[False])


def test_wire_deltas_equal_the_encoded_outputs():
    """``OutputProcessor.delta`` (the core's fast path) makes the tuple ``engine_core.encode`` makes of a built
    output, step by step, finish included."""
    from engine.engine_core import encode
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import SamplingParams
    from tests.engine.engine_helpers import make_seq

    runs = {}
    for fast in (True, False):
        proc = OutputProcessor(PieceTokenizer(), [], 1024)
        proc.cumulative = False
        seq = make_seq([0], params=SamplingParams(max_tokens=8, stop=["STOP"]))
        wire = []
        for tok in [0, 1, 2, 3, 5, 6, 7]:
            seq.append_token(tok)
            verdict = proc.check_finish(seq, tok)
            if verdict is not None:
                seq.finish(*verdict)
            wire.append(proc.delta(seq.request) if fast else encode(proc.build(seq.request)))
        runs[fast] = wire
    assert runs[True] == runs[False]
    assert runs[True][-1][4][0][4] == "stop" and "".join(w[4][0][1] for w in runs[True]) == "Hello world "


def test_the_core_holds_deltas_under_load_and_loses_no_token():
    """``LLMEngine.delta_coalescing`` (the core process's copy of ``stream_coalesce_streams``): with R requests
    in the engine an unfinished request's delta goes out once 1 + R // delta_coalescing tokens are in; the
    first never waits, the finish carries the rest, and the tokens and text are those of every-step deltas."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.engine.engine_helpers import random_prompts, tiny_model

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts([5, 5, 7], seed=4)
    runs = {}
    for per in (0, 1):  # 1: three requests, four tokens a delta
        engine = LLM(tiny_model()).engine
        engine.output_processor.cumulative, engine.emit_deltas, engine.stream_outputs = False, True, True
        engine.delta_coalescing = per
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        sizes: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                rid, comps = (out[0], out[4]) if type(out) is tuple else \
                    (out.request_id, [(c.index, c.delta_text, c.delta_token_ids) for c in out.outputs])
                sizes[rid].append(len(comps[0][2]))
                ids[rid] += comps[0][2]
        runs[per] = sizes, ids
    assert runs[0][1] == runs[1][1] and all(len(v) == 20 for v in runs[1][1].values())
    assert all(s == [1] * 20 for s in runs[0][0].values())
    for s in runs[1][0].values():
        assert s[0] == 1 and min(s[1:-1]) >= 4 and len(s) <= 7  # 1 + 4 x 4 + the finish's rest
