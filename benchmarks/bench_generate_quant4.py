#!/usr/bin/env python3
"""``generate()`` of gpt-oss-120b at full depth on one GPU, its experts in MXFP4 (issue 22).

The model is transformers' ``GptOssForCausalLM`` at gpt-oss-120b's sizes (36 layers, 128 experts, top-4, H = I =
2880; ``moecomp.testing.mxfp4_write.gpt_oss_config``), built by ``random_packed_model``: every expert block holds random
e2m1 codes and ue8m0 scales in the checkpoint's packed layout (a ``PackedExperts``, ~61 GB), everything else random
bf16 (N(0, 0.02)); no bf16 expert tensor exists at any time (240 GB would not fit). Then the one-liner:
``moecomp.optimize(model)`` + ``model.generate``.

Per batch size (B = 1, 8, 32): decode ms/step against its floor (the bytes a decode step must read at the measured
copy rate: every weight except the embedding table and the routed experts, plus the experts the batch's routing
touched at their packed size with scales and biases, counted with hooks on a short plain run, plus the KV cache),
prefill (TTFT) ms, the warm-up seconds of the first calls, and, at B = 1, transformers' own generate on the same model
(its experts running ``PackedExperts``' plain-PyTorch forward; transformers' own MXFP4 forward needs the hub's
kernels, so it is no peer here) with the greedy tokens compared.

    PYTHONPATH=. python3 benchmarks/bench_generate_quant4.py --batches 1,8,32 --out-json $OUT/gen-quant4.json
    python3 benchmarks/bench_generate_quant4.py --device cpu --tiny                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
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
from bench_generate_fp8 import _profile, one_liner, teacher_forced_agreement  # noqa: E402
from gen_profile import profile_table  # noqa: E402
from layer.env import environment, git_commit, save  # noqa: E402

TARGET_B1 = 1.6  # issue 22: B = 1 decode within 1.6x of the MXFP4 floor


def log(msg: str) -> None:
    print(msg, flush=True)


def packed_modules(model):
    from moecomp.formats.packed import PackedExperts

    return [m for m in model.modules() if isinstance(m, PackedExperts)]


def param_bytes(model) -> dict:
    """bench_generate.param_bytes with the experts as the packed modules hold them (codes, scales, biases)."""
    mods = packed_modules(model)
    emb = model.get_input_embeddings().weight
    expert = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
    per_expert = sum(p[0].numel() * p.element_size() for p in mods[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(total=total, expert=expert, embedding=emb.numel() * emb.element_size(), per_expert=per_expert,
                row=emb.shape[1] * emb.element_size(), moe_layers=len(mods))


class Counter(bg.RoutingCounter):
    """bench_generate's counter on the packed experts modules: the top-k ids are the first integer tensor among the
    call's arguments."""

    def __init__(self, model):
        self.calls = []
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in packed_modules(model)]

    def _hook(self, mod, args, kwargs):
        ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        ids = next((t for t in ts if not t.is_floating_point()), None)
        if ids is not None:
            self.calls.append((ts[0].reshape(-1, ts[0].shape[-1]).shape[0], int(ids.unique().numel())))


def build(args, device):
    from moecomp.testing.mxfp4_write import gpt_oss_config, random_packed_model

    cfg = gpt_oss_config("120b")
    if args.tiny:
        cfg = gpt_oss_config("tiny") if _has_size("tiny") else cfg
        if not _has_size("tiny"):
            for k, v in dict(hidden_size=64, intermediate_size=64, num_local_experts=8, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=512, num_hidden_layers=2).items():
                setattr(cfg, k, v)
            cfg.layer_types = cfg.layer_types[:2]
    if args.layers:
        cfg.num_hidden_layers = args.layers
        cfg.layer_types = cfg.layer_types[:args.layers]
    cfg.max_position_embeddings = max(4096, args.prompt + args.new + 16)
    t = time.perf_counter()
    model = random_packed_model(cfg, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                seed=args.seed).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model, time.perf_counter() - t


