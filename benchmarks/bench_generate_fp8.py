#!/usr/bin/env python3
"""``generate()`` with an FP8 checkpoint against the same model in bf16, on one GPU (issue 19).

Per model (random weights N(0, 0.02), bf16, real layer sizes, depth cut): the bf16 model runs the one-liner
(``moecomp.optimize`` + ``generate``); then the same weights are quantized in place to what transformers builds for an
FP8 block checkpoint (``moecomp.testing.fp8_convert.to_fp8``: e4m3 + fp32 128x128 block scales; experts ``FP8Experts``,
other linears ``FP8Linear``, routers and ``lm_head`` 16-bit; no bf16 copy kept) and run the one-liner again.
transformers' own FP8 forward needs hub kernels, so it is no peer here.

Per batch size: decode ms/step of both, the FP8 / bf16 ratio (target <= 0.6 at B=1), each against its floor (the
bytes a decode step must read at the measured copy rate: every weight except the embedding table and the routed
experts, plus the experts the batch's routing touched, counted with hooks in a short bf16 transformers run, plus
the KV cache), prefill (TTFT) ms, the first call's warm-up seconds, and the tokens: the FP8 model's greedy tokens
against the bf16 one-liner's (``match``), and the greedy-token agreement under teacher forcing (the FP8 model fed
the bf16 model's sequence: the share of positions whose argmax equals the bf16 model's next token).

    PYTHONPATH=. python3 benchmarks/bench_generate_fp8.py --models qwen3,deepseek --batches 1,32
    python3 benchmarks/bench_generate_fp8.py --device cpu --tiny                      # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_generate as bg  # noqa: E402
from bench_moe import _save, environment, git_commit  # noqa: E402
from gen_profile import profile_steps  # noqa: E402

DEPTH = {"qwen3": 6, "deepseek": 2, "qwen2": 6, "mixtral": 4}


def log(msg: str) -> None:
    print(msg, flush=True)


def expert_counts(model, ids, new: int) -> tuple[float, float]:
    """(distinct experts per decode step, per prefill) from a short transformers generate with hooks."""
    counter = bg.RoutingCounter(model)
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    finally:
        counter.remove()
    return counter.mean_distinct(True), counter.mean_distinct(False)


def teacher_forced_agreement(model, seq: torch.Tensor, S: int) -> float:
    """Share of generated positions where ``model``'s argmax, fed ``seq`` [B, S + n], equals seq's next token."""
    with torch.no_grad():
        logits = model(input_ids=seq[:, :-1]).logits  # [B, S + n - 1, V]
    pred = logits[:, S - 1:].argmax(-1)
    return float((pred == seq[:, S:]).float().mean())


def one_liner(model, ids, new: int, cuda: bool) -> tuple[dict, torch.Tensor]:
    t = time.perf_counter()
    for _ in range(2):  # the first call compiles the step and captures it, the second compiles the prefill
        bg.run_one_liner(model, ids, bg.ONE_LINER_WARM, cuda)
    warm = time.perf_counter() - t
    out, pre, dec, last = bg.run_one_liner(model, ids, new, cuda)
    return dict(decode_ms=dec * 1e3, prefill_ms=pre * 1e3, warmup_s=warm, graphs=last.get("graphs"),
                eager_steps=last.get("eager_steps"), captures=last.get("captures")), out


def _profile(model, name: str, dtype: str, B: int, ids, args, cuda: bool, result: dict) -> None:
    """``--profile B``: the decode steps' kernels at batch B (``gen_profile.profile_steps``), logged and kept."""
    if not (cuda and args.profile == B):
        return
    try:
        p = profile_steps(model, "one_liner", ids, cuda)
    except Exception as e:  # a profile is a diagnostic: its failure is reported, the run goes on
        result["errors"].append(f"profile {name} {dtype} B={B}: {type(e).__name__}: {e}")
        return
    result.setdefault("profiles", []).append(dict(model=name, dtype=dtype, batch=B, **p))
    top = "; ".join(f"{n[:60]} {c:g}x {t:.1f} us" for t, c, n in p["top_kernels_us_per_step"][:12])
    log(f"[{name} B={B}] {dtype} profile: {p['kernels_per_step']:.0f} kernels, busy {p['gpu_busy_ms_per_step']:.3f} "
        f"of {p['wall_ms_per_step']:.3f} ms/step: {top}")


