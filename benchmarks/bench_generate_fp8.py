#!/usr/bin/env python3
"""``generate()`` with an FP8 checkpoint against the same model in bf16, on one GPU (issue 19), up to full depth on
an 80 GB GPU (issue 39).

Per model (random weights N(0, 0.02), real layer sizes, depth ``--layers``, ``full`` = the real model's), built one
of two ways (``--build``):

* ``bf16``: ``bench_generate.build`` in bf16; the bf16 rows run, then the same weights are quantized in place to what
  transformers builds for an FP8 block checkpoint (``testing.fp8_convert.to_fp8``: e4m3 + fp32 128x128 block scales; experts
  ``FP8Experts``, other linears ``FP8Linear``, routers and ``lm_head`` 16-bit; no bf16 copy kept) and the FP8 rows run;
* ``fp8``: the same FP8 model built directly in FP8 on the device (``gen_build_fp8.build``: drawn and quantized a
  chunk at a time, no bf16 expert tensor ever; peak memory the FP8 model + one chunk): FP8 rows only, compared with
  bf16 rows of an earlier run of the same model and depth (``--bf16-json``) or with moecomp bf16 at a depth that fits
  (``--bf16-layers``);
* ``auto`` (default): ``bf16`` where the bf16 model fits the device's free memory with 8 GiB to spare, else ``fp8``
  (bf16 Mixtral-8x7B at 32 layers is 93 GB).

Per batch size and weight format: transformers' generate first (``--peers hf``; the peer, and the run whose hooks
count the experts each step touches): on bf16 its default path; on FP8 transformers' own forward needs hub kernels
(n/a), so its loop runs with every FP8 module on moecomp's plain-PyTorch dequantized forward (``hf_plain_fp8``).
Then the one-liner (``moecomp.optimize`` + ``generate``): decode ms/step and TTFT (wall time of a 1-token generate),
each against its floor (``bench_generate.floors`` at the copy rate measured in this run: every weight except the
embedding table and the routed experts, plus the experts the batch's routing touched, plus the KV cache), warm-up
seconds, the greedy tokens against the peer's, and for FP8: the FP8 / bf16 ratio, the teacher-forced agreement with
the bf16 model's tokens (``--build bf16``), and the FP8 tokens under the model's dequantized reference
(``--ref-batches``). The result JSON is rewritten after every row (a killed run keeps what it measured).

    PYTHONPATH=. python3 benchmarks/bench_generate_fp8.py --models qwen3,deepseek --batches 1,32
    PYTHONPATH=. python3 benchmarks/bench_generate_fp8.py --models mixtral --layers mixtral=full --build fp8 \\
        --bf16-layers mixtral=16
    python3 benchmarks/bench_generate_fp8.py --device cpu --tiny [--build fp8]               # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
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
import gen_build_fp8 as gb  # noqa: E402
from bench_moe import _save, environment, git_commit  # noqa: E402
from gen_profile import profile_steps, profile_table  # noqa: E402

DEPTH = {"qwen3": 6, "deepseek": 2, "qwen2": 6, "mixtral": 4}
FULL_DEPTH = {"qwen3": 48, "deepseek": 61, "qwen2": 24, "mixtral": 32}  # the real models' layers
HUB_NA = "transformers' own FP8 forward: n/a (needs hub kernels)"
EXTRA_MIN_S = 60  # --bf16-layers rows start only with this much of --budget-s left (build, optimize, a warm-up)


def log(msg: str) -> None:
    print(msg, flush=True)


def plain(model, fmt: str):
    """transformers' forward on ``model``: FP8 modules on their plain-PyTorch dequantized forward (transformers' own
    needs hub kernels); a bf16 model as it is."""
    from moecomp.formats.fp8 import plain_fp8

    return plain_fp8(model) if fmt == "fp8" else contextlib.nullcontext()


def expert_counts(model, ids, new: int) -> tuple[float, float]:
    """(distinct experts per decode step, per prefill) from a short transformers generate with hooks."""
    counter = bg.RoutingCounter(model)
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    finally:
        counter.remove()
    return counter.mean_distinct(True), counter.mean_distinct(False)


def teacher_forced(model, seq: torch.Tensor, S: int) -> dict:
    """``model`` fed ``seq`` [B, S + n]: the share of generated positions where its argmax equals seq's next token,
    and how flat its logits are there, which tells a kernel error from rounding on near-ties: the chosen token's
    logit below the top one (``chosen_gap``: 0 where they agree), the top two's gap and the logits' spread over the
    vocabulary (medians over positions), all over the largest |logit|, and whether every logit is finite."""
    with torch.no_grad():
        logits = model(input_ids=seq[:, :-1]).logits[:, S - 1:].float()  # [B, n, V]
    nxt = seq[:, S:]
    top2 = logits.topk(2, -1).values  # [B, n, 2]
    scale = float(logits.abs().amax()) or 1.0
    chosen = top2[..., 0] - logits.gather(-1, nxt[..., None])[..., 0]  # [B, n]
    return dict(agreement=float((logits.argmax(-1) == nxt).float().mean()), finite=bool(torch.isfinite(logits).all()),
                chosen_gap_max=float(chosen.max()) / scale, chosen_gap_median=float(chosen.median()) / scale,
                top2_gap_median=float((top2[..., 0] - top2[..., 1]).median()) / scale,
                spread_median=float(logits.std(-1).median()) / scale, max_abs_logit=scale)


def teacher_forced_agreement(model, seq: torch.Tensor, S: int) -> float:
    """Share of generated positions where ``model``'s argmax, fed ``seq`` [B, S + n], equals seq's next token."""
    return teacher_forced(model, seq, S)["agreement"]


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
    per = p.get("kernels_per_layer")
    log(f"[{name} B={B}] {dtype} profile: {p['kernels_per_step']:.0f} kernels"
        + (f" ({per:.2f} a decoder layer, {p['kernels_per_layer_repeated']:.2f} repeated)" if per else "")
        + f", busy {p['gpu_busy_ms_per_step']:.3f} "
        f"of {p['wall_ms_per_step']:.3f} ms/step: {top}")


def _reference_agreement(model, rows: dict, fp8_out: dict, S: int, args, result: dict) -> None:
    """The FP8 model's own greedy tokens fed to its dequantized reference (``moecomp.unoptimize``, then every FP8
    module's plain PyTorch forward: ``plain_fp8``, activations quantized the same way): the share of positions where
    the reference's argmax is the token moecomp chose; and the same under the weight-only reference (activations in
    16 bits: what the kernel table runs at small T, w8a16). On a model whose random routing amplifies small
    differences (Mixtral: 8 experts, top-2; ``benchmarks/diag_fp8_blocks.py``) the two references themselves
    disagree, so low agreement with one of them alone is not a kernel error; the block-level diagnostic is. The
    first batch size only (``--ref-batches`` to change)."""
    import moecomp

    todo = [B for B in args.ref_batches if B in fp8_out]
    if not todo:
        return
    from moecomp.formats.fp8 import plain_fp8

    moecomp.unoptimize(model)
    for B in todo:
        try:
            with plain(model, "fp8"):
                tf = teacher_forced(model, fp8_out[B], S)
            with plain_fp8(model, activations="none"):  # the kernel table runs small T weight-only (w8a16)
                tf16 = teacher_forced(model, fp8_out[B], S)
        except Exception as e:  # e.g. out of memory: reported, the run goes on
            result["errors"].append(f"reference agreement B={B}: {type(e).__name__}: {str(e)[:160]}")
            continue
        rows[B]["fp8"]["reference_agreement"] = a = tf["agreement"]
        rows[B]["fp8"]["reference_logits"] = tf
        rows[B]["fp8"]["reference_agreement_weight_only"] = tf16["agreement"]
        rows[B]["fp8"]["reference_logits_weight_only"] = tf16
        log(f"[B={B}] fp8 tokens under the weight-only (w8a16) reference: teacher-forced agreement "
            f"{tf16['agreement']:.3f}, chosen below the top by {tf16['chosen_gap_median']:.2e} (median)")
        log(f"[B={B}] fp8 tokens under its dequantized reference: teacher-forced agreement {a:.3f}; over the largest "
            f"|logit| {tf['max_abs_logit']:.3g}: chosen below the top by {tf['chosen_gap_median']:.2e} (median) / "
            f"{tf['chosen_gap_max']:.2e} (max), top-2 gap {tf['top2_gap_median']:.2e}, spread "
            f"{tf['spread_median']:.2e}, finite {tf['finite']}")


# ------------------------------------------------------------------------------------------------ one format's rows
def _active_params(model) -> float:
    """Parameters a token runs through (bench_generate.floors' prefill FLOPs): all but the routed experts it skips."""
    ex = bg.experts_modules(model)
    total = sum(p.numel() for p in model.parameters())
    exn = sum(p.numel() for m in ex for p in m.parameters())
    per = sum(p[0].numel() for p in ex[0].parameters()) if ex else 0
    return total - exn + len(ex) * model.config.num_experts_per_tok * per


def transformers_pass(model, ids, fmt: str, args, cuda: bool) -> tuple[tuple, dict | None, torch.Tensor | None]:
    """((distinct experts per decode step, per prefill), the peer's row or None, its tokens): transformers' generate
    on ``model`` as loaded (FP8: its modules on the plain dequantized forward), its routing counted with hooks in a
    short call (which also warms it up), then timed (``--peers hf``, ``--peer-new`` tokens)."""
    with plain(model, fmt):
        counts = expert_counts(model, ids, 4 if args.tiny else 8)
        if "hf" not in args.peers or ids.shape[0] not in args.peer_batches:
            return counts, None, None
        out, pre, dec = bg.run_hf_loop(model, ids, args.peer_new, cuda)
    peer = dict(path="hf_plain_fp8" if fmt == "fp8" else "hf", decode_ms=dec * 1e3, ttft_ms=pre * 1e3,
                new=args.peer_new, what=("transformers' generate, FP8 modules on moecomp's plain dequantized forward ("
                                         + HUB_NA + ")") if fmt == "fp8" else "transformers' generate (default)")
    return counts, peer, out


def _budget_left(ctx: dict, args) -> bool:
    return time.perf_counter() - ctx["t_start"] <= args.budget_s


def format_rows(model, name: str, fmt: str, args, ctx: dict, rows: dict, ref: dict | None = None,
                batches: list | None = None) -> dict:
    """``fmt``'s rows of ``model`` into ``rows[B][fmt]`` (transformers' pass of every batch, then ``optimize``, then
    the one-liner per batch); returns the one-liner's tokens by batch. ``ref``: the bf16 model's tokens by batch
    (``--build bf16``: teacher-forced agreement and match)."""
    cuda, S, new, result = ctx["cuda"], ctx["S"], ctx["new"], ctx["result"]
    tag = f"{name} {model.config.num_hidden_layers}L {fmt}"
    with plain(model, fmt):
        kv_tok = bg.kv_bytes_per_token(model, ctx["device"])
    pb, active = bg.param_bytes(model), _active_params(model)
    result["params"].setdefault(name, {})[f"{fmt}@{model.config.num_hidden_layers}"] = pb
    pre = {}
    for B in batches or args.batches:
        if not _budget_left(ctx, args):
            rows[B][fmt] = dict(skipped="budget")
            continue
        try:
            counts, peer, pout = transformers_pass(model, ctx["prompts"][B], fmt, args, cuda)
        except Exception as e:  # (e.g. out of memory: this batch's row says so, the others run)
            _row_error(rows[B], fmt, f"transformers' pass: {type(e).__name__}: {str(e)[:300]}", result, tag, B)
            continue
        pre[B] = (counts, peer, pout)
        if peer:
            log(f"[{tag} B={B}] {peer['path']}: decode {peer['decode_ms']:.3f} ms/step, TTFT {peer['ttft_ms']:.1f} ms")
    opt = bg.optimize_checked(model, f"[{tag}] ")
    result.setdefault("optimize", {}).setdefault(name, {})[f"{fmt}@{model.config.num_hidden_layers}"] = opt
    outs = {}
    for B in pre:
        if not _budget_left(ctx, args):
            rows[B][fmt] = dict(skipped="budget")
            continue
        if not opt["generate_replaced"]:
            rows[B][fmt] = dict(skipped=f"{fmt}: moecomp.optimize did not replace generate (result['optimize'])")
            continue
        try:
            outs[B] = _one_liner_row(model, tag, fmt, B, args, ctx, rows[B], pre[B], (pb, kv_tok, active), ref)
        except Exception as e:
            _row_error(rows[B], fmt, f"one-liner: {type(e).__name__}: {str(e)[:300]}", result, tag, B)
        ctx["save"]()
    return outs


def _row_error(row: dict, fmt: str, msg: str, result: dict, tag: str, B: int) -> None:
    row[fmt] = dict(skipped=f"error: {msg}")
    result["errors"].append(f"{tag} B={B}: {msg}")
    log(f"[{tag} B={B}] ERROR {msg}")
    traceback.print_exc()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _one_liner_row(model, tag, fmt, B, args, ctx, row: dict, pre: tuple, sizes: tuple, ref) -> torch.Tensor:
    cuda, S, new = ctx["cuda"], ctx["S"], ctx["new"]
    (counts, peer, pout), (pb, kv_tok, active) = pre, sizes
    ids = ctx["prompts"][B]
    rec, out = one_liner(model, ids, new, cuda)
    rec.update(bg.one_liner_ttft(model, ids, cuda))
    _profile(model, tag.split()[0], fmt, B, ids, args, cuda, ctx["result"])
    fl = bg.floors(pb, kv_tok, *counts, B, S, new, ctx["ceil"], active)
    rec.update(floor=fl, over_floor=rec["decode_ms"] / fl["decode_ms"], ttft_over_floor=rec["ttft_ms"] / fl["prefill_ms"])
    if peer is not None:
        n = min(pout.shape[1], out.shape[1])
        rec.update(peer=peer, speedup_vs_peer=peer["decode_ms"] / rec["decode_ms"],
                   match_peer=bg.compare(out[:, :n], pout[:, :n], S))
    if ref is not None and B in ref:  # (--build bf16: the same weights in bf16)
        rec.update(teacher_forced_agreement=teacher_forced_agreement(model, ref[B], S), match_bf16=bg.compare(out, ref[B], S))
    row[fmt] = rec
    _ratios(row)
    log(f"[{tag} B={B}] one-liner decode {rec['decode_ms']:.3f} ms/step (floor {fl['decode_ms']:.3f}, "
        f"{rec['over_floor']:.2f}x), TTFT {rec['ttft_ms']:.1f} ms (floor {fl['prefill_ms']:.1f}, "
        f"{rec['ttft_over_floor']:.2f}x), warm-up {rec['warmup_s']:.1f} s"
        + (f", {peer['path']} {rec['speedup_vs_peer']:.1f}x slower, tokens = its {rec['match_peer']['match']:.2f}"
           if peer else "")
        + (f", teacher-forced agreement with bf16 {rec['teacher_forced_agreement']:.3f}" if "match_bf16" in rec else ""))
    return out


def _ratios(row: dict) -> None:
    a, b = row.get("bf16", {}), row.get("fp8", {})
    if "decode_ms" in a and "decode_ms" in b:
        row["fp8_over_bf16"] = b["decode_ms"] / a["decode_ms"]
        row["fp8_over_floor"] = b["over_floor"]


# ------------------------------------------------------------------------------------------------ one model
def _free(model, cuda: bool) -> None:
    import moecomp

    moecomp.unoptimize(model)
    if "generate" in model.__dict__:
        model.generate.release()
    torch._dynamo.reset()  # (compiled layers and their guards)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        log(f"[{model.config.num_hidden_layers}L] released: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated "
            f"(the model's own weights until the caller drops it)")


