"""Incremental text segmentation for one utterance (pure: no clock of its own, no I/O).

Text arrives in pieces of any size (an LLM's tokens, single characters). The session asks for
the next segment whenever the pipeline has room (``next_segment``); the segmenter answers with
the best piece of text available now, or ``None`` to wait. When it waits for time rather than
text, ``deadline_s`` says until when; the session feeds the timer back as ``now_s``.

Policy:

* First segment of the utterance (time to first audio): the first clause boundary (English or
  Chinese punctuation) with at least ``first_min_units`` of text before it; or, at
  ``first_wait_ms`` after the first character arrived, whatever complete words are there; or
  past ``first_max_units`` the complete words.
* Later segments: sentence-sized. The last sentence boundary with at least ``min_units`` before
  it and at most ``max_units``; past ``max_units`` cut at a clause boundary, else a space.
  When the pipeline has run dry (``idle``), text that waited ``idle_wait_ms`` goes out at the
  best boundary available. When the listener is about to run out of audio (``urgent``: the
  session's call, ``SegmenterConfig.urgent_left_ms``), the complete words go out at once, cut at
  the last clause boundary if there is one, once they are ``first_min_units`` long.
* ``flush()`` and ``end()`` force all text received so far out (no boundary needed).

Boundaries: CJK punctuation and newlines are boundaries at once. ASCII ``. , ; : ! ?`` are
boundaries when followed by whitespace (so ``3.14``, ``1,000``, ``10:30`` are not); at the end
of the text so far, ``!``/``?`` and a ``,``/``;`` right after a letter are boundaries at once
and ``.`` after a plain word (nothing that follows can undo them), while a trailing ``.`` after a
digit or an initial, or a ``:``, waits for the next piece (it may be ``3.`` of ``3.14``). Closing quotes and brackets right after the mark belong to the
segment. A few abbreviations (``Mr.``, ``e.g.``) are not sentence ends.

Units measure length roughly in speaking time: one per non-space character, three per CJK
character (a CJK character takes about as long to say as three Latin letters).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import SegmenterConfig

SENTENCE_END_ASCII = frozenset(".!?")
CLAUSE_ASCII = frozenset(",;:")
SENTENCE_END_CJK = frozenset("。！？…")
CLAUSE_CJK = frozenset("，、：；")
CLOSERS = frozenset("\"')]}”’」』）】》")
ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "no", "approx"}
)
CJK_UNITS = 3


def is_cjk(ch: str) -> bool:
    o = ord(ch)
    return (
        0x4E00 <= o <= 0x9FFF
        or 0x3400 <= o <= 0x4DBF
        or 0x3040 <= o <= 0x30FF
        or 0xAC00 <= o <= 0xD7AF
        or 0xF900 <= o <= 0xFAFF
    )


def char_units(ch: str) -> int:
    if ch.isspace():
        return 0
    return CJK_UNITS if is_cjk(ch) else 1


def text_units(text: str) -> int:
    return sum(char_units(c) for c in text)


def is_speakable(text: str) -> bool:
    """True when the text has something to say (a letter, digit or CJK character)."""
    return any(c.isalnum() for c in text)


@dataclass(frozen=True)
class Boundary:
    end: int
    """Index just past the segment's last character (punctuation and closers included)."""
    sentence: bool
    """Sentence end (else clause)."""


def find_boundaries(text: str) -> list[Boundary]:
    """Every sentence/clause boundary in ``text`` that is certain given the text so far."""
    out: list[Boundary] = []
    n = len(text)
    i = 0
    while i < n:
        ch = text[i]
        if ch == "\n":
            out.append(Boundary(i + 1, True))
            i += 1
            continue
        cjk_sentence = ch in SENTENCE_END_CJK
        cjk_clause = ch in CLAUSE_CJK
        if cjk_sentence or cjk_clause:
            j = i + 1
            while j < n and (text[j] in CLOSERS or text[j] in SENTENCE_END_CJK):
                j += 1
            out.append(Boundary(j, cjk_sentence))
            i = j
            continue
        if ch in SENTENCE_END_ASCII or ch in CLAUSE_ASCII:
            j = i + 1
            # runs like "?!", "..." and closing quotes/brackets stay with the mark
            while j < n and (text[j] in SENTENCE_END_ASCII or text[j] in CLOSERS):
                j += 1
            if j < n and text[j].isspace():
                sentence = any(c in SENTENCE_END_ASCII for c in text[i:j])
                if sentence and ch == "." and j == i + 1 and _is_abbreviation(text, i):
                    i = j
                    continue
                out.append(Boundary(j, sentence))
            elif j == n and _certain_at_end(text, i):
                out.append(Boundary(j, ch in SENTENCE_END_ASCII))
            i = j
            continue
        i += 1
    return out


