"""Bench load shapes beyond one caller: closed-loop concurrent clients, and real inputs read from a directory."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .bundle import IOSpec
from .errors import BenchError, InputError
from .golden import count_rows, take_rows
from .npz import read_npz


def read_inputs_dir(path: str | os.PathLike, specs: Sequence[IOSpec]) -> dict[str, np.ndarray]:
    """Real inputs from ``*.npz`` files in ``path`` (arrays named like the bundle's inputs, batch axis 0), joined
    along axis 0 in file-name order. Arrays whose symbolic axes (a name in the input's shape, e.g. ``sequence``)
    differ between files are right-padded with zeros to the longest (token ids 0 / mask 0, the BERT convention); a
    static axis must hold the input's size in every file. A rank-0 input (shape ``[]``, e.g. ``temperature``) is one
    value, no rows: it must hold the same value in every file and is returned once, 0-d, to go with every window
    (``input_windows``). Loaded with ``allow_pickle=False``.

    Raises:
        InputError: no such directory, no ``.npz`` files, a file lacking one of the inputs, an array whose rank is
            neither the input's (rows) nor one less (a single row), an array whose static axis (after the batch
            axis) differs from the input's, a file whose batched arrays do not hold the same number (>= 1) of rows,
            or a rank-0 input whose value differs between files.
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"--inputs {str(root)!r} is not a directory", "pass a folder of .npz files named like the inputs")
    files = sorted(root.glob("*.npz"))
    if not files:
        raise InputError(f"--inputs {str(root)!r} holds no .npz files", "save inputs with numpy.savez(name=array, …)")
    parts: dict[str, list[np.ndarray]] = {s.name: [] for s in specs}
    for f in files:
        try:
            z = read_npz(f)
        except (ValueError, OSError) as e:
            raise InputError(f"--inputs file {str(f)!r} is not readable: {e}",
                             "save inputs with numpy.savez(name=array, …)") from None
        rows = {}
        for s in specs:
            if s.name not in z:
                raise InputError(f"{f.name} has no array {s.name!r} (it has {', '.join(z) or 'none'})",
                                 "name the arrays like the bundle's inputs (dsedge inspect BUNDLE)")
            a = z[s.name]
            if not s.shape:  # rank-0: one value, no rows; the same in every file (it goes with every window)
                if a.ndim:
                    raise InputError(f"{f.name}: array {s.name!r} has shape {list(a.shape)}, the input is rank-0 "
                                     "(one value, no batch axis)", f"save {s.name} as one value: numpy.savez(…, "
                                     f"{s.name}=numpy.array(value))")
                if parts[s.name] and not np.array_equal(a, parts[s.name][0]):
                    raise InputError(f"rank-0 input {s.name!r} holds {parts[s.name][0].item()!r} in {files[0].name} "
                                     f"but {a.item()!r} in {f.name}: one value goes with every batch",
                                     f"save one value of {s.name!r} in every file (e.g. the value you deploy with)")
                parts[s.name].append(a)
                continue
            if a.ndim not in (len(s.shape), len(s.shape) - 1):
                raise InputError(f"{f.name}: array {s.name!r} has shape {list(a.shape)}, the input is "
                                 f"{list(s.shape)}", "save rows along axis 0, or one row without the batch axis")
            a = a if a.ndim == len(s.shape) else a[None]
            for i in range(1, a.ndim):
                if _static(s.shape[i]) and a.shape[i] != s.shape[i]:
                    raise InputError(f"{f.name}: array {s.name!r} has shape {list(a.shape)}: axis {i} holds "
                                     f"{a.shape[i]}, and the input {s.name!r} {list(s.shape)} has a static "
                                     f"{s.shape[i]} there", f"save {s.name} with {s.shape[i]} on axis {i} in {f.name} (only symbolic "
                                     "axes, e.g. token axes, may differ: shorter ones are zero-padded; dsedge inspect "
                                     "BUNDLE shows the shapes)")
            rows[s.name] = a.shape[0]
            parts[s.name].append(a)
        if len(set(rows.values())) > 1 or not min(rows.values(), default=1):
            raise InputError(f"{f.name}: the arrays hold " + ", ".join(f"{k} {n}" for k, n in rows.items()) + " rows",
                             "every input needs the same number of rows (at least 1) in each file")
    out = {}
    for s in specs:  # static axes match the spec in every file (checked above): only symbolic ones are padded
        arrays = parts[s.name]
        if not s.shape:
            out[s.name] = arrays[0]
            continue
        ndim = arrays[0].ndim
        top = [max(a.shape[i] for a in arrays) for i in range(ndim)]
        padded = [np.pad(a, [(0, 0)] + [(0, 0 if _static(s.shape[i]) else top[i] - a.shape[i])
                                        for i in range(1, ndim)]) for a in arrays]
        out[s.name] = np.concatenate(padded)
    return out