def _new_rows(name: str, layers: int, build: str, args, result: dict, batches: list | None = None) -> dict:
    rows = {B: dict(model=name, B=B, layers=layers, build=build) for B in batches or args.batches}
    result["rows"] += list(rows.values())
    return rows


def choose_build(name: str, layers: int, args, device, result: dict) -> str:
    if args.build != "auto":
        return args.build
    ok, why = gb.bf16_fits(name, layers, args.tiny, device)
    result.setdefault("build_choice", {})[name] = why
    log(f"[{name} {layers}L] build {'bf16' if ok else 'fp8'} (auto: {why})")
    return "bf16" if ok else "fp8"


def run_model(name: str, args, device, cuda: bool, ceil: dict, result: dict, t_start: float) -> None:
    layers = args.depth.get(name, DEPTH[name])
    S, new = (16, 8) if args.tiny else (args.prompt, args.new)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    vocab = bg.MODELS[name][3]["vocab_size"] if not args.tiny else bg.TINY["vocab_size"]
    prompts = {B: torch.randint(3, vocab, (B, S), generator=g).to(device) for B in args.batches}
    ctx = dict(device=device, cuda=cuda, ceil=ceil, result=result, t_start=t_start, S=S, new=new, prompts=prompts,
               save=lambda: _save(result, args.out_json) if args.out_json else None)
    build = choose_build(name, layers, args, device, result)
    if build == "fp8":
        _run_direct(name, layers, dtype, args, ctx)
    else:
        _run_converted(name, layers, dtype, args, ctx)
    extra = args.bf16_layers.get(name)
    if extra and time.perf_counter() - t_start + EXTRA_MIN_S <= args.budget_s:
        model = bg.build(name, device, dtype, extra, args.tiny, args.seed)
        rows = _new_rows(name, extra, "bf16", args, result, args.bf16_batches)
        format_rows(model, name, "bf16", args, ctx, rows, batches=args.bf16_batches)
        _free(model, cuda)
        del model
        gc.collect()
    elif extra:
        result["errors"].append(f"{name}: bf16 at {extra} layers skipped (budget: under {EXTRA_MIN_S} s left)")


