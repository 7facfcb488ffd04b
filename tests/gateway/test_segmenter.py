from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.segmenter import Segment, Segmenter, SegmenterConfig, find_boundaries, text_units


def ends(text: str) -> list[tuple[str, bool]]:
    return [(text[: b.end], b.sentence) for b in find_boundaries(text)]


def drain(seg: Segmenter, now: float = 100.0, idle: bool = True) -> list[Segment]:
    out = []
    while (s := seg.next_segment(now, idle=idle)) is not None:
        out.append(s)
    return out


def test_boundaries_english():
    assert ends("Hello, world. Next") == [("Hello,", False), ("Hello, world.", True)]
    assert ends("Wait?! Really") == [("Wait?!", True)]
    assert ends('He said "stop." Then') == [('He said "stop."', True)]
    assert ends("Well... maybe") == [("Well...", True)]
    assert ends("line one\nline two") == [("line one\n", True)]


def test_numbers_and_abbreviations_are_not_boundaries():
    assert ends("Pi is 3.14 today") == []
    assert ends("It costs 1,000 dollars at 10:30 sharp") == []
    assert ends("Ask Mr. Smith and Dr. Who, e.g. them") == [("Ask Mr. Smith and Dr. Who,", False)]
    # a trailing mark is not yet a boundary: the next piece may be "14" of "3.14"
    assert ends("The value is 3.") == []
    assert ends("The value is 3.14. ") == [("The value is 3.14.", True)]
    assert ends("It costs 1,") == [] and ends("At 10:") == [] and ends("Ask Mr.") == []


def test_a_mark_nothing_can_undo_is_a_boundary_without_the_next_piece():
    """An LLM streams "," and " next" as separate tokens: the first segment goes out with the
    comma's token, not one token later."""
    assert ends("Hello there, my friend,") == [("Hello there,", False), ("Hello there, my friend,", False)]
    assert ends("Really?!") == [("Really?!", True)]
    assert ends("Is it 3?") == [("Is it 3?", True)]
    assert ends("first; second;") == [("first;", False), ("first; second;", False)]
    assert ends("Let me know.") == [("Let me know.", True)]
    assert ends("Ask J.") == [] and ends("in the U.S.") == [] and ends("see e.g.") == []
    assert ends("at www.example.") == [] and ends("Ask Dr.") == [] and ends("It is 3.") == []
    seg = Segmenter(SegmenterConfig(first_min_units=10))
    seg.feed("Sure thing my friend", 0.0)
    assert seg.next_segment(0.0) is None
    seg.feed(",", 0.02)
    s = seg.next_segment(0.02)
    assert s is not None and s.text == "Sure thing my friend," and not s.forced


def test_boundaries_chinese_need_no_lookahead():
    assert ends("你好，世界。再见") == [("你好，", False), ("你好，世界。", True)]
    assert ends("真的吗？") == [("真的吗？", True)]
    assert ends("一、二；三：四") == [("一、", False), ("一、二；", False), ("一、二；三：", False)]


def test_timings_share_the_measured_duration():
    from gateway.segmenter import char_timings, word_timings

    starts, durs = char_timings("ab c", 1000.0)
    assert starts[0] == 0.0 and abs(starts[-1] + durs[-1] - 1000.0) < 1e-9  # exact at both ends
    assert durs[0] == durs[1] == durs[3] > durs[2]  # a space is a short pause
    words = word_timings("Hello there, world.", 1900.0)
    assert [w for w, _, _ in words] == ["Hello", "there,", "world."]
    assert words[0][1] == 0.0 and abs(words[-1][2] - 1900.0) < 1e-9
    assert all(a < b <= c for (_, a, b), (_, c, _) in zip(words, words[1:], strict=False))
    assert [w for w, _, _ in word_timings("你好，世界", 500.0)] == ["你", "好，", "世", "界"]


def test_units():
    assert text_units("abc de") == 5
    assert text_units("你好") == 6


def test_first_segment_at_first_long_enough_clause():
    seg = Segmenter(SegmenterConfig(first_min_units=10))
    seg.feed("Hi, ", 0.0)
    assert seg.next_segment(0.0) is None  # "Hi," is too short
    seg.feed("there my friend, how are you", 0.01)
    s = seg.next_segment(0.02)
    assert s is not None and s.text == "Hi, there my friend," and not s.forced
    assert seg.pending_text.strip() == "how are you"


def test_first_segment_after_a_short_wait():
    seg = Segmenter(SegmenterConfig(first_wait_ms=300))
    seg.feed("Thinking about it", 1.0)
    assert seg.next_segment(1.1) is None
    assert seg.deadline_s(1.1, idle=False) == 1.3
    s = seg.next_segment(1.3)
    assert s is not None and s.text == "Thinking about" and s.forced  # "it" may still grow
    seg.feed(" deeply", 1.35)
    assert seg.next_segment(1.4) is None  # later segments wait for a sentence


def test_single_unfinished_word_goes_after_twice_the_wait():
    seg = Segmenter(SegmenterConfig(first_wait_ms=200))
    seg.feed("Supercalifragilistic", 0.0)
    assert seg.next_segment(0.25) is None
    assert seg.deadline_s(0.25, idle=False) == 0.4
    s = seg.next_segment(0.4)
    assert s is not None and s.text == "Supercalifragilistic"


