"""Finding ChatTTS weights: a local directory in upstream layout, or the hub when allowed.

Weights: 2Noise/ChatTTS, CC BY-NC 4.0 (non-commercial use only).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engine.checkpoint import ASSET_FILES, missing_files

_log = logging.getLogger(__name__)

#: Upstream's source on the Hugging Face hub (what ``Chat.load(source="huggingface")`` uses).
HUB_REPO = "2Noise/ChatTTS"
DEFAULT_MODEL_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "voicegw" / "chattts"


class ModelNotFound(RuntimeError):
    """No complete ChatTTS checkpoint is available (message says what is missing)."""


def default_model_dir() -> Path:
    return DEFAULT_MODEL_DIR


def download(target: Path) -> Path:
    """Download the released checkpoint into ``target`` (progress bars on stderr)."""
    from huggingface_hub import snapshot_download

    _log.info("downloading ChatTTS weights from https://huggingface.co/%s to %s", HUB_REPO, target)
    target.mkdir(parents=True, exist_ok=True)
    snapshot_download(
        repo_id=HUB_REPO,
        allow_patterns=[f for f in ASSET_FILES],
        local_dir=str(target),
    )
    return target


def resolve_model_dir(model_dir: str | Path | None, allow_download: bool = False) -> Path:
    """Return a complete checkpoint directory or raise ``ModelNotFound``.

    ``model_dir`` empty/None means the default cache directory. With ``allow_download`` a
    missing checkpoint is fetched from the hub (needs network).
    """
    root = Path(model_dir).expanduser() if model_dir else default_model_dir()
    missing = missing_files(root)
    if not missing:
        return root
    if allow_download:
        try:
            download(root)
        except Exception as exc:  # network errors, hub errors: report, do not crash callers
            raise ModelNotFound(f"download from {HUB_REPO} into {root} failed: {exc}") from exc
        missing = missing_files(root)
        if not missing:
            return root
    raise ModelNotFound(
        f"ChatTTS weights not found in {root} (missing: {', '.join(missing[:3])}"
        f"{', ...' if len(missing) > 3 else ''}). Use --model-dir DIR with upstream's layout, "
        f"or --download to fetch {HUB_REPO} (CC BY-NC 4.0), or `voicegw make-checkpoint` for random test weights."
    )