def _certain_at_end(text: str, mark: int) -> bool:
    """A mark run that ends the text so far is a boundary without waiting for the next piece
    when no next piece can undo it: ``!``/``?`` runs (no number or abbreviation has them),
    ``,``/``;`` right after a letter (``1,000`` has a digit before its comma), and a single ``.``
    after a word of two or more letters that is not an abbreviation nor part of a dotted name
    (LLM tokenizers put a domain's dot with what follows it: ``.com``). A ``.`` after a digit, an
    initial or a dotted name, and a trailing ``:`` wait (``3.14``, ``J.``, ``e.g.``, ``10:30``).
    The next token of an LLM stream typically arrives tens of ms later: that is time to first
    audio saved."""
    run = text[mark:]
    if run and all(c in "!?" for c in run):
        return True
    if run == "." and mark > 1:
        k = mark
        while k > 0 and text[k - 1].isalpha():
            k -= 1
        return mark - k >= 2 and (k == 0 or text[k - 1] not in "./@") and not _is_abbreviation(text, mark)
    return run in (",", ";") and mark > 0 and text[mark - 1].isalpha()


def _is_abbreviation(text: str, dot: int) -> bool:
    k = dot
    while k > 0 and (text[k - 1].isalpha() or text[k - 1] == "."):
        k -= 1
    return text[k:dot].lower() in ABBREVIATIONS


def _last_space_cut(text: str, limit: int) -> int:
    """Largest cut <= limit that does not split a word (0 if none). CJK characters may be
    split from their neighbours."""
    limit = min(limit, len(text))
    for k in range(limit, 0, -1):
        prev = text[k - 1]
        nxt = text[k] if k < len(text) else ""
        if k == len(text) and not prev.isspace() and not is_cjk(prev):
            continue  # the last word may still be growing
        if prev.isspace() or nxt.isspace() or is_cjk(prev) or (nxt and is_cjk(nxt)):
            return k
    return 0


def _prefix_within(text: str, max_units: int) -> int:
    """Longest prefix length whose units do not exceed ``max_units``."""
    units = 0
    for k, ch in enumerate(text):
        units += char_units(ch)
        if units > max_units:
            return k
    return len(text)


@dataclass(frozen=True)
class Segment:
    text: str
    """Text to speak (whitespace-trimmed; may be unspeakable punctuation: caller decides)."""
    start_char: int
    """Offset of the segment's first character in the utterance text."""
    end_char: int
    """Offset just past the segment in the utterance text."""
    forced: bool = False
    """Cut without a natural boundary (flush, end, timer or length)."""