def test_later_segments_are_sentences():
    cfg = SegmenterConfig(first_min_units=5, min_units=20, max_units=200)
    seg = Segmenter(cfg)
    seg.feed("Hello there, this is a test. Short. This sentence is long enough to go. And", 0.0)
    a = seg.next_segment(0.0)
    assert a is not None and a.text == "Hello there,"
    b = seg.next_segment(0.0)
    # the last sentence end with enough text: several short sentences go together
    assert b is not None and b.text == "this is a test. Short. This sentence is long enough to go."
    assert seg.next_segment(0.0) is None
    assert seg.deadline_s(0.0, idle=False) is None
    assert seg.deadline_s(0.0, idle=True) is not None  # the pipeline ran dry: a timer applies
    seg.end()
    c = seg.next_segment(0.0)
    assert c is not None and c.text == "And" and c.forced
    assert seg.done


def test_idle_wait_sends_what_there_is():
    seg = Segmenter(SegmenterConfig(first_min_units=5, idle_wait_ms=400))
    seg.feed("Hello there, and then some words", 0.0)
    assert seg.next_segment(0.0).text == "Hello there,"  # type: ignore[union-attr]
    assert seg.next_segment(0.2, idle=True) is None
    assert seg.deadline_s(0.2, idle=True) == 0.4
    s = seg.next_segment(0.4, idle=True)
    assert s is not None and s.text == "and then some"


def test_urgent_sends_the_complete_words_without_a_sentence_end():
    seg = Segmenter(SegmenterConfig(first_min_units=8))
    seg.feed("Sure thing, the old laptop, on the other hand, usually ta", 0.0)
    assert seg.next_segment(0.0, urgent=True).text == "Sure thing,"  # type: ignore[union-attr]
    assert seg.next_segment(0.0) is None  # no sentence end yet: wait
    # the listener is about to run dry: the last clause boundary among the complete words
    s = seg.next_segment(0.0, urgent=True, peek=True)
    assert s is not None and s.text == "the old laptop, on the other hand," and s.forced
    seg.next_segment(0.0, urgent=True)
    # a partial word never goes ("ta" may still grow), nor a cut under first_min_units
    assert seg.next_segment(0.0, urgent=True) is None  # "usually" is 7 units
    seg.feed("kes about", 0.1)
    s = seg.next_segment(0.1, urgent=True)
    assert s is not None and s.text == "usually takes"


def test_urgent_does_not_touch_the_first_segment():
    seg = Segmenter(SegmenterConfig(first_wait_ms=200))
    seg.feed("Thinking about the answer", 0.0)
    assert seg.next_segment(0.0, urgent=True) is None  # the first segment has its own timer
    assert seg.deadline_s(0.0, idle=False) == 0.2


def test_flush_forces_without_boundary():
    seg = Segmenter()
    seg.feed("no boundary here", 0.0)
    assert seg.next_segment(0.0) is None
    seg.flush()
    s = seg.next_segment(0.0)
    assert s is not None and s.text == "no boundary here" and s.forced
    assert not seg.done
    seg.feed("more", 0.1)
    assert seg.next_segment(0.1) is None


def test_max_units_cut():
    seg = Segmenter(SegmenterConfig(first_max_units=30, max_units=40))
    seg.feed("word " * 20, 0.0)
    s = seg.next_segment(0.0)
    assert s is not None and text_units(s.text) <= 30 and s.text.endswith("word")
    s2 = seg.next_segment(0.0)
    assert s2 is not None and text_units(s2.text) <= 40


def test_offsets_and_peek():
    seg = Segmenter(SegmenterConfig(first_min_units=3))
    seg.feed("  Hey you, there. ", 0.0)
    p = seg.next_segment(0.0, peek=True)
    s = seg.next_segment(0.0)
    assert p == s and s is not None
    assert s.text == "Hey you," and (s.start_char, s.end_char) == (2, 10)


def test_cjk_first_segment():
    seg = Segmenter(SegmenterConfig(first_min_units=10))
    seg.feed("你好，", 0.0)
    assert seg.next_segment(0.0) is None  # 6 units
    seg.feed("我是语音网关。", 0.0)
    s = seg.next_segment(0.0)
    assert s is not None and s.text == "你好，我是语音网关。"


TEXTS = st.lists(st.sampled_from(list("ab cd.,!?3 \n你好。，") + ["Mr. ", "3.14 ", "word "]),
                 max_size=200).map("".join)


@example(text="aaaaaaaaaaa你你3.14 3.14 3.14 3.14 3.14 3.14 \n", cuts=[2])  # first segment over max_units
@settings(max_examples=200, deadline=None)
@given(TEXTS, st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=50))
def test_any_split_keeps_all_text_in_order(text: str, cuts: list[int]):
    """Whatever the pieces, the segments together are the text (modulo whitespace), in order."""
    seg = Segmenter(SegmenterConfig(first_min_units=4, min_units=8, max_units=40))
    out: list[Segment] = []
    i, t, k = 0, 0.0, 0
    while i < len(text):
        n = cuts[k % len(cuts)]
        seg.feed(text[i:i + n], t)
        i, t, k = i + n, t + 0.01, k + 1
        out += drain(seg, now=t, idle=False)
    seg.end()
    out += drain(seg, now=t + 10)
    assert seg.done
    assert "".join(s.text for s in out).replace(" ", "").replace("\n", "") == \
        text.replace(" ", "").replace("\n", "")
    for s in out:
        assert text_units(s.text) <= 40 or len(s.text) == 1
        assert text[s.start_char:s.end_char] == s.text
