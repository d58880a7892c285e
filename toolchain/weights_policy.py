"""What a Hugging Face model directory may hold: safetensors weights, JSON and text; never pickle.

Pickle files (``pytorch_model.bin``, ``*.pt``, ``*.ckpt``, …) run code when loaded; transformers loads a ``.bin``
whenever it finds one it prefers, and only torch's ``weights_only`` stands between it and code execution. So a
directory holding any pickle file is refused, whatever else it holds (a dummy ``*.safetensors`` beside a
``pytorch_model.bin`` included), unless ``DSEDGE_ALLOW_PICKLE=1`` says the user trusts it (then a warning is logged
and the files are still fingerprinted). Pickles are recognised by name and by content (protocol-2+ pickle header,
or torch's zip container), so renaming one does not hide it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..runtime.errors import SourceError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".dill")
ALLOW_ENV = "DSEDGE_ALLOW_PICKLE"
_log = logging.getLogger("dsedge")


def _looks_like_pickle(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head == b"PK\x03\x04"


def hf_source_files(path: str | os.PathLike) -> list[Path]:
    """Every regular file under the HF model directory ``path`` (what the source fingerprint must cover), after
    refusing pickle files.

    Raises:
        SourceError: no ``model.safetensors`` (or sharded ``model.safetensors.index.json``); a pickle file present
            and ``DSEDGE_ALLOW_PICKLE`` not set to 1; a link that leaves the directory.
    """
    root = Path(path)
    base = root.resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts)
    for p in files:
        if base not in p.resolve().parents:
            raise SourceError(f"{p} links outside the model directory", "copy the file into the directory")
    if not any(p.name in ("model.safetensors", "model.safetensors.index.json") for p in files):
        raise SourceError(f"{root} has config.json but no model.safetensors",
                          "save the model with save_pretrained(safe_serialization=True); .bin (pickle) is not loaded")
    pickles = [p for p in files if p.suffix.lower() in PICKLE_SUFFIXES or
               (p.suffix.lower() not in (".safetensors", ".json", ".txt", ".md") and _looks_like_pickle(p))]
    if pickles:
        names = ", ".join(p.relative_to(root).as_posix() for p in pickles[:3])
        if os.environ.get(ALLOW_ENV) != "1":
            raise SourceError(f"{root} holds pickle files ({names}), which can run code when loaded",
                              f"delete them (model.safetensors is enough), or set {ALLOW_ENV}=1 if you trust them")
        _log.warning("%s=1: %s holds pickle files (%s); they may be loaded and can run code", ALLOW_ENV, root, names)
    return files
