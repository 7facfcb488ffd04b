"""The first segment's text wait on a simulated clock: the load generator's conversation answers
(``loadtest.plan.make_answer``, 2-6-character deltas at ``--tokens-per-s`` with its ±50 % jitter)
fed to ``gateway.segmenter.Segmenter`` as the gateway's session feeds it (at each delta, and at the
segmenter's own deadline when that comes before the next delta). Prints the distribution of the
time from the first character to the first segment and of that segment's length, per
``first_wait_ms``: what the gateway's ``text_wait`` would be if the text arrived on time.

    python -m bench.segmenter_wait [--answers 4000] [--first-wait-ms 200,150]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from gateway.config import SegmenterConfig
from gateway.segmenter import Segmenter
from loadtest.plan import CONVERSATION_ANSWER_CHARS, CONVERSATION_DELTA_CHARS, make_answer, split_deltas


def first_segment(cfg: SegmenterConfig, pieces: list[str], times_s: list[float]) -> tuple[float, str]:
    """When (seconds after the first delta) and with what text the first segment goes out."""
    seg = Segmenter(cfg)
    for i, piece in enumerate(pieces):
        now = times_s[i]
        seg.feed(piece, now)
        next_s = times_s[i + 1] if i + 1 < len(times_s) else float("inf")
        while True:
            out = seg.next_segment(now)
            if out is not None:
                return now - times_s[0], out.text
            deadline = seg.deadline_s(now, False)
            if deadline is None or deadline >= next_s:
                break
            now = deadline
    seg.end()
    out = seg.next_segment(times_s[-1])
    return times_s[-1] - times_s[0], out.text if out is not None else ""


def run(first_wait_ms: float, answers: int, tokens_per_s: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    cfg = SegmenterConfig(first_wait_ms=first_wait_ms)
    waits_ms: list[float] = []
    chars: list[int] = []
    for _ in range(answers):
        text = make_answer(rng, rng.randint(*CONVERSATION_ANSWER_CHARS))
        pieces = split_deltas(text, *CONVERSATION_DELTA_CHARS, rng)
        times_s = [0.0]
        for _ in pieces[1:]:
            times_s.append(times_s[-1] + rng.uniform(0.5, 1.5) / tokens_per_s)
        wait_s, first = first_segment(cfg, pieces, times_s)
        waits_ms.append(1000.0 * wait_s)
        chars.append(len(first))
    q = statistics.quantiles(waits_ms, n=100)
    return {"first_wait_ms": first_wait_ms, "answers": answers, "text_wait_p50_ms": round(q[49], 1),
            "text_wait_p95_ms": round(q[94], 1), "text_wait_p99_ms": round(q[98], 1),
            "text_wait_max_ms": round(max(waits_ms), 1), "first_segment_chars_p50": statistics.median(chars)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.segmenter_wait", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=int, default=4000)
    ap.add_argument("--first-wait-ms", default=str(SegmenterConfig().first_wait_ms))
    ap.add_argument("--tokens-per-s", type=float, default=30.0, help="deltas per second (the conversation workload's)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    for w in args.first_wait_ms.split(","):
        print(json.dumps(run(float(w), args.answers, args.tokens_per_s, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
