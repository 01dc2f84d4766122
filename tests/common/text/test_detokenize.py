"""Incremental detokenization and stop strings, against `Tokenizer.decode` of the whole sequence."""

from __future__ import annotations

import random
import unicodedata

import pytest

from common.model.defaults import default_model_dir
from common.text.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStrings
from common.text.tokenizer import Tokenizer

TEXTS = [
    "Hello from Spillway: café, 日本語 and 🙂 — done.",
    "naïve façade Привет мир, 中文字符 и ещё 👨‍👩‍👧 family",
    "emoji 🙂😀🎉🚀❤️👍🏽 in a row",
    "math: ∑ x² ≤ ∞, arrows → ⇒, and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "plain ASCII text, with numbers 12345 and code: def f(x): return x",
]
# Characters of 1 to 4 UTF-8 bytes, combining marks and ZWJ: they split over byte-level tokens.
ALPHABET = "ab cdé\nñøΩЖж中文日本語한국🙂🚀👍🏽\u0301\u200d€$,.!?"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


def stream(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True) -> list[str]:
    """The pieces an IncrementalDetokenizer emits for `ids` pushed in random chunks, then the flush."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4)
        pieces.append(detok.push(ids[i : i + size]))
        i += size
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_decode_like_the_whole_sequence(tok: Tokenizer, skip: bool) -> None:
    """Any id sequence, even invalid UTF-8 byte soup and special tokens, ends up as decode(ids)."""
    for seed in range(400):
        rng = random.Random(seed)
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 48))]
        assert "".join(stream(tok, ids, rng, skip)) == tok.decode(ids, skip_special_tokens=skip), ids


def check_valid_text(tok: Tokenizer, text: str, rng: random.Random) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids, rng)
    assert "".join(pieces) == tok.decode(ids) == unicodedata.normalize("NFC", text)  # tokenizer is NFC
    for piece in pieces:
        assert REPLACEMENT_CHAR not in piece, (text, pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_without_broken_characters(tok: Tokenizer, text: str) -> None:
    for seed in range(20):
        check_valid_text(tok, text, random.Random(seed))


def test_random_unicode_text(tok: Tokenizer) -> None:
    for seed in range(300):
        rng = random.Random(seed)
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        check_valid_text(tok, text, rng)


def test_one_token_at_a_time_holds_partial_characters(tok: Tokenizer) -> None:
    text = "日本語"
    ids = tok.encode(text)
    assert len(ids) > len(text), "the tiny vocabulary splits CJK characters into byte tokens"
    detok = IncrementalDetokenizer(tok)
    sent = ""
    for token in ids:
        sent += detok.push([token])
        assert text.startswith(sent)
    assert sent + detok.flush() == text


def test_flush_of_an_incomplete_character_matches_decode(tok: Tokenizer) -> None:
    ids = tok.encode("é")
    partial = ids[:1] if len(ids) > 1 else tok.encode("日")[:1]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(partial) == ""
    assert detok.flush() == tok.decode(partial) == REPLACEMENT_CHAR
    assert detok.token_ids == partial


def feed(stops: StopStrings, text: str, rng: random.Random) -> str:
    out, i = "", 0
    while i < len(text):
        size = rng.randint(1, 5)
        out += stops.push(text[i : i + size])
        i += size
    return out


def expected_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the stop string that completes first (the longer one if two end together)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def test_stop_strings_random() -> None:
    """Whatever the chunking, the output is the text up to the first stop string, appended only."""
    for seed in range(2000):
        rng = random.Random(seed)
        text = "".join(rng.choice("abcab é日🙂") for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice("abé日🙂") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 4))
        ]
        matcher = StopStrings(stops)
        out = feed(matcher, text, rng)
        want, hit = expected_cut(text, stops)
        if hit:
            assert out == want and matcher.matched is not None, (text, stops)
            assert matcher.flush() == ""
        else:
            assert out + matcher.flush() == text and matcher.matched is None, (text, stops)


def test_stop_string_is_held_back_until_it_cannot_match() -> None:
    matcher = StopStrings(["STOP"])
    assert matcher.push("hello ST") == "hello "
    assert matcher.held == "ST"
    assert matcher.push("O") == ""
    assert matcher.push("RM") == "STORM"
    assert matcher.push(" then STO") == " then "
    assert matcher.push("P and more") == ""
    assert matcher.matched == "STOP"
    assert matcher.push("anything") == ""


def test_first_completed_stop_string_wins() -> None:
    """As in generation, which stops at the first stop string to complete, whatever the chunking."""
    for chunks in (["c a日🙂"], ["c a日", "🙂"]):
        matcher = StopStrings(["a日🙂", "日"])
        assert "".join(matcher.push(c) for c in chunks) == "c a"
        assert matcher.matched == "日"
    matcher = StopStrings(["o w", "lo w", "world"])
    assert matcher.push("hello world") == "hel"
    assert matcher.matched == "lo w"


def test_a_kept_stop_string_ends_the_text_with_itself() -> None:
    for chunks in (["call </tool_call> more"], ["call </to", "ol_call>", " more"]):
        matcher = StopStrings(["END"], kept=["</tool_call>"])
        assert "".join(matcher.push(c) for c in chunks) == "call </tool_call>"
        assert matcher.matched == "</tool_call>" and matcher.flush() == ""
    matcher = StopStrings(["END"], kept=["</tool_call>"])
    assert matcher.push("x END </tool_call>") == "x " and matcher.matched == "END"


def test_no_stop_strings_pass_through() -> None:
    matcher = StopStrings(["", ""])
    assert matcher.push("abc") == "abc"
    assert matcher.flush() == ""