def _run_converted(name: str, layers: int, dtype, args, ctx: dict) -> None:
    """``--build bf16``: the bf16 rows, then the same weights quantized in place and the FP8 rows."""
    from moecomp.testing.fp8_convert import to_fp8

    result, cuda = ctx["result"], ctx["cuda"]
    t = time.perf_counter()
    model = bg.build(name, ctx["device"], dtype, layers, args.tiny, args.seed)
    result["builds"][name] = dict(build="bf16", build_s=round(time.perf_counter() - t, 2))
    rows = _new_rows(name, layers, "bf16", args, result)
    ref = format_rows(model, name, "bf16", args, ctx, rows) if "bf16" in args.formats else None
    if "fp8" in args.formats and _budget_left(ctx, args):
        _free(model, cuda)
        t = time.perf_counter()
        to_fp8(model)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        result["builds"][name]["quantize_s"] = round(time.perf_counter() - t, 2)
        fp8_out = format_rows(model, name, "fp8", args, ctx, rows, ref=ref)
        _reference_agreement(model, rows, fp8_out, ctx["S"], args, result)
    _free(model, cuda)
    del model
    gc.collect()


def _run_direct(name: str, layers: int, dtype, args, ctx: dict) -> None:
    """``--build fp8``: the FP8 model built in FP8 (no bf16 copy), its rows, bf16 rows from ``--bf16-json``."""
    result, cuda = ctx["result"], ctx["cuda"]
    model, info = gb.build(name, ctx["device"], dtype, layers, args.tiny, args.seed, chunk_bytes=args.chunk_mb << 20)
    result["builds"][name] = info
    log(f"[{name} {layers}L fp8] built in FP8 in {info['build_s']:.1f} s: {info['model_bytes'] / 1e9:.2f} GB"
        + (f", build peak {info['peak_extra_bytes'] / 2**30:.2f} GiB beyond the model" if "peak_extra_bytes" in info
           else ""))
    rows = _new_rows(name, layers, "fp8", args, result)
    if "bf16" in args.formats and not args.bf16_json and name not in args.bf16_layers:
        for r in rows.values():
            r["bf16"] = dict(skipped="not built: --build fp8 (bf16 rows: --bf16-json or --bf16-layers)")
    fp8_out = format_rows(model, name, "fp8", args, ctx, rows)
    _attach_bf16(rows, name, layers, args.bf16_json, result)
    _reference_agreement(model, rows, fp8_out, ctx["S"], args, result)
    ctx["save"]()
    _free(model, cuda)
    del model
    gc.collect()