class Segmenter:
    """Segmentation state of one utterance. Feed text, pull segments."""

    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config or SegmenterConfig()
        self._buf = ""
        self._consumed_chars = 0
        """Characters of the utterance already handed out (offset of ``_buf[0]``)."""
        self._forced_upto = 0
        """Chars of ``_buf`` that must go out without waiting for a boundary."""
        self._ended = False
        self._segments_out = 0
        self._first_text_s: float | None = None
        self._last_feed_s: float | None = None

    # ---- events -------------------------------------------------------------------------

    def feed(self, text: str, now_s: float) -> None:
        if self._ended:
            raise ValueError("feed after end")
        if not text:
            return
        if self._first_text_s is None:
            self._first_text_s = now_s
        self._last_feed_s = now_s
        self._buf += text

    def flush(self) -> None:
        self._forced_upto = len(self._buf)

    def end(self) -> None:
        self._ended = True
        self._forced_upto = len(self._buf)

    # ---- queries ------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def done(self) -> bool:
        """Ended and every character handed out."""
        return self._ended and not self._buf

    @property
    def pending_text(self) -> str:
        return self._buf

    @property
    def segments_out(self) -> int:
        return self._segments_out

    @property
    def first_text_s(self) -> float | None:
        return self._first_text_s

    def deadline_s(self, now_s: float, idle: bool) -> float | None:
        """When ``next_segment`` may give out text it now holds back for lack of a boundary
        (None: only more text, flush or end can release it)."""
        if not self._buf or self._forced_upto > 0:
            return None
        wait_s: float
        if self._segments_out == 0:
            assert self._first_text_s is not None
            since, wait_s = self._first_text_s, self.config.first_wait_ms / 1000.0
        elif idle:
            assert self._last_feed_s is not None
            since, wait_s = self._last_feed_s, self.config.idle_wait_ms / 1000.0
        else:
            return None
        if now_s < since + wait_s:
            return since + wait_s
        if now_s < since + 2 * wait_s:
            return since + 2 * wait_s
        return None

    # ---- the pull -----------------------------------------------------------------------

    def next_segment(self, now_s: float, idle: bool = False, peek: bool = False,
                     urgent: bool = False) -> Segment | None:
        """The next segment to submit now, or None to wait for text (or ``deadline_s``).
        With ``peek`` nothing is consumed (the same call without it returns the same segment).
        ``urgent``: the listener's audio is about to run out, so a later segment need not wait
        for a sentence end."""
        buf = self._buf
        if not buf:
            return None
        cut = 0
        forced = False
        if self._forced_upto > 0:
            cut, forced = self._forced_cut(buf[: self._forced_upto]), True
        elif self._segments_out == 0:
            cut, forced = self._first_cut(buf, now_s)
        else:
            cut, forced = self._later_cut(buf, now_s, idle, urgent)
        if cut <= 0:
            return None
        if peek:
            raw = buf[:cut]
            lead = len(raw) - len(raw.lstrip())
            text = raw.strip()
            start = self._consumed_chars + lead
            return Segment(text=text, start_char=start, end_char=start + len(text), forced=forced)
        return self._take(cut, forced)

    def _forced_cut(self, region: str) -> int:
        limit = _prefix_within(region, self.config.max_units)
        if limit >= len(region):
            return len(region)
        return self._best_cut(region, limit)

    def _best_cut(self, text: str, limit: int) -> int:
        """Best cut in text[:limit]: sentence > clause > space > hard."""
        bounds = [b for b in find_boundaries(text[: limit + 1]) if b.end <= limit]
        sentences = [b.end for b in bounds if b.sentence]
        if sentences:
            return sentences[-1]
        if bounds:
            return bounds[-1].end
        space = _last_space_cut(text, limit)
        return space if space > 0 else max(limit, 1)

    def _first_cut(self, buf: str, now_s: float) -> tuple[int, bool]:
        cfg = self.config
        # max_units bounds every segment, the first included (first_max_units may be larger)
        limit = _prefix_within(buf, min(cfg.first_max_units, cfg.max_units))
        for b in find_boundaries(buf[: limit + 1]):
            if b.end <= limit and text_units(buf[: b.end]) >= cfg.first_min_units:
                return b.end, False
        if limit < len(buf):  # longer than first_max_units without a usable boundary
            return self._best_cut(buf, limit), True
        assert self._first_text_s is not None
        if now_s >= self._first_text_s + cfg.first_wait_ms / 1000.0:
            return self._timed_cut(buf, now_s - self._first_text_s, cfg.first_wait_ms), True
        return 0, False

    def _later_cut(self, buf: str, now_s: float, idle: bool, urgent: bool) -> tuple[int, bool]:
        cfg = self.config
        limit = _prefix_within(buf, cfg.max_units)
        bounds = find_boundaries(buf[: limit + 1] if limit < len(buf) else buf)
        best = 0
        for b in bounds:
            if b.sentence and b.end <= limit and text_units(buf[: b.end]) >= cfg.min_units:
                best = b.end
        if best:
            return best, False
        if limit < len(buf):  # more than max_units without a usable sentence end
            return self._best_cut(buf, limit), True
        if idle:
            assert self._last_feed_s is not None
            if now_s >= self._last_feed_s + cfg.idle_wait_ms / 1000.0:
                if bounds:
                    sentences = [b.end for b in bounds if b.sentence]
                    return (sentences[-1] if sentences else bounds[-1].end), False
                return self._timed_cut(buf, now_s - self._last_feed_s, cfg.idle_wait_ms), True
        if urgent:
            return self._urgent_cut(buf), True
        return 0, False

    def _urgent_cut(self, buf: str) -> int:
        """The complete words, cut after the last clause boundary among them if there is one, when
        that cut is at least ``first_min_units`` long; 0 (wait) otherwise."""
        words = _last_space_cut(buf, len(buf))
        if words <= 0:
            return 0
        clauses = [b.end for b in find_boundaries(buf[: words + 1]) if b.end <= words]
        for cut in (clauses[-1] if clauses else 0, words):
            if cut > 0 and text_units(buf[:cut]) >= self.config.first_min_units:
                return cut
        return 0

    def _timed_cut(self, buf: str, waited_s: float, wait_ms: float) -> int:
        """Waited long enough: the complete words now; all of it after twice the wait."""
        if waited_s >= 2 * wait_ms / 1000.0:
            return len(buf)
        cut = _last_space_cut(buf, len(buf))
        return cut if cut > 0 and is_speakable(buf[:cut]) else 0

    def _take(self, cut: int, forced: bool) -> Segment:
        raw = self._buf[:cut]
        rest = self._buf[cut:]
        start = self._consumed_chars
        self._consumed_chars += cut
        self._buf = rest
        self._forced_upto = max(0, self._forced_upto - cut)
        lead = len(raw) - len(raw.lstrip())
        text = raw.strip()
        if is_speakable(text):
            self._segments_out += 1
        if not rest.strip():
            # leftover whitespace is not text waiting; it still counts as consumed
            self._consumed_chars += len(rest)
            self._buf = ""
            self._forced_upto = 0
        return Segment(text=text, start_char=start + lead, end_char=start + lead + len(text),
                       forced=forced)