def _has_size(size: str) -> bool:
    from moecomp.testing.mxfp4_write import gpt_oss_config

    try:
        gpt_oss_config(size)
        return True
    except Exception:
        return False


def run(args) -> dict:
    import moecomp

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    ceil = bg.measure_ceilings(device)
    result = dict(benchmark="generate-quant4", env=environment(device), commit=git_commit(),
                  date=datetime.date.today().isoformat(), args=vars(args), ceilings=ceil, rows=[], errors=[],
                  target_b1_over_floor=TARGET_B1, method=__doc__.split("\n\n")[1].replace("\n", " "))
    model, build_s = build(args, device)
    pb = param_bytes(model)
    result.update(build_s=round(build_s, 1), params=pb, layers=model.config.num_hidden_layers,
                  peak_gib_after_build=round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if cuda else None)
    log(f"[gen-q4] built {model.config.num_hidden_layers} layers in {build_s:.1f} s: experts {pb['expert'] / 1e9:.1f} "
        f"GB packed, total {pb['total'] / 1e9:.1f} GB")
    S, new = (8, 4) if args.tiny else (args.prompt, args.new)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    prompts = {B: torch.randint(3, model.config.vocab_size, (B, S), generator=g).to(device) for B in args.batches}
    kv_tok = bg.kv_bytes_per_token(model, device)
    counts, hf = {}, {}
    for B in args.batches:  # distinct experts per step from a short plain run (B = 1: timed as transformers' peer)
        c = Counter(model)
        try:
            out, pre, dec = bg.run_hf_loop(model, prompts[B], args.hf_new if B == 1 else 2, cuda)
        finally:
            c.remove()
        counts[B] = (c.mean_distinct(True), c.mean_distinct(False))
        if B == 1:
            hf = dict(decode_ms=dec * 1e3, prefill_ms=pre * 1e3, tokens=out)
            log(f"[gen-q4] transformers (PackedExperts' plain forward) B=1: decode {dec * 1e3:.1f} ms/step")
    active, outs = None, {}
    if cuda:  # optimize's own peak: what recognition and binding add to the loaded model (issue 39's bound)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    t_opt = time.perf_counter()
    result["optimize"] = bg.optimize_checked(model, "[gen-q4] ")
    result["optimize"]["seconds"] = round(time.perf_counter() - t_opt, 1)
    if cuda:
        extra = (torch.cuda.max_memory_allocated(device) - held) / 2**30
        result["optimize"]["peak_extra_gib"] = round(extra, 3)
        log(f"[gen-q4] optimize: {result['optimize']['seconds']} s, peak extra GPU memory {extra:.3f} GiB over the "
            f"{held / 2**30:.1f} GiB loaded")
    report = model._moecomp_report
    result["report"] = str(report)[:3000]
    log(f"[gen-q4] optimize: {str(report).splitlines()[0]}")
    if not result["optimize"]["generate_replaced"]:  # nothing to time: say so, keep what was measured, stop cleanly
        result["errors"].append(f"moecomp.optimize left {len(result['optimize']['unrewritten'])} block(s) "
                                f"unrewritten and did not replace generate: no one-liner rows (result['optimize'] "
                                f"has each block's reason)")
        result["table"] = ""
        return result
    for B in args.batches:
        try:
            rec, out = one_liner(model, prompts[B], new, cuda)
        except Exception as e:
            result["errors"].append(f"B={B}: {type(e).__name__}: {str(e)[:300]}")
            log(traceback.format_exc())
            continue
        last = model.generate.last  # what ran: the decode / prefill layers compiled or not, which attention
        rec.update(layers=last.get("layers"), prefill_layers=last.get("prefill_layers"),
                   attention=last.get("attention"))
        outs[B] = out
        _profile(model, "gpt-oss-120b", "mxfp4", B, prompts[B], args, cuda, result)
        active = sum(p.numel() for p in model.parameters())  # (prefill FLOPs: a loose bound, weights as stored)
        fl = bg.floors(pb, kv_tok, *counts[B], B, S, new, ceil, active)
        row = dict(B=B, **rec, floor=fl, over_floor=rec["decode_ms"] / fl["decode_ms"])
        if B == 1 and hf:
            n = min(hf["tokens"].shape[1], out.shape[1])
            row["transformers"] = dict(decode_ms=hf["decode_ms"], prefill_ms=hf["prefill_ms"])
            row["speedup_vs_transformers"] = hf["decode_ms"] / rec["decode_ms"]
            row["greedy_match_transformers"] = bg.compare(out[:, :n], hf["tokens"][:, :n], S)
        result["rows"].append(row)
        log(f"[gen-q4] B={B}: decode {rec['decode_ms']:.3f} ms/step, floor {fl['decode_ms']:.3f} "
            f"({row['over_floor']:.2f}x), prefill {rec['prefill_ms']:.1f} ms, warm-up {rec['warmup_s']:.1f} s")
    _agreement(model, outs, hf.get("tokens"), S, result)
    result["table"] = table(result)
    log(result["table"])
    return result