def _attach_bf16(rows: dict, name: str, layers: int, path: str | None, result: dict) -> None:
    """bf16 rows of an earlier run (``--bf16-json``: the same model and depth, another process) beside the FP8 rows."""
    if not path:
        return
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        result["errors"].append(f"--bf16-json {path}: {type(e).__name__}: {e}")
        return
    for r in old.get("rows", []):
        if r.get("model") == name and r.get("layers") == layers and r.get("B") in rows and "decode_ms" in r.get(
                "bf16", {}):
            rows[r["B"]]["bf16"] = dict(r["bf16"], source=os.path.basename(path))
            _ratios(rows[r["B"]])


# ------------------------------------------------------------------------------------------------ table, command line
def _cell(c: dict, fmt: str, r: dict) -> str:
    fl, p = c["floor"], c.get("peer")
    peer = (f"{p['path']} | {p['decode_ms']:.2f} | {p['ttft_ms']:.1f} | {c['speedup_vs_peer']:.1f}x"
            if p else f"{HUB_NA if fmt == 'fp8' else '-'} | - | - | -")
    agree = [f"{k} {c[k]:.3f}" for k in ("reference_agreement", "teacher_forced_agreement") if k in c]
    if "match_peer" in c:
        agree.append(f"tokens = peer {c['match_peer']['match']:.2f}")
    ratio = f"{r['fp8_over_bf16']:.2f}x" if fmt == "fp8" and "fp8_over_bf16" in r else "-"
    return (f"{c['decode_ms']:.3f} | {fl['decode_ms']:.3f} | {c['over_floor']:.2f}x | {c['ttft_ms']:.1f} | "
            f"{fl['prefill_ms']:.1f} | {c['ttft_over_floor']:.2f}x | {peer} | {c['warmup_s']:.1f} | {ratio} | "
            f"{'; '.join(agree) or '-'} |")