def _reference_agreement(model, rows: dict, fp8_out: dict, S: int, args, result: dict) -> None:
    """The FP8 model's own greedy tokens fed to its dequantized reference (``moecomp.unoptimize``, then every FP8
    module's plain PyTorch forward: ``formats/fp8.plain_fp8``, activations quantized the same way): the share of
    positions where the reference's argmax is the token moecomp chose. Near 1 means moecomp's kernels compute
    what the format says, so the agreement with bf16 measures the format; well below 1 would be a kernel error.
    The first batch size only (``--ref-batches`` to change)."""
    import moecomp
    from moecomp.formats.fp8 import plain_fp8

    todo = [B for B in args.ref_batches if B in fp8_out]
    if not todo:
        return
    moecomp.unoptimize(model)
    for B in todo:
        try:
            with plain_fp8(model):
                a = teacher_forced_agreement(model, fp8_out[B], S)
        except Exception as e:  # e.g. out of memory: reported, the run goes on
            result["errors"].append(f"reference agreement B={B}: {type(e).__name__}: {str(e)[:160]}")
            continue
        rows[B]["fp8"]["reference_agreement"] = a
        log(f"[B={B}] fp8 tokens under its dequantized reference: teacher-forced agreement {a:.3f}")


def run_model(name: str, args, device, cuda: bool, ceil: dict, result: dict, t_start: float) -> None:
    import moecomp
    from moecomp.testing.fp8_convert import to_fp8

    S, new = (16, 8) if args.tiny else (args.prompt, args.new)
    model = bg.build(name, device, torch.bfloat16 if cuda else torch.float32, args.depth.get(name, DEPTH[name]),
                     args.tiny, args.seed)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = {B: torch.randint(3, vocab, (B, S), generator=g).to(device) for B in args.batches}
    kv_tok = bg.kv_bytes_per_token(model, device)
    counts = {B: expert_counts(model, prompts[B], 4 if args.tiny else 8) for B in args.batches}
    pb16 = bg.param_bytes(model)
    active = sum(p.numel() for p in model.parameters()) - pb16["expert"] / 2 * (1 - model.config.num_experts_per_tok
                                                                                / _num_experts(model))
    rows = {B: dict(model=name, B=B, layers=model.config.num_hidden_layers) for B in args.batches}
    ref = {}
    result.setdefault("optimize", {})[name] = dict(bf16=bg.optimize_checked(model, f"[{name} bf16] "))
    for B in args.batches:
        if time.perf_counter() - t_start > args.budget_s:
            rows[B]["skipped"] = "budget"
            continue
        if not bg.generate_replaced(model):
            rows[B]["skipped"] = "bf16: moecomp.optimize did not replace generate (result['optimize'])"
            continue
        rec, out = one_liner(model, prompts[B], new, cuda)
        ref[B] = out
        _profile(model, name, "bf16", B, prompts[B], args, cuda, result)
        rows[B]["bf16"] = dict(rec, floor=bg.floors(pb16, kv_tok, *counts[B], B, S, new, ceil, active))
        log(f"[{name} B={B}] bf16 decode {rec['decode_ms']:.3f} ms/step (floor "
            f"{rows[B]['bf16']['floor']['decode_ms']:.3f}), prefill {rec['prefill_ms']:.1f} ms, warm-up "
            f"{rec['warmup_s']:.1f} s")
    moecomp.unoptimize(model)
    if "generate" in model.__dict__:
        model.generate.release()
    t = time.perf_counter()
    to_fp8(model)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    quant_s = time.perf_counter() - t
    pb8 = bg.param_bytes(model)
    result["optimize"][name]["fp8"] = bg.optimize_checked(model, f"[{name} fp8] ")
    fp8_out = {}
    result.setdefault("reports", {})[name] = str(model._moecomp_report)[:2000]
    for B in args.batches:
        if B not in ref or time.perf_counter() - t_start > args.budget_s:
            rows[B].setdefault("skipped", "budget")
            continue
        if not bg.generate_replaced(model):
            rows[B]["skipped"] = "fp8: moecomp.optimize did not replace generate (result['optimize'])"
            continue
        rec, out = one_liner(model, prompts[B], new, cuda)
        _profile(model, name, "fp8", B, prompts[B], args, cuda, result)
        fl = bg.floors(pb8, kv_tok, *counts[B], B, S, new, ceil, active)
        tf = teacher_forced_agreement(model, ref[B], S)
        cmp = bg.compare(out, ref[B], S)
        rows[B]["fp8"] = dict(rec, floor=fl, quantize_s=quant_s, teacher_forced_agreement=tf, match_bf16=cmp)
        fp8_out[B] = out
        r16 = rows[B]["bf16"]
        rows[B]["fp8_over_bf16"] = rec["decode_ms"] / r16["decode_ms"]
        rows[B]["fp8_over_floor"] = rec["decode_ms"] / fl["decode_ms"]
        log(f"[{name} B={B}] fp8 decode {rec['decode_ms']:.3f} ms/step (floor {fl['decode_ms']:.3f}, "
            f"{rows[B]['fp8_over_floor']:.2f}x), fp8 / bf16 {rows[B]['fp8_over_bf16']:.2f}x, prefill "
            f"{rec['prefill_ms']:.1f} ms, warm-up {rec['warmup_s']:.1f} s, teacher-forced agreement {tf:.3f}, "
            f"free-running match {cmp['match']:.3f}")
    _reference_agreement(model, rows, fp8_out, S, args, result)
    result["params"][name] = dict(bf16=pb16, fp8=pb8)
    result["rows"] += [rows[B] for B in args.batches]
    moecomp.unoptimize(model)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _num_experts(model) -> int:
    c = model.config
    return getattr(c, "num_experts", None) or getattr(c, "n_routed_experts", None) or c.num_local_experts