def _agreement(model, outs: dict, hf_tokens, S: int, result: dict) -> None:
    """The first batch's moecomp tokens fed to the same model without moecomp (``moecomp.unoptimize``: transformers'
    forward, the experts on ``PackedExperts``' plain PyTorch dequantization): the share of positions where its argmax
    is moecomp's token (teacher forcing); and, as the baseline, transformers' own greedy tokens (its generate loop,
    KV cache) fed to the same forward. Random weights can make a model's argmax noise: if transformers disagrees
    with itself as much, the agreement says nothing about moecomp (``diag_agree``: compare the logits instead)."""
    import moecomp

    if not outs:
        return
    B = min(outs)
    moecomp.unoptimize(model)
    row = next(r for r in result["rows"] if r["B"] == B)
    for key, seq in (("teacher_forced_agreement_transformers", outs[B]),
                     ("transformers_self_agreement", hf_tokens if B == 1 else None)):
        if seq is None:
            continue
        try:
            row[key] = teacher_forced_agreement(model, seq, S)
        except Exception as e:  # e.g. out of memory: reported, the run goes on
            result["errors"].append(f"{key} B={B}: {type(e).__name__}: {str(e)[:160]}")
            continue
        log(f"[gen-q4] B={B}: {key} {row[key]:.3f}")


def table(result: dict) -> str:
    lines = ["| B | decode ms/step | floor ms/step | x floor | distinct experts / layer | TTFT ms | warm-up s |"
             " transformers ms/step | speed-up | greedy match | teacher-forced agreement | transformers' own |"
             " decode layers |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        t = r.get("transformers")
        lines.append(f"| {r['B']} | {r['decode_ms']:.3f} | {r['floor']['decode_ms']:.3f} | {r['over_floor']:.2f}x | "
                     f"{r['floor']['distinct_experts_decode']:.1f} | {r['prefill_ms']:.1f} | {r['warmup_s']:.1f} | "
                     + (f"{t['decode_ms']:.1f} | {r['speedup_vs_transformers']:.1f}x | "
                        f"{r['greedy_match_transformers']['match']:.3f} |" if t else "- | - | - |")
                     + (f" {r['teacher_forced_agreement_transformers']:.3f} |"
                        if "teacher_forced_agreement_transformers" in r else " - |")
                     + (f" {r['transformers_self_agreement']:.3f} |" if "transformers_self_agreement" in r else " - |")
                     + f" {r.get('layers')} |")
    return "\n".join(lines + profile_table(result.get("profiles", [])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", type=int, default=0, help="depth override (default: the model's 36)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--hf-new", type=int, default=8, help="new tokens of transformers' own B = 1 run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="profile the decode steps at this batch size (CUDA)")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    result = run(args)
    if args.out_json:
        result.pop("rows_tokens", None)
        save(json.loads(json.dumps(result, default=str)), args.out_json)
    for e in result["errors"]:
        log(f"error: {e}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
