"""The Markdown report from the results JSON."""

from __future__ import annotations

import math
import shlex
from typing import Any


def _f(v: Any, nd: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{nd}f}"
    return str(v)


def _gpu_mem(row: dict[str, Any]) -> str:
    g = row.get("gpu") or {}
    peaks = g.get("memory_peak_mib") or {}
    if not peaks:
        return "-"
    return " / ".join(f"{v / 1024:.1f}" for v in peaks.values())


def _split(row: dict[str, Any]) -> str:
    parts = (row.get("server_breakdown") or {}).get("ttfa_parts") or {}
    if not parts:
        return "-"
    return "/".join(_f((parts.get(k) or {}).get("mean_ms")) for k in ("text_wait", "queue", "engine", "send"))


def _steady_table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["sessions", "TTFA p50 ms", "TTFA p99 ms", "seg-TTFA p50 ms", "seg-TTFA p99 ms", "RTF/stream p50",
            "RTF p5", "underruns", "text-starved", "sessions w/ underrun", "underrun ms", "answers done/started", "errors",
            "server split ms: text wait/queue/engine/send (mean)", "event-loop lag ms p50/p95", "GPU mem peak GiB",
            "server RSS MiB", "real time"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted((r for r in rows if r.get("scenario") == "steady"),
                    key=lambda r: (r["sessions"], bool(r.get("ramp_level")))):
        if "failed" in r:
            out.append(f"| {r['sessions']} | failed: {r['failed'][:80]} |" + " |" * (len(head) - 2))
            continue
        t, s = r["ttfa_ms"], r["ttfa_segment_ms"]
        lag = (r.get("server_breakdown") or {}).get("loop_lag") or {}
        label = f"{r['sessions']} (ramp {r['ramp_s']:g} s)" if r.get("ramp_level") else str(r["sessions"])
        out.append("| " + " | ".join([
            label, _f(t.get("p50")), _f(t.get("p99")), _f(s.get("p50")), _f(s.get("p99")),
            _f(r["rtf_p50"], 2), _f(r["rtf_p5"], 2), _f(r["underruns"]), _f(r.get("underruns_text_starved")),
            _f(r["sessions_with_underruns"]),
            _f(r["underrun_ms"]), f"{r['completed']}/{r['utterances']}", _f(r["n_errors"]), _split(r),
            f"{_f(lag.get('p50_ms'), 1)}/{_f(lag.get('p95_ms'), 1)}" if lag else "-", _gpu_mem(r),
            _f(r["server_rss_peak_mib"]), _f(r["realtime"]),
        ]) + " |")
    return out


def _closed_rows(engine: str, rows: list[dict[str, Any]], only: set[int] | None = None) -> list[list[str]]:
    out = []
    for r in sorted((r for r in rows if r.get("scenario") == "closed-loop"), key=lambda r: r["sessions"]):
        if only is not None and r["sessions"] not in only:
            continue
        if "failed" in r:
            out.append([engine, str(r["sessions"]), f"failed: {r['failed'][:60]}"] + ["-"] * 8)
            continue
        t, tot = r["ttfa_ms"], r["total_ms"]
        na = r.get("answers_no_audio") or 0
        out.append([engine, str(r["sessions"]), _f(r["qps"], 2), _f(t.get("mean")), _f(t.get("p50")),
                    _f(t.get("p99")), _f(tot.get("mean")), _f(tot.get("p99")),
                    f"{na} (waited >= {_f(r.get('no_audio_wait_min_ms'))} ms)" if na else "0",
                    _f(r["n_errors"]), _f(r.get("aggregate_x_realtime"), 1)])
    return out


def _floor_rows(d: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The engine floor's rows (``bench.engine_bench``, the plugin) by concurrency, each from the
    compiled run where it has one."""
    out: dict[int, dict[str, Any]] = {}
    for run in (d.get("floor") or {}).get("runs") or []:
        for r in run.get("rows") or []:
            c = r.get("concurrency")
            if r.get("backend") == "vllm" and r.get("aggregate_steps_per_s") and (c not in out or run.get("compiled")):
                out[int(c)] = r
    return out


def max_realtime(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest steady level (arrival-ramp levels included) heard with no underrun, the
    smallest that had one, whether passing is monotone in the session count, and the levels
    tested. The report's headline and its summary line both read this."""
    steady = sorted((r for r in rows if r["scenario"] == "steady"), key=lambda r: r["sessions"])
    ok = [r["sessions"] for r in steady if r["realtime"]]
    first_fail = next((r["sessions"] for r in steady if not r["realtime"]), None)
    return {
        "max_realtime_sessions": max(ok) if ok else 0,
        "first_failing_sessions": first_fail,
        "monotone": first_fail is None or not ok or max(ok) < first_fail,
        "tested": [r["sessions"] for r in steady],
    }


def headline(d: dict[str, Any], key: str = "e2e") -> dict[str, Any]:
    """The capacity figures of one gateway phase under fixed names: the largest steady level (ramp
    levels included) heard with no underrun, the 400-session level's underruns and TTFA p99 (text
    wait included), every closed-loop level's delivered GPT steps/s against the engine floor at the
    same concurrency from the same call, each level's GPT steps per decoder job, and the engine floor
    at each concurrency it ran (``engine_aggregate_cC``, ``engine_stream_steps_per_s_cC``,
    ``engine_ttft_p50_ms_cC``). ``None`` where not measured."""
    e = d.get(key) or {}
    rows = [r for r in e.get("levels") or [] if "failed" not in r]
    steady = [r for r in rows if r.get("scenario") == "steady"]
    wl = next((r.get("workload") for r in rows if r.get("workload")), None)
    out: dict[str, Any] = {"workload": wl}
    # a ladder of steady levels (not only arrival-ramp levels) says how many sessions fit
    ladder = any(not r.get("ramp_level") for r in steady)
    out["max_realtime_sessions"] = max_realtime(steady)["max_realtime_sessions"] if ladder else None
    for r in steady:
        tag = f"{r['sessions']}" + (f"_ramp{r['ramp_s']:g}" if r.get("ramp_level") else "")
        out[f"underruns_{tag}"] = r.get("underruns")
        out[f"ttfa_p99_ms_{tag}"] = (r.get("ttfa_ms") or {}).get("p99")
        out[f"seg_ttfa_p50_ms_{tag}"] = (r.get("ttfa_segment_ms") or {}).get("p50")
        out[f"seg_ttfa_p99_ms_{tag}"] = (r.get("ttfa_segment_ms") or {}).get("p99")
        out[f"steps_per_decoder_job_{tag}"] = r.get("steps_per_decoder_job")
    floors = _floor_rows(d)
    for r in rows:
        if r.get("scenario") != "closed-loop":
            continue
        n, got = r["sessions"], r.get("delivered_steps_per_s")
        floor = (floors.get(n) or {}).get("aggregate_steps_per_s")  # engine_aggregate_c{n} below
        out[f"delivered_steps_per_s_closed_{n}"] = got
        out[f"delivered_steps_ratio_{n}"] = round(got / floor, 3) if got and floor else None
        out[f"steps_per_decoder_job_closed_{n}"] = r.get("steps_per_decoder_job")
    # the floor under bench.results' engine names (as bench.engine_bench's own run file writes them)
    for c, r in sorted(floors.items()):
        out[f"engine_aggregate_c{c}"] = r.get("aggregate_steps_per_s")
        out[f"engine_stream_steps_per_s_c{c}"] = r.get("steps_per_s_per_stream")
        out[f"engine_ttft_p50_ms_c{c}"] = r.get("ttft_p50_ms")
    return out


def latest_figures(hl: dict[str, Any]) -> dict[str, float | int | None]:
    """The numeric figures of a ``headline``, plus the names ``bench.results.LATEST_KEYS`` reads for
    the conversation workload (the 400-session level: arrivals over 10 s when that level ran)."""
    figs: dict[str, float | int | None] = {k: v for k, v in hl.items()
                                           if isinstance(v, int | float) and not isinstance(v, bool)}
    if hl.get("workload") == "conversation":
        def at400(stem: str) -> float | int | None:
            v = hl.get(f"{stem}_400_ramp10")
            return v if v is not None else hl.get(f"{stem}_400")

        figs["conversation_max_realtime_sessions"] = hl.get("max_realtime_sessions")
        figs["conversation_underruns_400"] = at400("underruns")
        figs["conversation_ttfa_p99_ms_400"] = at400("ttfa_p99_ms")
    return figs


def render_markdown(d: dict[str, Any]) -> str:
    host = d.get("host") or {}
    gpus = host.get("gpus") or []
    gpu_name = gpus[0]["name"] if gpus else "no GPU"
    lines = [f"## GPU: end-to-end ({gpu_name} x{host.get('gpu_count', 0)})", ""]
    runs = d.get("runs") or []
    if runs:
        lines.append(f"Measured {runs[-1].get('date', '?')} on {host.get('hostname', '?')}: {host.get('cpus')} CPU "
                     f"cores ({host.get('cpu_model') or 'model unknown'}), Python {host.get('python')}, torch {host.get('torch')}, vLLM {host.get('vllm')}. "
                     "ChatTTS-shaped checkpoint with random weights "
                     f"({(d.get('checkpoint') or {}).get('size', '?')}): it stops at random, so the gateway runs "
                     "with `session.min_audio_ms_per_unit` (see the command: 32 ms per text unit, half of "
                     "typical speech) to give segments a speech-like length; the rest of the length is random.")
        lines.append("")
        lines.append("Commands:")
        lines.append("")
        lines.append("```sh")
        for r in runs:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in (r.get("caller_env") or {}).items())
            lines.append(f"{env + ' ' if env else ''}{r.get('command')}   # phases {','.join(r.get('phases', []))}")
        lines.append("```")
        lines.append("")
    fl = d.get("floor")
    if fl:
        lines += [f"### Engine floor (bench.engine_bench, {fl.get('steps')} steps per request, EOS blocked, "
                  f"max_num_batched_tokens {fl.get('max_num_batched_tokens')}, async scheduling off)", ""]
        if fl.get("compiled_failed"):
            lines += ["The CUDA-graph engine produced no results (see floor-vllm.log); eager mode below.", ""]
        lines += [
                  "| backend | concurrency | TTFT p50 ms | TTFT p99 ms | steps/s per stream | x real time "
                  "per stream | aggregate steps/s | unfinished |", "|---|---|---|---|---|---|---|---|"]
        for run in fl.get("runs", []):
            mode = "" if run.get("backend") != "vllm" else (" (CUDA graphs)" if run.get("compiled") else " (eager)")
            for r in run.get("rows", []):
                lines.append(f"| {r['backend']}{mode} | {r['concurrency']} | {_f(r['ttft_p50_ms'])} | {_f(r['ttft_p99_ms'])} "
                             f"| {_f(r['steps_per_s_per_stream'], 1)} | {_f(r['x_realtime_per_stream'], 2)} "
                             f"| {_f(r['aggregate_steps_per_s'], 0)} | {r['unfinished']} |")
            if run.get("timed_out") or not run.get("rows"):
                lines.append(f"| {run.get('backend')} | (timed out: {run.get('timed_out')}, rc {run.get('returncode')}) "
                             "| | | | | | |")
        starts = {b: s for run in fl.get("runs", []) for b, s in (run.get("start_s") or {}).items()}
        if starts:
            lines += ["", "Engine start (incl. warm-up, and graph capture when compiled): "
                      + ", ".join(f"{b} {s:.0f} s" for b, s in starts.items()) + "."]
        lines.append("")
    for key, title in (("e2e", "Gateway end to end, one vLLM engine"), ("dp", "Gateway with vLLM data parallelism")):
        e = d.get(key)
        if not e:
            continue
        st = e.get("steady") or {}
        lines += [f"### {title} (data_parallel_size {e.get('data_parallel_size')})", ""]
        if e.get("command"):
            lines += ["```sh", e["command"], "```", ""]
        if e.get("start_s") is not None:
            lines.append(f"Gateway healthy {e['start_s']} s after launch; CUDA graphs {_f(e.get('cuda_graphs'))}, "
                         f"async scheduling {_f(e.get('async_scheduling'))}.")
            for fail in e.get("attempt_failures") or []:
                err = " ".join(str(fail.get("error", "")).split())[-300:]
                lines.append(f"Earlier attempt (CUDA graphs {_f(fail.get('cuda_graphs'))}, async scheduling "
                             f"{_f(fail.get('async_scheduling'))}) failed at {fail.get('stage')}: `{err}`")
            dropped = ((e.get("log_facts") or {}).get("dropped_engine_args") or [])
            if dropped:
                lines.append(f"vLLM dropped engine args: `{dropped[0]}`")
            lines.append("")
        if e.get("error"):
            lines += [f"Did not run: {e['error'][:500]}", ""]
        rows = e.get("levels") or []
        if any(r.get("scenario") == "steady" for r in rows):
            what = ("conversation workload: answers of 120-600 varied characters in 2-6-character deltas "
                    f"at {st.get('tokens_per_s')} deltas/s (+-50 % jitter), 0.5-2 s think time, 100 ms prebuffer"
                    if st.get("workload") == "conversation" else
                    f"short workload: {st.get('utterance_chars')}-character answers at {st.get('tokens_per_s')} "
                    f"tokens/s, {st.get('think_s')} s mean think time")
            lines += [f"`steady` scenario, {what}; each session plays the audio in real time, "
                      f"{st.get('duration_s')} s (+{st.get('settle_s')} s to "
                      "finish). TTFA: first text sent to first PCM byte at the client; seg-TTFA: from the text "
                      "that completed the first segment. RTF/stream: audio seconds received per wall second of "
                      "each answer (flow control keeps a stream at most 2 s ahead of playback, so >= 1 means it "
                      "kept up). GPU memory: whole GPU(s), peak during the level.", ""]
            lines += _steady_table(rows)
            lines.append("")
            summ = e.get("summary") or {}
            hl = headline(d, key)
            lines.append("Headline (" + ", ".join(f"{k} {_f(v, 3 if isinstance(v, float) and v < 10 else 0)}"
                                                   for k, v in hl.items() if v is not None) + ").")
            lines.append("")
            lines.append(f"**Largest session count real time with zero underruns: {summ.get('max_realtime_sessions')}** "
                         f"(tested {summ.get('tested')}; first failing: {_f(summ.get('first_failing_sessions'))}"
                         + ("" if summ.get("monotone", True) else "; not monotone") + ").")
            lines.append("")
        thr = [r for r in rows if r.get("scenario") == "closed-loop"]
        if thr:
            lines += ["Closed loop (answers back to back, audio consumed as it arrives):", "",
                      "| engine | sessions | QPS | TTFA mean ms | TTFA p50 ms | TTFA p99 ms | latency mean ms "
                      "| latency p99 ms | answers with no audio by the end | errors | aggregate x real time |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            lines += ["| " + " | ".join(c) + " |" for c in _closed_rows(f"voicegw (DP {e.get('data_parallel_size')})", thr)]
            lines.append("")
        dec = [f"{r['name']} {_f(r['steps_per_decoder_job'], 1)} ({_f(r.get('decoder_jobs_per_s'))} jobs/s"
               + (f"; decoder busy {_f(r['decoder_busy'], 2)}, {_f(r.get('decoder_mean_batch'), 1)} rows per forward, "
                  f"padding {_f(r.get('decoder_padding'), 2)}" if r.get("decoder_busy") is not None else "") + ")"
               for r in rows if r.get("steps_per_decoder_job")]
        if dec:
            lines += ["GPT steps per decoder job (a job is a row per chunk_steps or fewer, each row one window; "
                      "the gateway's load lines): "
                      + "; ".join(dec) + ".", ""]
        gen = [f"{r['name']} p50 {_f(c.get('lag_p50_ms_worst'), 1)} / p99 {_f(c.get('lag_p99_ms_worst'), 1)} / "
               f"max {_f(c.get('lag_max_ms'))} ms, {c.get('count', 0)} stalls"
               for r in rows if (c := r.get("client_stalls") or {}).get("workers")]
        if gen:
            lines += ["The load generator's own event-loop lateness (its worst worker; what it measures includes it): "
                      + "; ".join(gen) + ".", ""]
        if e.get("skipped"):
            lines += ["Skipped: " + "; ".join(e["skipped"]), ""]
    lines += _burst_lines(d.get("burst"))
    if any(r.get("scenario") == "burst" for r in (d.get("e2e") or {}).get("levels") or []):  # --with-burst
        lines += _burst_lines({"levels": d["e2e"]["levels"]})
    nat = d.get("native")
    if nat:
        lines += ["### Native pipeline baseline (same gateway and clients)", "",
                  f"{nat.get('engine')}, on {nat.get('device')}; closed loop, {nat.get('duration_s')} s per level.", ""]
        if nat.get("error"):
            lines += [f"Did not run: {nat['error'][:500]}", ""]
        ours = (d.get("e2e") or {}).get("levels") or []
        levels = {r["sessions"] for r in nat.get("levels", [])}
        body = _closed_rows("voicegw (vLLM)", ours, levels) + _closed_rows("native pipeline", nat.get("levels", []))
        if body:
            lines += ["| engine | sessions | QPS | TTFA mean ms | TTFA p50 ms | TTFA p99 ms | latency mean ms "
                      "| latency p99 ms | answers with no audio by the end | errors | aggregate x real time |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            lines += ["| " + " | ".join(c) + " |" for c in sorted(body, key=lambda c: (int(c[1]), c[0]))]
            lines += ["", "TTFA of the native pipeline counts only answers that got audio before the level "
                      "ended; the others waited at least the time shown.", ""]
        if nat.get("skipped"):
            lines += ["Skipped: " + "; ".join(nat["skipped"]), ""]
    e1, e2 = (d.get("e2e") or {}).get("summary"), (d.get("dp") or {}).get("summary")
    if e1 and e2:
        a, b = e1.get("max_realtime_sessions") or 0, e2.get("max_realtime_sessions") or 0
        lines.append(f"**Capacity ratio DP {(d.get('dp') or {}).get('data_parallel_size')} / DP 1 (largest real-time "
                     f"session count): {b} / {a} = {(b / a) if a else float('nan'):.2f}**"
                     + (" (DP 1 passed its largest tested level: a lower bound on its capacity)"
                        if e1.get("first_failing_sessions") is None else "")
                     + (" (DP passed its largest tested level)" if e2.get("first_failing_sessions") is None else ""))
        t1 = _top_throughput(d.get("e2e")), _top_throughput(d.get("dp"))
        if t1[0] and t1[1] and t1[0][0] == t1[1][0]:
            lines.append(f"Aggregate audio throughput at {t1[0][0]} closed-loop sessions: x{t1[1][1]} vs x{t1[0][1]} "
                         f"real time = {t1[1][1] / t1[0][1]:.2f}.")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _burst_lines(b: dict[str, Any] | None) -> list[str]:
    """The ``burst`` phase: newcomers' time to first audio and what the burst cost the streams
    already playing (their underruns from the burst on)."""
    if not b:
        return []
    lines = ["### Burst: newcomers while streams play (one vLLM engine)", ""]
    if b.get("error"):
        lines += [f"Did not run: {b['error'][:500]}", ""]
    rows = [r for r in b.get("levels") or [] if r.get("scenario") == "burst"]
    if rows:
        lines += ["| newcomers | newcomers' TTFA p50 / p99 ms | newcomers' underruns (ms of silence) "
                  "| playing streams' underruns since the burst (ms of silence) | errors |", "|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['sessions']} | failed: {r['failed'][:80]} | | | |")
            continue
        roles = r.get("roles") or {}
        new, bg = roles.get("burst") or {}, roles.get("background") or {}
        t = new.get("ttfa_ms") or {}
        lines.append(f"| {r['sessions']} | {_f(t.get('p50'))} / {_f(t.get('p99'))} "
                     f"| {_f(new.get('underruns'))} ({_f(new.get('underrun_ms'))}) "
                     f"| {_f(bg.get('underruns_since'))} ({_f(bg.get('underrun_ms_since'))}) | {_f(r.get('n_errors'))} |")
    if rows:
        lines.append("")
    if b.get("skipped"):
        lines += ["Skipped: " + "; ".join(b["skipped"]), ""]
    return lines


def _top_throughput(e: dict[str, Any] | None) -> tuple[int, float] | None:
    if not e:
        return None
    rows = [r for r in e.get("levels") or [] if r.get("scenario") == "closed-loop" and r.get("aggregate_x_realtime")]
    if not rows:
        return None
    r = max(rows, key=lambda r: r["sessions"])
    return r["sessions"], float(r["aggregate_x_realtime"])


# ---------------------------------------------------------------------------------- CLI
