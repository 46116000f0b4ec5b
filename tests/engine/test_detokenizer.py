"""Incremental detokenization equals a full decode, across multi-byte and merged tokens."""
from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from tests.models import smollm2_tokenizer

TEXTS = ["héllo wörld — naïve café", "日本語のテキストと絵文字 🎉🚀 mixed", "  spaces\tand\nnewlines  ", "don't stop"]


def _stream(tokenizer, prompt_ids, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, list(stop))
    deltas, matched = [], None
    for i, t in enumerate(ids):
        matched = detok.update(t)
        deltas.append(detok.take_delta(finished=matched is not None))
        if matched:
            break
    if matched is None:
        detok.flush()
        deltas.append(detok.take_delta(finished=True))
    return detok.output_text, deltas, matched


def test_stream_equals_full_decode_for_multibyte_text():
    tok = smollm2_tokenizer()
    prompt = tok.encode("Say:")
    for text in TEXTS:
        ids = tok.encode(text)
        full, deltas, _ = _stream(tok, prompt, ids)
        assert full == tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == full
        assert all("\ufffd" not in d for d in deltas)


def test_emoji_split_across_tokens_is_held_back_until_complete():
    tok = smollm2_tokenizer()
    ids = tok.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    _, deltas, _ = _stream(tok, [], ids)
    assert deltas[0] == "" and "".join(deltas) == "🎉"


def test_stop_string_spanning_tokens():
    tok = smollm2_tokenizer()
    ids = tok.encode("alpha beta gamma delta")
    full, deltas, matched = _stream(tok, [], ids, stop=["a gam"])
    assert matched == "a gam" and full == "alpha bet"
    assert "".join(deltas) == full
