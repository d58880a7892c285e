"""Long-context decode: full K/V cache vs sliding window (StreamingLLM sinks + recent window), side by side in one run.

    python benchmarks/decode_window.py                         # Llama-architecture decoder built here (random weights)
    python benchmarks/decode_window.py --max-new 4096 --window 256 --sinks 4 --batch 4

The decoder (hidden 256, 4 layers, 8 query / 4 K/V heads of 32 dims, vocab 512, 8192 positions) is built with
transformers and exported by optimum with past key/values; both modes run the same ONNX Runtime session through
``DecodeLoop``, greedy, ``--batch`` identical streams at once (1 = the batch-1 reference). ``--rounds`` rounds
alternate the modes (window first): round 1 is cold (a fresh session, no warm-up) and gives the RSS the process
gained during each mode; the table (last round) gives, per generated length, tokens/s over the segment that ends
there (all streams) and the K/V bytes the loop held after that step (measured on its arrays). Timings on a shared
machine are noisy: compare the full/window ratios inside one run.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from dsedge.runtime.decode import DecodeLoop


def simd_flags() -> str:
    want = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f"{f}{'+' if f in flags else '-'}" for f in want)


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


# Known-harmless notices of building and exporting the random-weights decoder (third-party, as printed on
# transformers 4.57 / optimum 2.1): silenced one by one, by exact message, where they come from.
_QUIET_LOGS = {
    "transformers.configuration_utils": "`torch_dtype` is deprecated! Use `dtype` instead!",
    "transformers.models.llama.tokenization_llama_fast": "You are using the default legacy behaviour of the ",
    "optimum.exporters.onnx.base": "Weight deduplication check in the ONNX export requires accelerate.",
}


def _quiet_export() -> None:
    import torch

    for name, prefix in _QUIET_LOGS.items():
        logging.getLogger(name).addFilter(lambda r, p=prefix: not r.getMessage().startswith(p))
    # the tracer's notes on transformers' Python-side shape checks (constant for this export's shapes)
    warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean might cause the trace to be "
                            "incorrect", category=torch.jit.TracerWarning)
    # the Llama graph indexes with non-negative positions only
    warnings.filterwarnings("ignore", message="Exporting aten::index operator of advanced indexing in opset",
                            category=UserWarning)


def build(root: Path) -> tuple[Path, dict]:
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    _quiet_export()

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(root / "hf")
    main_export(str(root / "hf"), output=str(root / "onnx"), task="text-generation-with-past")
    return root / "onnx" / "model.onnx", cfg.to_dict()


class _Backend:
    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def run(self, feed: dict) -> dict:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feed)))


def run_mode(backend, config, window, sinks, max_new, batch, marks):
    loop = DecodeLoop(backend, max_batch=batch, model_config=config)
    prompt = np.arange(1, 17, dtype=np.int64)
    t0 = time.perf_counter()
    streams = [loop.submit(prompt, max_new, 1e9, 1e9, window=window, sink_tokens=sinks) for _ in range(batch)]
    rss0 = rss_mib()
    rows, last_t, last_n = [], t0, 0
    for n, _ in enumerate(streams[0], start=1):
        if n in marks:
            now = time.perf_counter()
            rows.append({"tokens": n, "tok_s": batch * (n - last_n) / (now - last_t)})
            last_t, last_n = now, n
    for s in streams:
        s.wait()
    loop.close()
    total = time.perf_counter() - t0
    held = loop.stats.cache_bytes  # after each step; step k produced token k + 1
    for r in rows:
        r["kv_mib"] = held[r["tokens"] - 2] / 2**20 if r["tokens"] >= 2 else 0.0
    return {"marks": rows, "tok_s": batch * max_new / total, "rss_gain_mib": rss_mib() - rss0,
            "ttft_ms": streams[0].ttft_ms}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new", type=int, default=2048)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for opt in ("max_new", "batch", "threads", "rounds"):
        if getattr(args, opt) < 1:
            ap.error(f"--{opt.replace('_', '-')} must be at least 1")
    marks = sorted({m for m in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if m <= args.max_new} | {args.max_new})
    with tempfile.TemporaryDirectory() as tmp:
        path, config = build(Path(tmp))
        backend = _Backend(path, args.threads)
        rounds: list[dict] = []
        for k in range(args.rounds):
            rounds.append({})
            for mode, window in (("window", args.window), ("full", None)):
                rounds[-1][mode] = r = run_mode(backend, config, window, args.sinks, args.max_new, args.batch,
                                                marks)
                print(f"round {k + 1} {mode}: {r['tok_s']:.0f} tok/s, K/V MiB at marks "
                      f"{[round(m['kv_mib'], 2) for m in r['marks']]}", flush=True)
        cold, out = rounds[0], rounds[-1]
    print(f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores); SIMD: {simd_flags()}; "
          f"ORT threads {args.threads}; batch {args.batch}; window {args.window} + {args.sinks} sinks; prompt 16")
    print("| generated | full tok/s | full K/V MiB | window tok/s | window K/V MiB | window/full speed |")
    print("|---:|---:|---:|---:|---:|---:|")
    for f, w in zip(out["full"]["marks"], out["window"]["marks"]):
        print(f"| {f['tokens']} | {f['tok_s']:.0f} | {f['kv_mib']:.2f} | {w['tok_s']:.0f} | {w['kv_mib']:.2f} | "
              f"{w['tok_s'] / f['tok_s']:.2f} |")
    for name, rnd in (("cold (round 1)", cold), (f"last (round {args.rounds})", out))[:1 if args.rounds == 1 else 2]:
        print(f"{name}: whole-run tok/s full {rnd['full']['tok_s']:.0f}, window {rnd['window']['tok_s']:.0f}; "
              f"TTFT ms full {rnd['full']['ttft_ms']:.1f}, window {rnd['window']['ttft_ms']:.1f}")
    print(f"RSS gained during round 1: window {cold['window']['rss_gain_mib']:.1f} MiB (ran first), "
          f"full {cold['full']['rss_gain_mib']:.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