def table(result: dict) -> str:
    lines = ["| model | layers | B | bf16 ms/step | fp8 ms/step | fp8 / bf16 | fp8 floor | fp8 / floor | bf16 / its floor"
             " | TTFT bf16 / fp8 ms | warm-up fp8 s | teacher-forced agreement | free-running match |"
             " agreement with its dequantized reference |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "fp8" not in r:
            lines.append(f"| {r['model']} | {r['layers']} | {r['B']} | {r.get('skipped', 'not run')} |")
            continue
        a, b = r["bf16"], r["fp8"]
        ref_a = f"{b['reference_agreement']:.3f}" if "reference_agreement" in b else "-"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['B']} | {a['decode_ms']:.3f} | {b['decode_ms']:.3f} | "
            f"{r['fp8_over_bf16']:.2f}x | {b['floor']['decode_ms']:.3f} | {r['fp8_over_floor']:.2f}x | "
            f"{a['decode_ms'] / a['floor']['decode_ms']:.2f}x | {a['prefill_ms']:.1f} / {b['prefill_ms']:.1f} | "
            f"{b['warmup_s']:.1f} | {b['teacher_forced_agreement']:.3f} | {b['match_bf16']['match']:.3f} | "
            f"{ref_a} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3,deepseek")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", default="", help="name=depth overrides, e.g. qwen3=12")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="per-kernel split of the decode steps at batch B, bf16 and fp8, of every model (GPU)")
    ap.add_argument("--ref-batches", default="1", help="batch sizes whose fp8 tokens are checked against the "
                    "dequantized reference (comma-separated; empty: none)")
    args = ap.parse_args(argv)
    args.ref_batches = [int(b) for b in args.ref_batches.split(",") if b]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.depth = {k: int(v) for k, v in (x.split("=") for x in args.layers.split(",") if x)}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    t_start = time.perf_counter()
    ceil = bg.measure_ceilings(device)
    result = dict(env=environment(device), commit=git_commit(), date=datetime.date.today().isoformat(),
                  args={k: v for k, v in vars(args).items()}, ceilings=ceil, rows=[], params={}, errors=[])
    log(f"# fp8 generate: {result['env'].get('gpu')} torch {torch.__version__} commit {result['commit']}: copy "
        f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    for name in args.models.split(","):
        if time.perf_counter() - t_start > args.budget_s:
            result["errors"].append(f"{name}: skipped (budget)")
            continue
        try:
            run_model(name, args, device, cuda, ceil, result, t_start)
        except Exception as e:  # one model's failure is reported, the others still run
            result["errors"].append(f"{name}: {type(e).__name__}: {e}")
            log(traceback.format_exc())
    result["table"] = table(result)
    result["total_s"] = time.perf_counter() - t_start
    log(result["table"])
    for e in result["errors"]:
        log(f"error: {e}")
    if args.out_json:
        _save(result, args.out_json)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
