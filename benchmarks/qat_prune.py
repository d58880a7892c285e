"""QAT and FFN channel pruning with fine-tune on the real all-MiniLM-L6-v2, side by side in one run.

    python benchmarks/qat_prune.py [--qat-steps 200,500] [--prune 0.3] [--prune-steps 500] [--threads 2]
        [--runs 20] [--out out/qat_prune]

Rows (each vs PyTorch eager fp32 on the 60 committed held-out sentences; training uses only the 60 calibration
sentences, batch 8, the same settings as ``dsedge build --qat-steps`` / ``--prune``):
- ``int4 rtn``: the fp32 export, every MatMul weight INT4 RTN (symmetric, block 32, absmax scales: the quantizer the
  QAT trains for), embedding tables fp32 so the rows isolate the Linear weights;
- ``int4 rtn + qat N``: the same after N fake-quant fine-tune steps (one run: the student is evaluated at each N in
  ``--qat-steps`` and trained on; AdamW state restarts at each checkpoint);
- ``fp32 pruned``: FFN hidden channels pruned to ``--prune`` before / after ``--prune-steps`` distillation steps,
  (sentence embedding + token states, token-replaced sentences: ``student.text_finetune_settings``),
  with the fp32 ONNX size and ORT CPU latency (``--threads``, median of ``--runs``) at b1×s32 and b32×s64 against
  the unpruned fp32 ONNX.
Training times are wall-clock on this machine; latencies are measured one model after another: read them as ratios
from one run (a shared 2-core box gives noisy absolutes).
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qat-steps", default="200,500")
    ap.add_argument("--prune", type=float, default=0.3)
    ap.add_argument("--prune-steps", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--out", default="out/qat_prune")
    args = ap.parse_args(argv)
    try:
        steps = [int(x) for x in args.qat_steps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--qat-steps {args.qat_steps!r}: expected comma-separated step counts, e.g. 200,500")
    if any(n < 1 for n in steps) or args.prune_steps < 1 or args.runs < 1:
        ap.error("--qat-steps, --prune-steps and --runs take positive counts")
    if not 0 < args.prune < 1:
        ap.error("--prune is the share of FFN channels to remove, between 0 and 1")

    import onnx
    import onnxruntime as ort
    import torch

    from dsedge.runtime.bench import synthetic_inputs
    from dsedge.runtime.latency import time_calls
    from dsedge.toolchain.student import FINETUNE_LR, QAT_LR, TRAIN_BATCH, _trainable, text_finetune_settings
    from dsedge.toolchain.evaluate import sentence_embedding_metrics
    from dsedge.toolchain.export import export_onnx
    from dsedge.toolchain.finetune import distill_finetune, output_forward, torch_batches
    from dsedge.toolchain.prune_torch import prune_ffn_channels
    from dsedge.toolchain.qat import unwrap_linears, wrap_linears
    from dsedge.toolchain.quantize.weight_only import quantize_weight_only
    from dsedge.toolchain.sources import resolve_source

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_source(None)
    teacher = source.module.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    fwd = output_forward(1)                                      # the sentence embedding
    batches = torch_batches(source.calibration, TRAIN_BATCH)
    held = source.validation
    with torch.no_grad():
        ref = np.concatenate([fwd(teacher, b).numpy() for b in torch_batches(held, 16)])

    def sess(path: Path) -> "ort.InferenceSession":
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = args.threads, 1, 3
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def accuracy(path: Path) -> dict:
        s = sess(path)
        emb = np.concatenate([s.run(["sentence_embedding"], {k: v[i:i + 16] for k, v in held.items()})[0]
                              for i in range(0, len(held["input_ids"]), 16)])
        return sentence_embedding_metrics(ref, emb)

    def export(module, name: str) -> Path:
        src = copy.copy(source)
        src.module = module
        return export_onnx(src, out / f"{name}.onnx").path

    def int4(fp32: Path, name: str) -> Path:
        q, _ = quantize_weight_only(onnx.load(str(fp32)), None, algorithm="rtn", block_size=args.block_size,
                                    clip_search=False)
        path = out / f"{name}.onnx"
        onnx.save(q, str(path))
        return path

    rows = []

    def row(name: str, path: Path, **extra) -> None:
        r = {"variant": name, **accuracy(path), "size_bytes": path.stat().st_size, **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    fp32 = export(teacher, "fp32")
    row("fp32 onnx", fp32)
    row("int4 rtn (absmax, block %d)" % args.block_size, int4(fp32, "int4-rtn"), train_s=0.0)

    # channel pruning with fine-tune
    pruned = copy.deepcopy(teacher)
    for p in pruned.parameters():
        p.requires_grad_(True)
    t0 = time.perf_counter()
    prep = prune_ffn_channels(pruned, args.prune, batches, forward=fwd)
    prune_s = time.perf_counter() - t0
    p0 = export(pruned, "pruned-fp32-before")
    row(f"fp32 pruned channels:{args.prune} before fine-tune", p0, prune_s=round(prune_s, 1),
        params=prep["params_after"], hidden=[b["hidden_after"] for b in prep["blocks"]])
    train_fwd, feature_weight, augment = text_finetune_settings(source, fwd)     # what dsedge build uses
    rep = distill_finetune(pruned, teacher, batches, forward=train_fwd, steps=args.prune_steps, lr=FINETUNE_LR,
                           params=_trainable(pruned), feature_weight=feature_weight, augment=augment)
    p1 = export(pruned, "pruned-fp32-after")
    row(f"fp32 pruned channels:{args.prune} after {args.prune_steps} steps", p1, train_s=rep["time_s"],
        train_loss_after=round(rep["loss_after"], 6))

    # QAT: one student, evaluated at each checkpoint
    student = copy.deepcopy(teacher)
    for p in student.parameters():
        p.requires_grad_(True)
    wrap_linears(student, args.block_size)
    params = [m.linear.weight for m in student.modules() if type(m).__name__ == "FakeQuantLinear"]
    done, spent = 0, 0.0
    for target in sorted(int(s) for s in args.qat_steps.split(",") if s.strip()):
        rep = distill_finetune(student, teacher, batches, forward=fwd, steps=target - done, lr=QAT_LR, params=params)
        done, spent = target, spent + rep["time_s"]
        snap = copy.deepcopy(student)
        unwrap_linears(snap)
        row(f"int4 rtn + qat {target}", int4(export(snap, f"qat{target}-fp32"), f"qat{target}-int4"),
            train_s=round(spent, 1), train_loss_after=round(rep["loss_after"], 6))

    # latency, one model after another
    from dsedge.runtime.bundle import IOSpec

    specs = [IOSpec(n, "int64", ("batch", "sequence")) for n in ("input_ids", "attention_mask", "token_type_ids")]
    lat = {}
    for name, path in (("fp32", fp32), ("pruned", p1)):
        s = sess(path)
        lat[name] = {}
        for b, seq in ((1, 32), (32, 64)):
            feeds = synthetic_inputs(specs, batch=b, seq_len=seq, vocab_size=30522)
            lat[name][f"b{b}xs{seq}"] = time_calls(lambda: s.run(None, feeds), iterations=args.runs, warmup=3)["p50"]
    summary = {"latency_p50_ms": lat, "size_vs_fp32": round(p1.stat().st_size / fp32.stat().st_size, 4),
               "speedup": {k: round(lat["fp32"][k] / lat["pruned"][k], 3) for k in lat["fp32"]},
               "params": {"before": prep["params_before"], "after": prep["params_after"]}}
    print(json.dumps(summary), flush=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "pruned": summary}, indent=1) + "\n")
    print(f"\n{'variant':52s} {'cos mean':>8s} {'cos min':>8s} {'top-1':>6s} {'MB':>6s} {'train s':>8s}")
    for r in rows:
        print(f"{r['variant']:52s} {r['cosine_mean']:8.4f} {r['cosine_min']:8.4f} {r['top1_agreement']:6.3f} "
              f"{r['size_bytes'] / 1e6:6.1f} {r.get('train_s', ''):>8}")
    from streaming import cpu_line  # benchmarks/streaming.py: CPU flags and load

    print(f"\nORT CPU p50 ms (threads {args.threads}, median of {args.runs}), fp32 vs pruned {args.prune} fp32, "
          f"one after another:")
    for k in lat["fp32"]:
        print(f"  {k}: fp32 {lat['fp32'][k]:.2f} ms, pruned {lat['pruned'][k]:.2f} ms, "
              f"speed-up {summary['speedup'][k]:.2f}x; size {summary['size_vs_fp32']:.3f}x fp32")
    print(cpu_line())


if __name__ == "__main__":
    main()
