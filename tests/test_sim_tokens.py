"""The simulator's tokenizer rule (pdproxy/sim/tokens.py): sub-word counts, round trips, the template."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pdproxy.bench.workload import VOCAB
from pdproxy.sim import tokens
from pdproxy.sim.tokens import BOS, EOT, START_HEADER, OutputText, Tokenizer


def test_bench_words_average_the_configured_tokens_per_word():
    rng = np.random.default_rng(0)
    text = " ".join(VOCAB[i] for i in rng.integers(0, len(VOCAB), 20000))
    for mean in (2.0, 2.3, 2.8):  # (four letters need at least 2 tokens: pieces have up to 3)
        per_word = Tokenizer(mean).count(text) / 20000
        assert abs(per_word - mean) < 0.03, (mean, per_word)


def test_words_have_one_to_three_tokens_depending_on_the_word():
    tok = Tokenizer(2.3)
    counts = {w: len(tok.encode(" " + w)) for w in VOCAB}
    assert set(counts.values()) == {2, 3}  # four-letter words: floor or ceil of the mean
    assert len(tok.encode("a")) == 1 and len(tok.encode(" I")) == 1  # one letter, one token
    assert len(tok.encode("abcdefghijklmnopqrstuvwxyz")) == 9  # never more than 3 letters a token
    assert tok.encode("bakodu") == tok.encode("bakodu")  # deterministic
    assert Tokenizer(2.3).encode("x y") == tokens.Tokenizer(2.3).encode("x y")


@pytest.mark.parametrize("text", [
    "plain words here", "  leading and  double  spaces ", "tabs\tand\nnew\r\nlines\n\n",
    "Ünïcödé ✓ 日本語 emoji 🎉", "punct!? (a,b) [c]; {d}: x=1+2*3/4", "MiXeD CaSe WORDS", "",
])
def test_text_round_trips_through_ids(text):
    ids = tokens.encode(text)
    assert all(0 <= t < tokens.VOCAB_SIZE for t in ids)
    assert tokens.decode(ids) == text


def test_non_ascii_falls_back_to_bytes_as_byte_level_bpe():
    ids = tokens.encode("✓")
    assert ids == list("✓".encode()) and len(ids) == 3
    assert tokens.piece(ids[0]) == "<0xE2>" and tokens.decode(ids) == "✓"


def test_every_id_decodes_and_pieces_re_encode():
    for t in [*range(0, 128), *range(256, tokens.SPECIAL_BASE, 97)]:
        p = tokens.piece(t)
        assert p and tokens.decode(tokens.encode(p)) == p
    assert tokens.piece(BOS) == "<|begin_of_text|>" and tokens.piece(128255) == "<|reserved_special_token_255|>"
    with pytest.raises(ValueError):
        tokens.piece(tokens.VOCAB_SIZE)


def test_chat_template_is_llama3_like():
    tok = Tokenizer(2.3)
    ids = tok.encode_chat([{"role": "system", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}])
    text = tokens.decode(ids)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids[0] == BOS and ids.count(START_HEADER) == 3 and ids.count(EOT) == 2


def test_output_tokens_re_encode_to_the_same_ids():
    out = OutputText(tokens.prompt_seed("some prompt"))
    ids = out.ids(0, 60)
    assert len(ids) == 60 and out.text(0, 60) == "".join(tokens.piece(t) for t in ids)
    words = out.text(0, 60).split()
    whole = " " + " ".join(words[:-1])  # complete words only: the last may be cut mid-word
    assert tokens.encode(whole) == ids[:len(tokens.encode(whole))]
    assert OutputText(tokens.prompt_seed("some prompt")).text(10, 20) == out.text(10, 20)


def test_tokens_per_word_outside_one_to_three_is_refused_at_start():
    with pytest.raises(ValueError, match="between 1 and 3"):
        Tokenizer(3.5)
    proc = subprocess.run([sys.executable, "-m", "pdproxy", "sim", "--tokens-per-word", "0.5", "--port", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "tokens per word must be between 1 and 3" in proc.stderr