def table(result: dict, shown: tuple = ()) -> str:
    """The rows of ``result``; a bf16 cell copied from a file in ``shown`` (``--bf16-json``) is left out (that
    file's own table has it)."""
    lines = ["| model | layers | B | weights | decode ms/step | floor | x floor | TTFT ms | TTFT floor | x floor |"
             " transformers' path | its ms/step | its TTFT ms | one-liner speed-up | warm-up s | fp8 / bf16 |"
             " agreement |", "|" + "---|" * 17]
    for r in result["rows"]:
        for fmt in ("bf16", "fp8"):
            c = r.get(fmt)
            if c is None or c.get("source") in shown:
                continue
            how = (f"from {c['source']}" if "source" in c else "quantized from bf16" if fmt == "fp8" and r.get(
                "build") == "bf16" else "built in FP8" if fmt == "fp8" else "")
            head = f"| {r['model']} | {r['layers']} | {r['B']} | {fmt}{f' ({how})' if how else ''} | "
            lines.append(head + (_cell(c, fmt, r) if "decode_ms" in c else f"{c.get('skipped', 'not run')} |"))
    return "\n".join(lines + profile_table(result.get("profiles", [])))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3,deepseek")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", default="", help="name=depth overrides, e.g. qwen3=12 or mixtral=full")
    ap.add_argument("--build", choices=("auto", "bf16", "fp8"), default="auto",
                    help="bf16: build bf16, quantize in place for the FP8 rows; fp8: build in FP8 directly (FP8 rows "
                    "only); auto: bf16 where it fits the device with 8 GiB to spare")
    ap.add_argument("--formats", default="bf16,fp8", help="the rows to run (bf16 rows need --build bf16)")
    ap.add_argument("--peers", default="hf", help="'hf': transformers' generate timed before optimize; '' none")
    ap.add_argument("--peer-new", type=int, default=16, help="new tokens of the timed transformers call")
    ap.add_argument("--peer-batches", default="", help="batch sizes of the timed transformers call (default: all; "
                    "the experts are counted at every batch size)")
    ap.add_argument("--bf16-json", default=None, help="a bf16 run's JSON (same model and depth): its rows beside "
                    "the FP8 rows of --build fp8")
    ap.add_argument("--bf16-layers", default="", help="name=depth: with --build fp8, moecomp bf16 at this depth too "
                    "(after the FP8 rows, budget allowing), e.g. mixtral=16")
    ap.add_argument("--bf16-batches", default="", help="batch sizes of the --bf16-layers rows (default: all)")
    ap.add_argument("--chunk-mb", type=int, default=gb.CHUNK_BYTES >> 20, help="--build fp8: fp32 MB drawn at a time")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0, help="no new batch (or model) starts after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="per-kernel split of the decode steps at batch B, bf16 and fp8, of every model (GPU)")
    ap.add_argument("--ref-batches", default="1", help="batch sizes whose fp8 tokens are checked against the "
                    "dequantized reference (comma-separated; empty: none)")
    args = ap.parse_args(argv)
    args.ref_batches = [int(b) for b in args.ref_batches.split(",") if b]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.peer_batches = [int(b) for b in args.peer_batches.split(",") if b] or args.batches
    args.bf16_batches = [int(b) for b in args.bf16_batches.split(",") if b] or args.batches
    args.formats = [f for f in args.formats.split(",") if f]
    args.peers = [p for p in args.peers.split(",") if p]
    bad = [f for f in args.formats if f not in ("bf16", "fp8")] + [p for p in args.peers if p != "hf"]
    if bad:
        ap.error(f"--formats takes bf16 / fp8 and --peers hf, got {bad}")
    args.depth = _depths(args.layers, ap)
    args.bf16_layers = _depths(args.bf16_layers, ap)
    return args


