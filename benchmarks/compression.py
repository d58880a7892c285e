"""RTN vs AWQ vs GPTQ vs mixed precision (and INT8 / FP16) on the real all-MiniLM-L6-v2, side by side in one run.

    python benchmarks/compression.py [--threads 2] [--runs 30] [--out out/compression] [--only rtn,gptq]
        [--reuse] [--extra "mixed gate=out/all-minilm-l6-v2-jetson-orin.dse/models/int4.onnx"] [--slow]

``--reuse`` loads variants already written to ``--out`` instead of rebuilding them; ``--extra NAME=PATH`` adds
an ONNX file, measured where it is, ``--reuse`` or not (e.g. the int4 model of a bundle built with ``dsedge build
--accuracy-gate cosine:0.99``, or the cpu bundle's per-row INT8: ``--extra "cpu int8=out/all-minilm-l6-v2-cpu.dse/
models/int8.onnx"``; "int8 dynamic fused (per-tensor)" is the form the cpu bundle shipped before 2026-12-05);
``--slow`` adds AWQ+GPTQ and the mixed-precision runs (each re-runs its INT4 algorithm: minutes on 2 cores).

For each variant: size vs the fp32 ONNX, cosine mean/min and top-1 neighbour agreement of the mean-pooled
embeddings vs PyTorch eager fp32 on the 60 committed held-out sentences (the 60 calibration sentences are
separate), and ORT CPU median latency (``--threads``, median of ``--runs``) at batch 1 × seq 32 and batch 32 ×
seq 64 with the speed-up over PyTorch eager measured in the same process. Latency is timed side by side: after
3 warm-up calls per path, each of ``--runs`` rounds calls every variant's session and PyTorch eager once, rotating
the order, and the median per path is kept, so the ``×eager`` ratios are measured side by side (a host whose speed
drifts during the run moves both sides alike). The timing sessions don't spin-wait between runs
(``session.intra_op.allow_spinning`` 0, as dsedge's runtime opens its sessions), so an idle ORT pool doesn't take
the cores from the path timed next. Read the figures as ratios measured in one run, not absolutes.
``--only`` keeps fp32 and every variant whose name contains one of its comma-separated values (``--extra`` files
are always kept); a value that matches no variant is an error that lists the choices.
Sessions get the runtime's load-time rewrite (INT4 embedding DequantizeLinear → Gather becomes GatherBlockQuantized).
ORT runs 4-bit Q/DQ as MatMulNBits, whose default accuracy level 4 quantizes activations to INT8 on the fly;
``cos mean W4A16`` is the same model at accuracy level 1 (float activations, what TensorRT's W4A16 computes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


# the variants' names, known before anything is imported or built (--only is checked against them)
VARIANTS = ("fp32", "int4 rtn (int4.py, mse scale)", "int4 rtn (calibrated clip)", "int4 awq", "int4 gptq",
            "int8 dynamic fused (per-tensor)", "int8 dynamic (no fusion)", "int8 static W8A8 Q/DQ minmax",
            "int8 static W8A8 + SmoothQuant", "int8 static W8A8 + SQ, gate cosine:0.99", "fp16 + fp32 islands")
SLOW_VARIANTS = ("int4 awq+gptq", "mixed rtn, gate cosine:0.99", "mixed gptq, gate cosine:0.99")  # with --slow
WARMUP = 3  # untimed calls per path before the timed rounds


def session(path: Path, threads: int, accuracy_level: int | None = None, spin: bool = True):
    """ORT CPU session as dsedge's runtime makes it (INT4 embedding DQ → Gather rewritten to GatherBlockQuantized);
    ``spin=False``: intra-op threads don't spin-wait between runs (as the runtime's ``OrtBackend`` opens them)."""
    import onnx
    import onnxruntime as ort

    from dsedge.runtime.backends.ort_rewrites import gather_block_quantized

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if accuracy_level is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    model = onnx.load(str(path))
    src = model.SerializeToString() if gather_block_quantized(model) else str(path)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def embed(sess, feeds: dict[str, np.ndarray]) -> np.ndarray:
    names = [i.name for i in sess.get_inputs()]
    outs = [o.name for o in sess.get_outputs()]
    out = "sentence_embedding" if "sentence_embedding" in outs else outs[-1]
    parts = []
    for i in range(0, len(feeds["input_ids"]), 16):
        parts.append(sess.run([out], {k: v[i:i + 16] for k, v in feeds.items() if k in names})[0])
    return np.concatenate(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", default="out/compression")
    ap.add_argument("--only", help="comma-separated parts of variant names (fp32 is always kept)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--extra", action="append", default=[])
    ap.add_argument("--slow", action="store_true")
    args = ap.parse_args(argv)
    extras = []
    for spec in args.extra:
        name, eq, p = spec.partition("=")
        if not (eq and name.strip() and p):
            ap.error(f"--extra {spec!r}: expected NAME=PATH (an ONNX file)")
        if not Path(p).is_file():
            ap.error(f"--extra {spec!r}: no such file {p}")
        extras.append((name.strip(), p))
    only = None
    if args.only is not None:
        names = VARIANTS + (SLOW_VARIANTS if args.slow else ()) + tuple(n for n, _ in extras)
        only = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in only if not any(s in k for k in names)]
        if not only or unknown:
            slow = [s for s in unknown if any(s in k for k in SLOW_VARIANTS)]
            ap.error(f"--only {', '.join(map(repr, unknown)) if only else repr(args.only)} matches no variant"
                     + (f" ({', '.join(map(repr, slow))} only with --slow)" if slow else "")
                     + f"; choose from (any part of a name): {', '.join(map(repr, names))}")

    import onnx
    import torch

    from dsedge.runtime.latency import time_interleaved
    from dsedge.toolchain import reference
    from dsedge.toolchain.evaluate import sentence_embedding_metrics
    from dsedge.toolchain.export import export_onnx
    from dsedge.toolchain.quantize.fp16 import convert_float16
    from dsedge.toolchain.quantize.int4 import quantize_int4
    from dsedge.toolchain.quantize.int8 import quantize_int8_dynamic, quantize_int8_static
    from dsedge.toolchain.quantize.int8_gate import quantize_int8_gated
    from dsedge.toolchain.quantize.mixed import quantize_mixed
    from dsedge.toolchain.quantize.weight_only import (layer_activations, quantize_embedding_tables,
                                                       quantize_weight_only)
    from dsedge.toolchain.quantize.graph import select_layers
    from dsedge.toolchain.sources import resolve_source

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_source(None)
    fp32_path = out / "fp32.onnx"
    if not fp32_path.exists():
        export_onnx(source, fp32_path)
    fp32 = onnx.load(str(fp32_path))
    calib, held = source.calibration, source.validation
    fp32_size = fp32_path.stat().st_size
    bs = args.block_size

    with torch.inference_mode():
        ref = source.module(*(torch.from_numpy(held[k]) for k in ("input_ids", "attention_mask",
                                                                   "token_type_ids")))[1].numpy()
    acts = None

    def activations():
        nonlocal acts
        if acts is None:
            acts = layer_activations(fp32, calib, select_layers(fp32, None))
        return acts

    def int4(algorithm: str):
        def make():
            q, rep = quantize_weight_only(fp32, calib, algorithm=algorithm, block_size=bs, activations=activations())
            q, _ = quantize_embedding_tables(q, block_size=bs)
            return q, {"raised": 0}
        return make

    def mixed(algorithm: str, gate: str):
        def make():
            base = onnx.ModelProto()
            base.CopyFrom(fp32)
            base, _ = quantize_embedding_tables(base, block_size=bs)   # first: the gate sees the final model
            q, rep = quantize_mixed(base, calib, gate=gate, heldout=held, algorithm=algorithm, block_size=bs,
                                    output="sentence_embedding", reference=fp32,
                                    on_step=lambda m: print("   ", m, flush=True))
            return q, {"raised": len(rep["raised"]), "raised_layers": [(r["node"], r["to"]) for r in rep["raised"]]}
        return make

    def int8_gated(gate: str):
        def make():
            q, rep = quantize_int8_gated(fp32, calib, gate=gate, heldout=held, smooth_alpha=0.5,
                                         output="sentence_embedding")
            return q, {"kept_float": [k["node"] for k in rep["kept_float"]]}
        return make

    def lead_rtn():
        m = onnx.ModelProto()
        m.CopyFrom(fp32)
        return quantize_int4(m, block_size=bs)[0], {}

    variants = {
        "fp32": lambda: (fp32, {}),
        "int4 rtn (int4.py, mse scale)": lead_rtn,
        "int4 rtn (calibrated clip)": int4("rtn"),
        "int4 awq": int4("awq"),
        "int4 gptq": int4("gptq"),
        "int8 dynamic fused (per-tensor)": lambda: quantize_int8_dynamic(fp32, fuse="bert"),
        "int8 dynamic (no fusion)": lambda: quantize_int8_dynamic(fp32, fuse=None),
        "int8 static W8A8 Q/DQ minmax": lambda: quantize_int8_static(fp32, calib),
        "int8 static W8A8 + SmoothQuant": lambda: quantize_int8_static(fp32, calib, smooth_alpha=0.5),
        "int8 static W8A8 + SQ, gate cosine:0.99": int8_gated("cosine:0.99"),
        "fp16 + fp32 islands": lambda: convert_float16(fp32),
    }
    if args.slow:
        variants |= {"int4 awq+gptq": int4("awq+gptq"),
                     "mixed rtn, gate cosine:0.99": mixed("rtn", "cosine:0.99"),
                     "mixed gptq, gate cosine:0.99": mixed("gptq", "cosine:0.99")}
    assert tuple(variants) == VARIANTS + (SLOW_VARIANTS if args.slow else ()), "update VARIANTS / SLOW_VARIANTS"
    if only is not None:
        variants = {k: v for k, v in variants.items() if k == "fp32" or any(s in k for s in only)}
    given = {name: Path(p) for name, p in extras}  # measured where they are: never copied, never --reuse'd
    for name in given:
        variants[name] = None
    rows = []
    paths = {}
    for name, make in variants.items():
        path = out / (name.replace(" ", "_").replace(",", "").replace(":", "").replace("/", "") + ".onnx")
        t = time.perf_counter()
        if name == "fp32":
            path, extra = fp32_path, {}
        elif name in given:
            path, extra = given[name], {"file": str(given[name])}
        elif args.reuse and path.exists():
            extra = {"reused": True}
        else:
            model, extra = make()
            onnx.save(model, str(path))
        build_s = time.perf_counter() - t
        paths[name] = path
        acc = sentence_embedding_metrics(ref, embed(session(path, args.threads), held))
        exact = sentence_embedding_metrics(ref, embed(session(path, args.threads, accuracy_level=1), held))
        row = {"variant": name, "size_ratio": round(path.stat().st_size / fp32_size, 4), **acc,
               "cosine_mean_w4a16": exact["cosine_mean"], "build_s": round(build_s, 1), **extra}
        rows.append(row)
        print(f"{name:32s} size {row['size_ratio']:.3f}  cos {acc['cosine_mean']:.4f} / min {acc['cosine_min']:.4f}"
              f"  top1 {acc['top1_agreement']:.3f}  (W4A16 {exact['cosine_mean']:.4f})  "
              + (f"from {path}" if name in given else "reused" if extra.get("reused") else f"built in {build_s:.0f} s"),
              flush=True)

    # latency: for each shape, every variant and eager once per round (rotating the order), median per path
    tok = reference.load_tokenizer(reference.verified_model_dir())
    rng = np.random.default_rng(0)
    sessions = {name: session(p, args.threads, spin=False) for name, p in paths.items()}
    for batch, seq in ((1, 32), (32, 64)):
        ids = rng.integers(1000, 29000, (batch, seq)).astype(np.int64)
        ids[:, 0], ids[:, -1] = tok.cls_token_id, tok.sep_token_id
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        tt = [torch.from_numpy(v) for v in feeds.values()]
        fns = {name: (lambda s=s: s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()}))
               for name, s in sessions.items()}
        with torch.inference_mode():
            fns["eager"] = lambda: source.module(*tt)
            # interleaved: a host that speeds up or slows down during the run moves every path alike, so the
            # ×eager ratios are measured side by side (the sessions don't spin between runs: see session())
            samples = time_interleaved(fns, rounds=args.runs, warmup=WARMUP)
        eager = statistics.median(samples["eager"])
        for row in rows:
            ms = statistics.median(samples[row["variant"]])
            row[f"b{batch}_ms"] = round(ms, 2)
            row[f"b{batch}_speedup_vs_eager"] = round(eager / ms, 2)
            row["latency_timing"] = "interleaved"
        print(f"eager b{batch}x{seq}: {eager:.2f} ms", flush=True)
    from streaming import cpu_line  # benchmarks/streaming.py: CPU flags and load

    print(f"\nthreads {args.threads}, median of {args.runs} interleaved rounds (every variant and eager once per "
          f"round, rotating the order: ×eager is measured side by side); cosine vs PyTorch eager fp32 on "
          f"{len(ref)} held-out sentences; block size {bs}; size: file size / fp32 ONNX; "
          f"b1 = batch 1 × seq 32, b32 = batch 32 × seq 64, ×eager = PyTorch eager ms / variant ms")
    print(cpu_line())
    hdr = (f"{'variant':32s} | {'size':>5} | {'cos mean':>8} | {'cos min':>7} | {'top1':>5} | {'W4A16':>6} | "
           f"{'b1 ms':>6} {'×eager':>6} | {'b32 ms':>7} {'×eager':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['variant']:32s} | {r['size_ratio']:5.3f} | {r['cosine_mean']:8.4f} | {r['cosine_min']:7.4f} | "
              f"{r['top1_agreement']:5.3f} | {r['cosine_mean_w4a16']:6.4f} | {r['b1_ms']:6.2f} "
              f"{r['b1_speedup_vs_eager']:5.2f}× | {r['b32_ms']:7.1f} {r['b32_speedup_vs_eager']:5.2f}×")
    (out / "compression.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
