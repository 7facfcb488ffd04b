"""Load-test scenarios as plans: which session starts when and says what. Pure and seeded.

A ``SessionPlan`` is everything one simulated chat session will do; workers execute plans,
``metrics`` reads what happened. Scenarios (``build_plans``):

* ``steady``: ``sessions`` chat sessions start spread over ``ramp_s`` and speak utterance
  after utterance (think time between turns) until ``duration_s``.
* ``burst``: ``background`` sessions start first and speak long answers back to back; at
  ``burst_at_s`` (and every ``burst_every_s`` after, ``bursts`` times) ``sessions`` new
  sessions all start their first utterance at once.
  Measures the burst's TTFA and the underruns of the streams already playing.
* ``barge-in``: like ``steady``, but each utterance is cancelled with probability
  ``cancel_prob`` at a random time after its first audio (a user interrupting).
* ``slow-reader``: like ``steady``, plus one session that stops reading its socket
  ``slow_after_s`` after its first audio while the server still has audio for it. The others
  must be unaffected.
* ``closed-loop``: ``sessions`` sessions speak back to back (no think time) until
  ``duration_s``: the throughput / latency comparison (QPS) against the baseline. Clients
  consume audio as fast as it arrives (``instant_playback``), so QPS measures the engine, not
  real-time playback.

Workloads (``workload``, orthogonal to the scenario) say what each answer is like:

* ``short``: answers of ``utterance_chars`` characters drawn from a dozen stock sentences, word-like
  deltas of ``token_chars`` on average, exponential think time of mean ``think_s``, the
  client's default 80 ms prebuffer.
* ``conversation``: what a real assistant's answers are like. Each answer is 120-600 characters
  (uniform) of several varied sentences built from templates (``make_answer``), streamed in
  deltas of 2-6 characters (uniform) at ``tokens_per_s`` with ±50 % jitter; 0.5-2 s of think time
  (uniform) between answers; clients start playing after 100 ms of audio.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

SCENARIOS = ("steady", "burst", "barge-in", "slow-reader", "closed-loop")
WORKLOADS = ("short", "conversation")

#: The conversation workload's fixed shape (module docstring).
CONVERSATION_ANSWER_CHARS = (120, 600)
CONVERSATION_DELTA_CHARS = (2, 6)
CONVERSATION_THINK_S = (0.5, 2.0)
CONVERSATION_PREBUFFER_MS = 100.0
SHORT_PREBUFFER_MS = 80.0

#: Hard caps: a load test is bounded in sessions, time and text whatever the flags say.
MAX_SESSIONS = 1_024
MAX_DURATION_S = 900.0
MAX_UTTERANCE_CHARS = 4_000
MAX_UTTERANCES_PER_SESSION = 1_000

_CORPUS = (
    "Sure, here is a quick overview of how it works.",
    "The first step is to check the settings, then restart the service.",
    "If that does not help, we can look at the logs together.",
    "Most of the time the problem is a missing permission, which is easy to fix.",
    "I would also recommend updating to the latest version, since it fixes several bugs.",
    "Let me know if you want me to walk you through it step by step.",
    "Another option is to reset the device, but that deletes your saved data.",
    "In short, start simple, measure, and only then change one thing at a time.",
    "The weather tomorrow looks mild, with a light breeze in the afternoon.",
    "Good question! The answer depends on how much traffic you expect.",
    "For a small team, the basic plan is usually enough to get started.",
    "You can always upgrade later without losing anything.",
)


_OPENERS = ("Sure.", "Good question.", "Right, let me explain.", "Okay.", "Thanks for asking.", "Happy to help.",
            "That makes sense.", "Great, here is what I found.", "Let me think about that for a second.")
_SUBJECTS = ("the new schedule", "your account", "the kitchen timer", "this recipe", "the train to Boston",
             "the quarterly report", "my calendar", "the garden hose", "our team", "the old laptop",
             "the museum", "your flight", "the weekend forecast", "the printer upstairs", "a good night's sleep",
             "the library", "the second option", "that bakery downtown", "the battery", "the annual budget")
_VERBS = ("needs", "usually takes", "depends on", "works best with", "comes with", "can skip", "tends to need",
          "should include", "rarely needs", "will replace")
_OBJECTS = ("about twenty minutes", "a quick restart", "a little patience", "fresh basil and lemon",
            "an extra cable", "two short breaks", "the latest update", "a written confirmation",
            "a warm jacket", "a second opinion", "the blue folder", "a stable connection", "clear instructions",
            "a spare key", "the morning shift", "some extra salt")
_TAILS = ("", "", "", " in most cases", " if you ask me", " by Friday", " on weekdays", " this time of year",
          " according to the manual", " unless it rains", " for now")
_CLAUSES = ("If that sounds good, {s} {v} {o}{t}.", "In my experience, {s} {v} {o}{t}.",
            "{S} {v} {o}{t}, and {s2} {v2} {o2}.", "{S} {v} {o}{t}.", "Also, {s} {v} {o}{t}.",
            "Would you like me to check whether {s} {v} {o}?", "To be honest, {s} {v} {o}{t}.",
            "First, {s} {v} {o}; then {s2} {v2} {o2}.", "Keep in mind that {s} {v} {o}{t}.",
            "{S}, on the other hand, {v} {o}{t}.", "One more thing: {s} {v} {o}{t}!")


def make_answer(rng: random.Random, chars: int) -> str:
    """A varied multi-sentence assistant answer of about ``chars`` characters: an opener, then
    sentences built from templates with random subjects, verbs, objects and tails (so no two
    answers are the same text), cut at the sentence that reaches the length."""
    chars = max(1, min(chars, MAX_UTTERANCE_CHARS))
    out = [rng.choice(_OPENERS)]
    n = len(out[0])
    while n < chars:
        s, s2 = rng.sample(_SUBJECTS, 2)
        sent = rng.choice(_CLAUSES).format(
            s=s, S=s[0].upper() + s[1:], v=rng.choice(_VERBS), o=rng.choice(_OBJECTS), t=rng.choice(_TAILS),
            s2=s2, v2=rng.choice(_VERBS), o2=rng.choice(_OBJECTS))
        out.append(sent)
        n += len(sent) + 1
    return " ".join(out)[:MAX_UTTERANCE_CHARS]


def split_deltas(text: str, lo: int, hi: int, rng: random.Random) -> list[str]:
    """``text`` in consecutive pieces of a uniform ``lo``..``hi`` characters (the last may be shorter)."""
    pieces: list[str] = []
    i = 0
    while i < len(text):
        k = rng.randint(lo, hi)
        pieces.append(text[i:i + k])
        i += k
    return pieces


@dataclass(frozen=True)
class UtterancePlan:
    text: str
    think_s: float = 0.0
    """Pause before sending this utterance's first text (after the previous one finished)."""
    cancel_after_audio_s: float | None = None
    """Send ``cancel`` this long after the utterance's first audio arrived."""