def _depths(spec: str, ap) -> dict:
    out = {}
    for item in (x for x in spec.split(",") if x):
        name, _, v = item.partition("=")
        if name not in FULL_DEPTH or not (v == "full" or v.isdigit()):
            ap.error(f"expected name=depth or name=full with name in {sorted(FULL_DEPTH)}, got {item!r}")
        out[name] = FULL_DEPTH[name] if v == "full" else int(v)
    return out


def print_tables(paths: list[str]) -> int:
    """``--table JSON...``: the table of each result file, from its rows (a run killed mid-way has no "table")."""
    shown, head = tuple(os.path.basename(p) for p in paths), True
    for path in paths:
        try:
            with open(path) as f:
                res = json.load(f)
        except (OSError, ValueError) as e:
            log(f"{path}: {type(e).__name__}: {e}")
            continue
        lines = table(res, shown).splitlines()
        log("\n".join(lines if head else lines[2:]))
        head = False
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:
        return print_tables(argv[1:])
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    t_start = time.perf_counter()
    ceil = bg.measure_ceilings(device)
    result = dict(env=environment(device), commit=git_commit(), date=datetime.date.today().isoformat(),
                  args={k: v for k, v in vars(args).items()}, ceilings=ceil, rows=[], params={}, builds={}, errors=[],
                  method=__doc__.split("\n\n")[1].replace("\n", " "))
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
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
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
