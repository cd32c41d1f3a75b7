from __future__ import annotations

from gateway.kvevents.sequence import SeqTracker


def test_verdicts() -> None:
    t = SeqTracker()
    assert t.classify(5) == "first"
    t.advance(5, 0)
    assert t.classify(6) == "next"
    assert t.classify(9) == "gap"
    assert t.classify(0) == "reset"
    assert t.classify(3) == "reset"


def test_replay_duplicates_are_recognised_until_passed() -> None:
    t = SeqTracker()
    t.advance(10, 0)
    t.replayed_upto = 10
    assert t.classify(9) == "dup"
    assert t.classify(11) == "next"
    t.advance(11, 0)
    assert t.replayed_upto == -1
    assert t.classify(9) == "reset"
