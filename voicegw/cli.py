"""``voicegw`` command line: serve, say, chat, make-checkpoint, loadtest, bench, config-doc."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any

from voicegw import __version__
from voicegw.config import Config, ConfigError, cli_fields, describe, load_config

#: Short aliases for the settings people change most.
_ALIASES: dict[str, tuple[str, ...]] = {
    "gateway.host": ("--host",),
    "gateway.port": ("--port",),
    "gateway.auth_tokens": ("--token",),
    "engine.backend": ("--backend",),
    "engine.model_dir": ("--model-dir",),
    "engine.download": ("--download",),
    "engine.device": ("--device",),
    "gateway.log_level": ("--log-level",),
}

_DEFAULT_URL = "ws://127.0.0.1:8765/ws"


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (sections [gateway] [engine] [scheduler] [limits])")
    g = p.add_argument_group("settings (also VOICEGW_<SECTION>_<FIELD> env vars; see `voicegw config-doc`)")
    for dotted, tp, default, doc in cli_fields():
        flags = ("--" + dotted, *_ALIASES.get(dotted, ()))
        kw: dict[str, Any] = {"dest": dotted, "default": None, "help": f"{doc} [default: {default!r}]"}
        if tp is bool:
            kw["nargs"] = "?"
            kw["const"] = "true"
            kw["metavar"] = "BOOL"
        elif typing.get_origin(tp) is tuple:
            kw["metavar"] = "A,B"
        else:
            kw["metavar"] = {int: "INT", float: "NUM"}.get(tp, "STR")
        g.add_argument(*flags, **kw)


def _config_from(args: argparse.Namespace) -> Config:
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    return load_config(toml_path=args.config, overrides=overrides)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="voicegw",
        description="Real-time voice gateway: text streamed in over WebSocket, ChatTTS speech (GPT on vLLM) streamed out.",
    )
    p.add_argument("--version", action="version", version=f"voicegw {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="run the gateway (WebSocket /ws, demo page at /, /healthz, /metrics)",
        description="Run the gateway. Without ChatTTS weights it falls back to eSpeak NG (with a warning).",
    )
    _add_config_flags(s)

    s = sub.add_parser("say", help="speak TEXT through a running gateway and write a WAV file",
                       description="Speak TEXT through a running gateway (start one with `voicegw serve`).")
    s.add_argument("text", help="text to speak")
    s.add_argument("-o", "--output", required=True, help="output WAV path")
    s.add_argument("--url", default=None, help=f"gateway WebSocket URL [default: {_DEFAULT_URL}]")
    s.add_argument("--port", type=int, default=None, help="gateway port on 127.0.0.1 (what `serve --port` used)")
    s.add_argument("--voice", default=None, help="voice/speaker (seed or encoded embedding)")
    s.add_argument("--sample-rate", type=int, default=24000, help="8000, 16000, 24000 or 48000 [default: 24000]")
    s.add_argument("--token", default=None, help="bearer token")
    s.add_argument("--play", action="store_true", help="also play to speakers (needs sounddevice)")

    s = sub.add_parser(
        "chat", help="interactive: each line typed is streamed to the gateway and spoken",
        description="Each line typed is streamed to a running gateway and spoken; lines queue behind the one "
                    "speaking. Type /stop to barge in (cancel everything speaking or queued), /quit (or end of "
                    "input) to leave after the queued speech. With -o, the WAV holds the audio received "
                    "from the gateway (cancelled audio included up to the cancel), not only what was heard.",
    )
    s.add_argument("--url", default=None, help=f"gateway WebSocket URL [default: {_DEFAULT_URL}]")
    s.add_argument("--port", type=int, default=None, help="gateway port on 127.0.0.1 (what `serve --port` used)")
    s.add_argument("--voice", default=None, help="voice/speaker")
    s.add_argument("--token", default=None, help="bearer token")
    s.add_argument("-o", "--output", default=None, help="also append all audio to this WAV file")

    s = sub.add_parser(
        "make-checkpoint",
        help="write a ChatTTS-shaped checkpoint with random weights (upstream layout)",
        description="Random weights in upstream ChatTTS layout: for tests, benchmarks and offline development.",
    )
    s.add_argument("out", help="output directory")
    s.add_argument("--size", choices=["tiny", "small", "full"], default="tiny",
                   help="tiny (tests), small (benchmarks near real time on a CPU) or full (real shapes)")
    s.add_argument("--seed", type=int, default=0, help="RNG seed (deterministic output)")

    s = sub.add_parser("loadtest", help="WebSocket load generator (see `voicegw loadtest --help`)", add_help=False)
    s.add_argument("args", nargs=argparse.REMAINDER)

    s = sub.add_parser("bench", help="benchmarks: engine | decoder (see bench/)", add_help=False)
    s.add_argument("which", nargs="?", choices=["engine", "decoder"], help="which benchmark")
    s.add_argument("args", nargs=argparse.REMAINDER)

    sub.add_parser("config-doc", help="print the configuration reference (Markdown)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # loadtest and bench hand every argument to their own parsers; argparse's REMAINDER does not
    # take an option in first place (``voicegw loadtest --help``), so collect those too.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "command", None) not in ("loadtest", "bench"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*extra, *args.args]
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        try:
            cfg = _config_from(args)
        except ConfigError as exc:
            print(f"voicegw: configuration error: {exc}", file=sys.stderr)
            return 2
        from voicegw.runtime import serve

        return serve(cfg)
    if args.command == "make-checkpoint":
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from engine.checkpoint import make_checkpoint

        out = make_checkpoint(args.out, args.size, seed=args.seed)
        print(f"wrote {args.size} random ChatTTS checkpoint to {out}")
        return 0
    if args.command in ("say", "chat"):
        from clients.python import VoicegwError, chat, say

        url = args.url or (f"ws://127.0.0.1:{args.port}/ws" if args.port else _DEFAULT_URL)
        try:
            if args.command == "chat":
                return int(asyncio.run(chat(url, voice=args.voice, token=args.token, out_wav=args.output)) or 0)
            stats = asyncio.run(say(url, args.text, args.output, voice=args.voice, sample_rate_hz=args.sample_rate,
                                    token=args.token, play=args.play))
        except VoicegwError as exc:
            if exc.code == "handshake_failed":
                print(f"voicegw {args.command}: no gateway answers at {url}: start one with `voicegw serve`"
                      " (or give --url / --port)", file=sys.stderr)
            else:
                print(f"voicegw {args.command}: {exc.code}: {exc.message}", file=sys.stderr)
            return 1
        print(f"wrote {args.output}: {stats}")
        return 0
    if args.command == "loadtest":
        from loadtest.__main__ import main as loadtest_main

        return int(loadtest_main(args.args) or 0)
    if args.command == "bench":
        if args.which is None:
            print("usage: voicegw bench {engine,decoder} [options]  (each has --help)")
            return 2
        import importlib
        from pathlib import Path

        # bench/ is not installed: it ships with the source checkout, beside voicegw/.
        root = Path(__file__).resolve().parents[1]
        if not (root / "bench" / f"{args.which}_bench.py").exists():
            print("voicegw bench: the benchmarks ship with the source checkout (bench/), not the package")
            return 2
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        mod = importlib.import_module(f"bench.{args.which}_bench")
        return int(mod.main(args.args) or 0)
    if args.command == "config-doc":
        print(describe())
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
