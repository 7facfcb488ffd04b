"""Share of the engine core's busy loop spent in the ChatTTS plugin's own Python.

    python -m bench.spy_share spy.txt        (a `py-spy record --subprocesses -f raw` file)

Counts the samples of the vLLM engine-core process under ``EngineCoreProc.run_busy_loop`` and,
among them, those whose stack passes through ``engine/vllm/`` (embedding, logits, sampling,
state updates; frames above the busy loop, e.g. the parent's fork, do not count).
"""

from __future__ import annotations

import collections
import sys


def share(path: str) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    busy = 0
    ours: collections.Counter[str] = collections.Counter()
    top: collections.Counter[str] = collections.Counter()
    with open(path) as fh:
        for line in fh:
            stack, _, n_text = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            names = [f.split(" (")[0] for f in frames]
            if "EngineCoreProc.run_busy_loop" not in names:
                continue
            i = names.index("EngineCoreProc.run_busy_loop")
            n = int(n_text)
            busy += n
            mine = [f.split(" (")[0] for f in frames[i + 1 :] if "engine/vllm/" in f]
            if mine:
                ours[mine[0]] += n
            top[" > ".join(names[i + 2 : i + 4])] += n
    return busy, ours, top


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    busy, ours, top = share(args[0])
    total = sum(ours.values())
    print(f"{busy} busy-loop samples in the engine core; the ChatTTS plugin's own Python: {total} "
          f"= {100 * total / max(busy, 1):.1f}%")
    for k, v in ours.most_common():
        print(f"  {v:5d} {100 * v / max(busy, 1):5.1f}%  {k}")
    print("top of the busy loop:")
    for k, v in top.most_common(6):
        print(f"  {v:5d} {100 * v / max(busy, 1):5.1f}%  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
