from __future__ import annotations

import sys

import pytest

from gateway.sim.tokenizer import ApproxTokenizer, FileTokenizer, chain_block_hashes, render_chat


def test_about_four_characters_a_token() -> None:
    tok = ApproxTokenizer()
    assert tok.count("") == 0
    assert tok.count("abcd") == 1
    assert tok.count("abcde") == 2
    assert tok.encode("x" * 130, 16).num_tokens == 33
    assert len(tok.encode("x" * 130, 16).block_payloads) == 2


def test_extending_text_keeps_every_whole_block() -> None:
    tok = ApproxTokenizer()
    short = tok.encode("héllo wörld " * 40, 16)
    longer = tok.encode("héllo wörld " * 40 + "and one more question", 16)
    assert longer.block_payloads[: len(short.block_payloads)] == short.block_payloads
    h_short = chain_block_hashes(short.block_payloads)
    h_long = chain_block_hashes(longer.block_payloads)
    assert h_long[: len(h_short)] == h_short


def test_chained_hashes_depend_on_all_earlier_blocks_and_salt() -> None:
    a = chain_block_hashes([b"1", b"2", b"3"])
    b = chain_block_hashes([b"0", b"2", b"3"])
    assert a[1:] != b[1:] and len(set(a)) == 3
    assert chain_block_hashes([b"1"], salt="t1") != chain_block_hashes([b"1"], salt="t2")
    assert chain_block_hashes([b"1"]) == chain_block_hashes([b"1"])


def test_chat_template_appends_turns() -> None:
    one = render_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    two = render_chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "more"}]},
        ]
    )
    head = one.removesuffix("<|assistant|>\n")
    assert two.startswith(head) and "more" in two


def test_tokenizer_file_needs_the_optional_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test extra installs `tokenizers`; a None entry makes its import fail as on a
    # machine without it.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(RuntimeError, match="tokenizers"):
        FileTokenizer("tokenizer.json")
