"""The checks, their default thresholds and the TOML file that overrides them.

Each check reduces the data set to one number and grades it pass/warn/fail:

* ``max`` checks (higher is worse): warn when the value exceeds ``warn``, fail when it exceeds ``fail``
  (``>=`` instead of ``>`` for ``tabular.leakage``, whose limit is stated as "AUC ≥ 0.99").
* ``min`` checks (lower is worse): warn below ``warn``, fail below ``fail``.
* ``range`` checks: pass inside ``pass = [lo, hi]``, warn inside ``warn = [lo, hi]``, fail outside.

A threshold set to ``false`` never triggers. ``enabled = false`` skips a check. Example ``checks.toml``::

    [text]
    field = "text"            # --text-field
    max_tokens = 256
    near_threshold = 0.8      # estimated Jaccard of word 3-grams
    num_perm = 128

    [tabular]
    label = "Class"
    ranges = { Amount = [0, 25000], Time = [0, 172800] }

    [checks."dedup.exact"]
    warn = 0.0
    fail = 0.01

    [checks.zipf]
    pass = [0.9, 1.1]
    warn = [0.7, 1.3]
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...runtime.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Check:
    id: str
    kind: str                     # "max" | "min" | "range"
    warn: object                  # float | [lo, hi] | None
    fail: object = None           # float | None (unused for range)
    pass_range: tuple | None = None
    inclusive: bool = False       # max checks: >= rather than >
    what: str = ""
    enabled: bool = True

    def limits(self) -> str:
        if self.kind == "range":
            lo, hi = self.pass_range
            w = f", warn [{self.warn[0]:g}, {self.warn[1]:g}]" if self.warn else ""
            return f"pass [{lo:g}, {hi:g}]{w}"
        op = {"max": ">=" if self.inclusive else ">", "min": "<"}[self.kind]
        parts = [f"{name}{op}{v:g}" for name, v in (("warn", self.warn), ("fail", self.fail)) if v is not None]
        return ", ".join(parts) or "never fails"

    def grade(self, value: float) -> str:
        if self.kind == "range":
            lo, hi = self.pass_range
            if lo <= value <= hi:
                return "pass"
            if self.warn and self.warn[0] <= value <= self.warn[1]:
                return "warn"
            return "fail"
        if self.kind == "max":
            over = (lambda v, t: v >= t) if self.inclusive else (lambda v, t: v > t)
        else:
            over = lambda v, t: v < t  # noqa: E731
        if self.fail is not None and over(value, self.fail):
            return "fail"
        if self.warn is not None and over(value, self.warn):
            return "warn"
        return "pass"


DEFAULT_CHECKS: dict[str, Check] = {c.id: c for c in (
    Check("format.unreadable", "max", 0.0, 0.01, what="share of rows that cannot be parsed"),
    Check("schema.missing", "max", 0.01, 0.1, what="largest share of missing/empty values in one field"),
    Check("schema.types", "max", 0.0, 0.01, what="largest share of type mismatches in one field"),
    Check("dedup.exact", "max", 0.001, 0.05, what="share of documents/rows repeating an earlier one exactly"),
    Check("dedup.near", "max", 0.01, 0.1, what="share of documents near-duplicating an earlier one (MinHash-LSH)"),
    Check("tokens.over_max", "max", 0.0, 0.05, what="share of documents longer than max_tokens"),
    Check("tokens.unknown", "max", 0.001, 0.01, what="unknown-token rate of the tokenizer"),
    Check("zipf", "range", (0.6, 1.5), pass_range=(0.8, 1.2), what="Zipf coefficient s of the rank-frequency curve"),
    Check("entities.coverage", "min", 0.9, 0.85, what="share of the listed entities that occur"),
    Check("tabular.class_balance", "min", 0.1, 0.001, what="share of the rarest label class"),
    Check("tabular.constant", "max", 0.0, 0.25, what="share of columns holding one value"),
    Check("tabular.leakage", "max", 0.98, 0.99, inclusive=True,
          what="largest single-feature ROC AUC for the label"),
    Check("tabular.ranges", "max", 0.0, 0.001, what="share of numeric values non-finite or outside [tabular] ranges"),
)}


@dataclass(frozen=True)
class DataCheckConfig:
    text_field: str | None = None
    label: str | None = None
    max_tokens: int | None = None
    near_threshold: float = 0.8
    num_perm: int = 128
    near: bool = True
    ranges: dict = field(default_factory=dict)
    checks: dict = field(default_factory=lambda: dict(DEFAULT_CHECKS))


_SECTIONS = {"text": {"field", "max_tokens", "near_threshold", "num_perm", "near"},
             "tabular": {"label", "ranges"}, "checks": None}


def _num(where: str, v: object, allow_false: bool = True) -> float | None:
    if v is False and allow_false:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where} must be a number{' or false' if allow_false else ''}, got {v!r}",
                          "see docs/datacheck.md for the check table")
    return float(v)


def _pair(where: str, v: object) -> tuple[float, float]:
    if not (isinstance(v, list) and len(v) == 2):
        raise ConfigError(f"{where} must be [low, high], got {v!r}", "e.g. pass = [0.8, 1.2]")
    lo, hi = (_num(where, x, allow_false=False) for x in v)
    if lo > hi:
        raise ConfigError(f"{where}: low {lo:g} is above high {hi:g}", "write [low, high]")
    return lo, hi


def load_config(path: str | Path | None) -> DataCheckConfig:
    """Parse ``checks.toml`` (see the module docstring). Raises ConfigError naming the bad key."""
    cfg = DataCheckConfig()
    if path is None:
        return cfg
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror}", "pass an existing checks.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p} is not valid TOML: {e}", "see docs/datacheck.md for an example") from None
    for section in raw:
        if section not in _SECTIONS:
            raise ConfigError(f"{p}: unknown section [{section}]", f"sections: {', '.join(_SECTIONS)}")
        allowed = _SECTIONS[section]
        if allowed is not None:
            bad = set(raw[section]) - allowed
            if bad:
                raise ConfigError(f"{p}: unknown key(s) {sorted(bad)} in [{section}]", f"keys: {sorted(allowed)}")
    text, tab = raw.get("text", {}), raw.get("tabular", {})
    upd: dict = {}
    if "field" in text:
        upd["text_field"] = str(text["field"])
    if "max_tokens" in text:
        upd["max_tokens"] = int(_num("[text] max_tokens", text["max_tokens"], allow_false=False))
    if "near_threshold" in text:
        t = _num("[text] near_threshold", text["near_threshold"], allow_false=False)
        if not 0 < t <= 1:
            raise ConfigError(f"[text] near_threshold must be in (0, 1], got {t:g}", "e.g. 0.8")
        upd["near_threshold"] = t
    if "num_perm" in text:
        n = int(_num("[text] num_perm", text["num_perm"], allow_false=False))
        if not 16 <= n <= 1024:
            raise ConfigError(f"[text] num_perm must be in [16, 1024], got {n}", "128 is datasketch's default")
        upd["num_perm"] = n
    if "near" in text:
        upd["near"] = bool(text["near"])
    if "label" in tab:
        upd["label"] = str(tab["label"])
    if "ranges" in tab:
        if not isinstance(tab["ranges"], dict):
            raise ConfigError("[tabular] ranges must be a table of column = [low, high]",
                              "ranges = { Amount = [0, 1e5] }")
        upd["ranges"] = {str(k): _pair(f"[tabular] ranges.{k}", v) for k, v in tab["ranges"].items()}
    checks = dict(DEFAULT_CHECKS)
    for cid, spec in raw.get("checks", {}).items():
        if cid not in checks:
            raise ConfigError(f"{p}: unknown check {cid!r}", f"checks: {', '.join(DEFAULT_CHECKS)}")
        if not isinstance(spec, dict):
            raise ConfigError(f"[checks.{cid}] must be a table", 'e.g. [checks."dedup.exact"] warn = 0.0')
        c = checks[cid]
        allowed = {"enabled", "warn", "pass"} if c.kind == "range" else {"enabled", "warn", "fail"}
        bad = set(spec) - allowed
        if bad:
            raise ConfigError(f"[checks.{cid}]: unknown key(s) {sorted(bad)}", f"keys: {sorted(allowed)}")
        ch: dict = {}
        if "enabled" in spec:
            ch["enabled"] = bool(spec["enabled"])
        if c.kind == "range":
            if "pass" in spec:
                ch["pass_range"] = _pair(f"[checks.{cid}] pass", spec["pass"])
            if "warn" in spec:
                ch["warn"] = None if spec["warn"] is False else _pair(f"[checks.{cid}] warn", spec["warn"])
        else:
            for k in ("warn", "fail"):
                if k in spec:
                    ch[k] = _num(f"[checks.{cid}] {k}", spec[k])
        checks[cid] = replace(c, **ch)
    return replace(cfg, checks=checks, **upd)