# ---- timing within a segment ------------------------------------------------------------------

_PAUSE_UNITS = 0.3
"""Share of a space or a punctuation mark, in units (a letter is 1, a CJK character 3)."""


def char_timings(text: str, duration_ms: float) -> tuple[list[float], list[float]]:
    """(start, duration) in ms from the segment's start of every character of ``text``, whose
    audio lasted ``duration_ms``: the measured duration shared out in proportion to speaking
    time (letters 1 unit, CJK characters 3, spaces and punctuation a short pause). An estimate
    inside the segment: exact at its two ends (the engine gives no per-character timing)."""
    weights = [_PAUSE_UNITS if (c.isspace() or not c.isalnum()) else float(char_units(c)) for c in text]
    total = sum(weights) or 1.0
    starts: list[float] = []
    durations: list[float] = []
    acc = 0.0
    for w in weights:
        starts.append(duration_ms * acc / total)
        durations.append(duration_ms * w / total)
        acc += w
    return starts, durations


def word_timings(text: str, duration_ms: float) -> list[tuple[str, float, float]]:
    """(word, start_ms, end_ms) from the segment's start (``char_timings``; a CJK character is a
    word of its own; punctuation belongs to the word it follows)."""
    starts, durations = char_timings(text, duration_ms)
    out: list[tuple[str, float, float]] = []
    word, first, last = "", 0, 0
    for i, c in enumerate(text):
        if c.isspace() or is_cjk(c):
            if word:
                out.append((word, starts[first], starts[last] + durations[last]))
                word = ""
            if is_cjk(c):
                out.append((c, starts[i], starts[i] + durations[i]))
            continue
        if not word and not c.isalnum() and out:  # punctuation after a CJK character: its word's
            w, a, _ = out[-1]
            out[-1] = (w + c, a, starts[i] + durations[i])
            continue
        if not word:
            first = i
        word += c
        last = i
    if word:
        out.append((word, starts[first], starts[last] + durations[last]))
    return out