@dataclass(frozen=True)
class SessionPlan:
    session_id: int
    role: str
    """``steady``, ``background``, ``burst``, ``slow`` ... (metrics group by role)."""
    start_s: float
    """Connect at t0 + start_s."""
    utterances: tuple[UtterancePlan, ...]
    tokens_per_s: float = 40.0
    token_chars: float = 4.0
    seed: int = 0
    voice: int | None = None
    sample_rate_hz: int = 24_000
    loop_until_s: float | None = None
    """Repeat the utterance list until t0 + loop_until_s (steady, closed-loop)."""
    stop_reading_after_audio_s: float | None = None
    """Slow reader: stop reading the socket this long after the first audio."""
    end_s: float = 60.0
    """Hard end of this session (close) at t0 + end_s."""
    wait_playback: bool = True
    """Let each answer play out before the next turn (closed-loop: no, next request at once)."""
    instant_playback: bool = False
    """Report audio as played the moment it arrives (closed-loop throughput runs: the server's
    flow control then never paces the stream to real time)."""
    delta_chars: tuple[int, int] | None = None
    """Send the text in pieces of a uniform number of characters in this range (None: word-like
    pieces of ``token_chars`` on average, ``tokenize``)."""
    prebuffer_ms: float = SHORT_PREBUFFER_MS
    """Audio the simulated player holds before it starts (and after an underrun)."""