def _static(dim: int | str) -> bool:
    """A fixed size in an input's shape (an int >= 1), not a symbolic name (``"sequence"``) or an unknown size."""
    return isinstance(dim, int) and dim > 0


def input_windows(arrays: Mapping[str, np.ndarray], batch: int) -> list[dict[str, np.ndarray]]:
    """Consecutive windows of ``batch`` rows over ``arrays`` (wrapping around when rows run out), at most 64. Rows
    are those of the batched arrays (``golden.count_rows``); a rank-0 array (e.g. ``temperature``) goes whole with
    every window, and arrays that are all rank-0 are one window as they are."""
    n = count_rows(arrays)
    if not n:
        return [dict(arrays)]
    count = max(1, min(64, n // batch)) if n >= batch else 1
    out = []
    for w in range(count):
        idx = (np.arange(batch) + w * batch) % n
        out.append(take_rows(arrays, idx))  # integer indexing copies: each window is C-contiguous
    return out


def check_iterations(iterations: int | None, concurrency: int) -> None:
    """BenchError when ``iterations`` (the total over all clients) is fewer than ``concurrency`` clients: each
    client sends at least one request. The CLI checks it before loading the bundle."""
    if iterations is not None and iterations < concurrency:
        raise BenchError(f"--iterations {iterations} is fewer than --concurrency {concurrency}: iterations are the "
                         "total over all clients, and each client sends at least one request",
                         f"pass --iterations {concurrency} or more, or --concurrency {iterations}")


def measure_concurrent(run: Callable[[Mapping[str, np.ndarray]], Any], feeds: Sequence[Mapping[str, np.ndarray]],
                       settings: Any, concurrency: int) -> tuple[np.ndarray, float]:
    """``concurrency`` closed-loop clients, each calling ``run`` on the next of ``feeds`` as soon as its previous
    call returned, after ``settings.warmup`` untimed calls per client.

    ``settings.iterations`` is the total over all clients (at least one call each, so at least ``concurrency``);
    else each client runs until ``settings.duration_s`` (default 3 s) and at least ``settings.min_iterations`` calls
    in all. Returns (per-call latencies in ms, wall s).

    Raises:
        BenchError: ``settings.iterations`` below ``concurrency`` (some client would have nothing to send).
        What ``run`` raises (the first error of any client).
    """
    total = settings.iterations
    check_iterations(total, concurrency)
    per_client = None if total is None else [total // concurrency + (i < total % concurrency) for i in range(concurrency)]
    duration_ns = int((settings.duration_s or 3.0) * 1e9)
    samples: list[list[int]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    clock = time.perf_counter_ns
    state: dict[str, int] = {}
    start_gate = threading.Barrier(concurrency + 1, action=lambda: state.__setitem__("start", clock()))

    def client(i: int) -> None:
        try:
            for k in range(settings.warmup):
                run(feeds[(i + k) % len(feeds)])
            start_gate.wait()
            mine, k = samples[i], i
            while True:
                t0 = clock()
                run(feeds[k % len(feeds)])
                t1 = clock()
                mine.append(t1 - t0)
                k += concurrency
                if per_client is not None:
                    if len(mine) >= per_client[i]:
                        return
                elif t1 - state["start"] >= duration_ns and sum(map(len, samples)) >= settings.min_iterations:
                    return
        except threading.BrokenBarrierError:
            return
        except BaseException as e:  # handed to the caller
            errors.append(e)
            start_gate.abort()

    threads = [threading.Thread(target=client, args=(i,), name=f"dsedge-bench-client-{i}", daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    try:
        start_gate.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    wall = (clock() - state.get("start", clock())) / 1e9
    if errors:
        raise errors[0]
    return np.asarray([x for s in samples for x in s], dtype=np.float64) / 1e6, wall
