"""Pack / unpack a random checkpoint for a device run whose upload is size-limited.

``pack SRC DST``: copy ``SRC`` (a ``make-checkpoint`` directory) to ``DST``, replacing each large
tensor of the ``*.safetensors`` files by its shape, dtype, mean and std (``*.regen.json``).
``unpack DST``: regenerate those tensors (normal, same mean/std, seeded). The weights were random
to begin with, so the result is another random checkpoint of the same architecture: enough for
timing the decoder (bench/gateway_pacing_gpu.sh), never for audio.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

BIG = 65_536


def pack(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in dst.rglob("*.safetensors"):
        tensors = load_file(str(f))
        keep, regen = {}, {}
        for k, v in tensors.items():
            if v.size > BIG and np.issubdtype(v.dtype, np.floating):
                regen[k] = {"shape": list(v.shape), "dtype": str(v.dtype), "mean": float(v.mean()),
                            "std": float(v.std())}
            else:
                keep[k] = v
        save_file(keep, str(f))
        f.with_suffix(".regen.json").write_text(json.dumps(regen))


def unpack(dst: Path) -> None:
    rng = np.random.default_rng(0)
    for j in dst.rglob("*.regen.json"):
        f = j.with_suffix("").with_suffix(".safetensors")
        tensors = load_file(str(f))
        for k, m in json.loads(j.read_text()).items():
            tensors[k] = (rng.standard_normal(m["shape"]) * m["std"] + m["mean"]).astype(m["dtype"])
        save_file(tensors, str(f))
        j.unlink()


if __name__ == "__main__":
    if sys.argv[1] == "pack":
        pack(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        unpack(Path(sys.argv[2]))