@dataclass(frozen=True)
class ScenarioParams:
    scenario: str = "burst"
    sessions: int = 8
    """steady / barge-in / slow-reader / closed-loop: sessions; burst: sessions in the burst."""
    background: int = 4
    """burst: sessions already mid-utterance when the burst arrives."""
    duration_s: float = 20.0
    ramp_s: float = 2.0
    burst_at_s: float = 4.0
    bursts: int = 1
    """burst: how many bursts (each of ``sessions`` new sessions)."""
    burst_every_s: float = 10.0
    """burst: time between bursts."""
    tokens_per_s: float = 40.0
    token_chars: float = 4.0
    utterance_chars: int = 160
    background_chars: int = 900
    think_s: float = 1.0
    cancel_prob: float = 0.5
    slow_after_s: float = 0.5
    sample_rate_hz: int = 24_000
    seed: int = 0
    settle_s: float = 15.0
    """Extra time after the last planned start for utterances to finish (part of the caps)."""
    voice: int | None = None
    instant_playback: bool = True
    """closed-loop: clients consume audio as fast as it arrives (throughput); false: real time."""
    workload: str = "short"
    """What the answers are like: ``short`` or ``conversation`` (module docstring)."""


def make_text(rng: random.Random, chars: int) -> str:
    """Plausible chat-answer text of about ``chars`` characters (whole sentences)."""
    chars = max(1, min(chars, MAX_UTTERANCE_CHARS))
    out: list[str] = []
    n = 0
    while n < chars:
        s = rng.choice(_CORPUS)
        out.append(s)
        n += len(s) + 1
    text = " ".join(out)
    return text[: MAX_UTTERANCE_CHARS]


def tokenize(text: str, token_chars: float, rng: random.Random) -> list[str]:
    """Split text like an LLM tokenizer would stream it: word pieces with their leading space,
    about ``token_chars`` characters on average (long words split, short ones merged)."""
    words: list[str] = []
    for i, w in enumerate(text.split(" ")):
        words.append(w if i == 0 else " " + w)
    pieces: list[str] = []
    size = max(1.0, token_chars)
    for w in words:
        while len(w) > size * 1.6:
            cut = max(1, int(rng.uniform(0.6, 1.4) * size))
            pieces.append(w[:cut])
            w = w[cut:]
        if w:
            pieces.append(w)
    return pieces


