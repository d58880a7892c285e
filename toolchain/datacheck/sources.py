"""Streaming readers for the data formats ``dsedge data check`` reads, and the shard plan.

A data set is a file or a directory of files of one format: JSON Lines (``.jsonl``/``.ndjson``), CSV (``.csv``,
``.tsv``), Parquet (``.parquet``/``.pq``, read with pyarrow) or plain text (anything else; one document per
non-blank line). A shard is a byte range of a line-based file that starts at a line start (or a run of Parquet row
groups); reading a shard yields :class:`Batch` es of at most ``batch_rows`` rows, so memory is bounded by the batch.

Locations: every row carries ``loc = file_index * 2**40 + line`` (int64; line is 1-based, the physical line a row
starts on; for Parquet the 1-based row number), sortable across shards and files.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ...runtime.errors import DsedgeError

FILE_SHIFT = 40
TEXT_FIELD = "text"
FORMATS = ("jsonl", "csv", "parquet", "text")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
             ".pq": "parquet"}


class DataError(DsedgeError):
    """The data set cannot be read at all (missing path, mixed formats, unreadable header)."""


@dataclass(frozen=True)
class Shard:
    """One unit of work: ``path[start:end)`` in bytes (line formats) or ``row_groups`` (Parquet).

    ``first_line`` is the 1-based line number of the byte at ``start``; ``header`` the CSV header row.
    """

    file_index: int
    path: str
    fmt: str
    start: int = 0
    end: int = -1
    first_line: int = 1
    header: tuple[str, ...] = ()
    delimiter: str = ","
    row_groups: tuple[int, ...] = ()


@dataclass
class Batch:
    """Rows of one shard. ``columns[name][i]`` is row i's raw value: ``str`` for CSV/text, the JSON value for JSONL
    (absent key = :data:`ABSENT`), the Python value for Parquet (null = ``None``)."""

    locs: list[int] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    unreadable: list[tuple[int, str]] = field(default_factory=list)   # (loc, reason)
    blank_lines: int = 0

    @property
    def n(self) -> int:
        return len(self.locs)


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def detect_format(path: Path) -> str:
    return _SUFFIXES.get(path.suffix.lower(), "text")


def list_files(data: str | os.PathLike) -> tuple[list[Path], str]:
    """The files of a data set (a file, or a directory's files sorted by name) and their common format.

    Raises:
        DataError: no such path, an empty directory, or files of several formats.
    """
    p = Path(data)
    if p.is_file():
        return [p], detect_format(p)
    if p.exists() and not p.is_dir():
        raise DataError(f"{p}: not a regular file (a device, pipe or socket)",
                        "pass a .jsonl, .csv, .parquet or .txt file, or a folder")
    if not p.is_dir():
        raise DataError(f"{p}: no such file or directory", "pass a .jsonl, .csv, .parquet or .txt file, or a folder")
    files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    if not files:
        raise DataError(f"{p}: the directory has no data files", "put the shards (.jsonl, .csv, .parquet, .txt) there")
    fmts = {detect_format(f) for f in files}
    if len(fmts) > 1:
        raise DataError(f"{p}: files of several formats ({', '.join(sorted(fmts))})", "check one format per directory")
    return files, fmts.pop()


def _csv_header(path: Path) -> tuple[tuple[str, ...], str, int]:
    """(header, delimiter, byte length of the header line)."""
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with open(path, "rb") as f:
        raw = f.readline()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{path}: the CSV header is not UTF-8", "re-encode the file as UTF-8") from None
    header = next(csv.reader([text], delimiter=delimiter), [])
    if len(header) == 1 and delimiter == "," and any(d in header[0] for d in SNIFFED_DELIMITERS):
        delimiter = _sniff_delimiter(text)
        header = next(csv.reader([text], delimiter=delimiter), [])
    if not header or not any(h.strip() for h in header):
        if _blank_file(path):               # an empty data set: no rows, graded like empty JSONL/text (exit 1)
            return (), delimiter, len(raw)
        raise DataError(f"{path}: the CSV has no header row", "the first line must name the columns")
    return tuple(h.strip() for h in header), delimiter, len(raw)


SNIFFED_DELIMITERS = ";\t|"


def _sniff_delimiter(header_line: str) -> str:
    """The delimiter of a ``.csv`` header that reads as one comma-separated field but holds ``;``, a tab or ``|``
    (csv.Sniffer on the header line, limited to those; else the most frequent of them). Every engine reads rows with
    the shard's delimiter, so the whole file is read with it."""
    try:
        return csv.Sniffer().sniff(header_line, delimiters=SNIFFED_DELIMITERS).delimiter
    except csv.Error:
        return max(SNIFFED_DELIMITERS, key=header_line.count)


def _blank_file(path: Path) -> bool:
    """True when the file holds nothing but whitespace (stops at the first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def plan_shards(data: str | os.PathLike, shard_bytes: int | None = None) -> list[Shard]:
    """Shards in data order. ``shard_bytes=None``: one shard per file (the single-process run).

    Line formats are cut at the first line start at or after each multiple of ``shard_bytes`` (CSV records must not
    span lines for a cut to be valid; a quoted newline in a CSV field is read correctly only inside one shard).
    Parquet files are cut at row-group boundaries, about ``shard_bytes`` of compressed data each.
    """
    files, fmt = list_files(data)
    shards: list[Shard] = []
    for i, path in enumerate(files):
        size = path.stat().st_size
        if fmt == "parquet":
            shards.extend(_parquet_shards(i, path, shard_bytes))
            continue
        header, delimiter, start = ((), ",", 0)
        if fmt == "csv":
            header, delimiter, start = _csv_header(path)
        if shard_bytes is None or size - start <= shard_bytes:
            shards.append(Shard(i, str(path), fmt, start, size, 2 if fmt == "csv" else 1, header, delimiter))
            continue
        cuts = _line_cuts(path, start, size, shard_bytes)
        for (a, line), (b, _) in zip(cuts, cuts[1:]):
            shards.append(Shard(i, str(path), fmt, a, b, line + (1 if fmt == "csv" else 0), header, delimiter))
    return shards


def _line_cuts(path: Path, start: int, size: int, shard_bytes: int) -> list[tuple[int, int]]:
    """[(byte offset, 1-based line number of that offset relative to ``start``'s line)] ending with (size, _)."""
    cuts = [(start, 1)]
    lines_before = 0
    with open(path, "rb") as f:
        pos = start
        f.seek(start)
        target = start + shard_bytes
        while target < size:
            # count newlines up to the target, then move to the next line start
            while pos < target:
                chunk = f.read(min(1 << 20, target - pos))
                if not chunk:
                    break
                lines_before += chunk.count(b"\n")
                pos += len(chunk)
            rest = f.readline()
            pos += len(rest)
            if rest.endswith(b"\n"):
                lines_before += 1
            if pos >= size:
                break
            cuts.append((pos, lines_before + 1))
            target = max(pos, target) + shard_bytes
    cuts.append((size, lines_before + 1))
    return cuts


def _parquet_shards(i: int, path: Path, shard_bytes: int | None) -> list[Shard]:
    meta = _open_parquet(path).metadata
    groups = list(range(meta.num_row_groups))
    if shard_bytes is None or not groups:
        return [Shard(i, str(path), "parquet", row_groups=tuple(groups))]
    out, cur, cur_bytes, first_row, row = [], [], 0, 1, 1
    for g in groups:
        rg = meta.row_group(g)
        if cur and cur_bytes + rg.total_byte_size > shard_bytes:
            out.append(Shard(i, str(path), "parquet", first_line=first_row, row_groups=tuple(cur)))
            cur, cur_bytes, first_row = [], 0, row
        cur.append(g)
        cur_bytes += rg.total_byte_size
        row += rg.num_rows
    out.append(Shard(i, str(path), "parquet", first_line=first_row, row_groups=tuple(cur)))
    return out


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise DataError("reading Parquet needs pyarrow, which is not installed",
                        'pip install -e ".[data]"') from None
    return pq


def _open_parquet(path: str | os.PathLike):
    """``pyarrow.parquet.ParquetFile(path)``; a file pyarrow cannot open is a DataError like an unreadable CSV header."""
    pq = _pyarrow_parquet()
    import pyarrow as pa
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({_arrow_reason(e)})",
                        "the file is truncated, corrupt or not Parquet: rewrite it, or give it its real "
                        "format's suffix (.jsonl, .csv, .txt)") from None


def _arrow_reason(e: Exception) -> str:
    return str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") if str(e).strip() else type(e).__name__


def _lines(shard: Shard) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line without the newline) for the lines in the shard's byte range."""
    with open(shard.path, "rb") as f:
        f.seek(shard.start)
        pos, line = shard.start, shard.first_line
        for raw in f:
            if pos >= shard.end:
                break
            pos += len(raw)
            yield line, raw.rstrip(b"\r\n")
            line += 1


BATCH_BYTES = 1 << 20


def read_batches(shard: Shard, batch_rows: int = 4096) -> Iterator[Batch]:
    """Stream the shard's rows in batches (see :class:`Batch`) of at most ``batch_rows`` rows and, for line formats,
    about ``BATCH_BYTES`` (1 MiB) of input, so a batch's memory does not grow with document length."""
    reader = {"jsonl": _read_jsonl, "csv": _read_csv, "text": _read_text, "parquet": _read_parquet}[shard.fmt]
    yield from reader(shard, batch_rows)


def _loc(shard: Shard, line: int) -> int:
    return (shard.file_index << FILE_SHIFT) + line


def _read_text(shard: Shard, batch_rows: int) -> Iterator[Batch]:
    b = Batch(columns={TEXT_FIELD: []})
    size = 0
    for line, raw in _lines(shard):
        size += len(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            b.unreadable.append((_loc(shard, line), f"not UTF-8 at byte {e.start}"))
            continue
        if not text.strip():
            b.blank_lines += 1
            continue
        b.locs.append(_loc(shard, line))
        b.columns[TEXT_FIELD].append(text)
        if b.n >= batch_rows or size >= BATCH_BYTES:
            yield b
            b, size = Batch(columns={TEXT_FIELD: []}), 0
    yield b


def _read_jsonl(shard: Shard, batch_rows: int) -> Iterator[Batch]:
    b = Batch()
    rows: list[dict] = []

    def flush() -> Batch:
        names: dict[str, None] = {}
        for r in rows:
            names.update(dict.fromkeys(r))
        b.columns = {k: [r.get(k, ABSENT) for r in rows] for k in names}
        return b

    size = 0
    for line, raw in _lines(shard):
        size += len(raw)
        if not raw.strip():
            b.blank_lines += 1
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            b.unreadable.append((_loc(shard, line), f"invalid JSON: {str(e).split(':')[0]}"))
            continue
        if not isinstance(obj, dict):
            b.unreadable.append((_loc(shard, line), f"a JSON {type(obj).__name__}, not an object"))
            continue
        b.locs.append(_loc(shard, line))
        rows.append(obj)
        if len(rows) >= batch_rows or size >= BATCH_BYTES:
            yield flush()
            b, rows, size = Batch(), [], 0
    yield flush()


def _read_csv(shard: Shard, batch_rows: int) -> Iterator[Batch]:
    header = shard.header
    state = {"line": shard.first_line - 1, "bytes": 0}
    pending: list[tuple[int, str]] = []

    def decoded() -> Iterator[str]:
        for line, raw in _lines(shard):
            state["line"] = line
            state["bytes"] += len(raw)
            try:
                yield raw.decode("utf-8") + "\n"
            except UnicodeDecodeError as e:
                pending.append((_loc(shard, line), f"not UTF-8 at byte {e.start}"))

    def new() -> Batch:
        return Batch(columns={h: [] for h in header})

    b = new()
    reader = csv.reader(decoded(), delimiter=shard.delimiter)
    row_start = shard.first_line
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            b.unreadable.append((_loc(shard, row_start), f"CSV error: {e}"))
            row_start = state["line"] + 1
            continue
        if pending:
            b.unreadable.extend(pending)
            pending.clear()
        loc = _loc(shard, row_start)
        row_start = state["line"] + 1
        if not row or (len(row) == 1 and not row[0].strip()):
            b.blank_lines += 1
            continue
        if len(row) != len(header):
            b.unreadable.append((loc, f"{len(row)} fields, the header has {len(header)}"))
            continue
        b.locs.append(loc)
        for h, v in zip(header, row):
            b.columns[h].append(v)
        if b.n >= batch_rows or state["bytes"] >= BATCH_BYTES:
            yield b
            b, state["bytes"] = new(), 0
    b.unreadable.extend(pending)
    yield b


def _read_parquet(shard: Shard, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa
    pf = _open_parquet(shard.path)
    row = shard.first_line
    if not shard.row_groups:
        yield Batch()
        return
    batches = pf.iter_batches(batch_size=batch_rows, row_groups=list(shard.row_groups))
    while True:
        try:
            rb = next(batches)
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{shard.path}: Parquet rows from {row} on cannot be read ({_arrow_reason(e)})",
                            "the file is truncated or corrupt: rewrite it from its source") from None
        n = rb.num_rows
        b = Batch(locs=[_loc(shard, r) for r in range(row, row + n)], columns=rb.to_pydict())
        row += n
        yield b


def loc_str(loc: int, files: list[str]) -> str:
    """``line N`` (one file) or ``NAME:N``."""
    fi, line = loc >> FILE_SHIFT, loc & ((1 << FILE_SHIFT) - 1)
    if len(files) <= 1:
        return f"line {line}"
    return f"{Path(files[fi]).name}:{line}"


def first_k(a: list[int], b: list[int], k: int) -> list[int]:
    """The k smallest of two sorted example lists (exact merge of 'first k examples')."""
    return sorted(set(a) | set(b))[:k]