def build_plans(p: ScenarioParams) -> list[SessionPlan]:
    if p.scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {p.scenario!r}; known: {', '.join(SCENARIOS)}")
    if not 0 < p.sessions <= MAX_SESSIONS or not 0 <= p.background <= MAX_SESSIONS:
        raise ValueError(f"sessions must be in 1..{MAX_SESSIONS}")
    if p.bursts < 1 or p.burst_every_s <= 0:
        raise ValueError("bursts must be >= 1 and burst_every_s > 0")
    if p.sessions * (p.bursts if p.scenario == "burst" else 1) + (p.background if p.scenario == "burst" else 0) \
            > MAX_SESSIONS:
        raise ValueError(f"at most {MAX_SESSIONS} sessions in all")
    if not 0 < p.duration_s <= MAX_DURATION_S:
        raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S}]")
    if p.tokens_per_s <= 0 or p.token_chars <= 0:
        raise ValueError("tokens_per_s and token_chars must be > 0")
    if p.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {p.workload!r}; known: {', '.join(WORKLOADS)}")
    rng = random.Random(p.seed)
    conv = p.workload == "conversation"
    common = dict(tokens_per_s=p.tokens_per_s, token_chars=p.token_chars, sample_rate_hz=p.sample_rate_hz,
                  voice=p.voice, delta_chars=CONVERSATION_DELTA_CHARS if conv else None,
                  prebuffer_ms=CONVERSATION_PREBUFFER_MS if conv else SHORT_PREBUFFER_MS)
    plans: list[SessionPlan] = []

    def utterances(n: int, chars: int, think: float) -> tuple[UtterancePlan, ...]:
        if conv:  # lengths and think times of the conversation workload (the first has none)
            return tuple(
                UtterancePlan(make_answer(rng, rng.randint(*CONVERSATION_ANSWER_CHARS)),
                              think_s=rng.uniform(*CONVERSATION_THINK_S) if think > 0 and i else 0.0)
                for i in range(n))
        return tuple(
            UtterancePlan(make_text(rng, chars), think_s=(rng.expovariate(1 / think) if think > 0 and i else 0.0))
            for i in range(n)
        )

    if p.scenario == "burst":
        last_burst = p.burst_at_s + (p.bursts - 1) * p.burst_every_s
        end = min(MAX_DURATION_S, last_burst + p.duration_s)
        for i in range(p.background):
            start = rng.uniform(0.0, min(p.ramp_s, p.burst_at_s / 2))
            # back-to-back long answers (the next is queued as soon as one is done), so
            # background streams are mid-utterance whenever a burst comes
            plans.append(SessionPlan(i, "background", start, utterances(2, p.background_chars, 0.0),
                                     seed=p.seed * 7919 + i, end_s=end, loop_until_s=last_burst + 1.0,
                                     wait_playback=False, **common))  # type: ignore[arg-type]
        sid = p.background
        for b in range(p.bursts):
            for _ in range(p.sessions):
                plans.append(SessionPlan(sid, "burst", p.burst_at_s + b * p.burst_every_s,
                                         utterances(1, p.utterance_chars, 0.0), seed=p.seed * 7919 + sid,
                                         end_s=end, **common))  # type: ignore[arg-type]
                sid += 1
        return plans

    loop_until = p.duration_s
    end = min(MAX_DURATION_S, p.duration_s + p.settle_s)
    think = 0.0 if p.scenario == "closed-loop" else p.think_s
    for i in range(p.sessions):
        start = rng.uniform(0.0, p.ramp_s) if p.scenario != "closed-loop" else i * p.ramp_s / max(1, p.sessions)
        utts = utterances(8 if conv else 4, p.utterance_chars, think)
        if p.scenario == "barge-in":
            utts = tuple(
                replace(u, cancel_after_audio_s=rng.uniform(0.2, 1.5)) if rng.random() < p.cancel_prob else u
                for u in utts
            )
        plans.append(SessionPlan(i, p.scenario if p.scenario != "closed-loop" else "steady", start, utts,
                                 seed=p.seed * 7919 + i, loop_until_s=loop_until, end_s=end,
                                 wait_playback=p.scenario != "closed-loop",
                                 instant_playback=p.scenario == "closed-loop" and p.instant_playback,
                                 **common))  # type: ignore[arg-type]
    if p.scenario == "slow-reader":
        sid = p.sessions
        plans.append(SessionPlan(sid, "slow", p.ramp_s / 2, utterances(1, max(p.background_chars, 600), 0.0),
                                 seed=p.seed * 7919 + sid, stop_reading_after_audio_s=p.slow_after_s,
                                 end_s=end, **common))  # type: ignore[arg-type]
    return plans


def split_plans(plans: list[SessionPlan], workers: int) -> list[list[SessionPlan]]:
    """Round-robin plans over workers so each role is spread across processes."""
    workers = max(1, workers)
    out: list[list[SessionPlan]] = [[] for _ in range(workers)]
    for i, plan in enumerate(sorted(plans, key=lambda q: (q.start_s, q.session_id))):
        out[i % workers].append(plan)
    return [w for w in out if w]

