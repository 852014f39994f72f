#!/usr/bin/env python3
"""The 4-bit (w4a16) experts against the same layer in bf16 and in FP8 (issue 22), at gpt-oss-20b / gpt-oss-120b
layer sizes (E = 32 / 128, k = 4, H = I = 2880; mxfp4, gate / up interleaved, swiglu_oai, biases) and optionally an
int4 layer (--int4: Qwen3-30B-A3B sizes, group 128, zero points). CUDA only; prints a markdown table.

Each path is ``torch.ops.moecomp.moe_forward`` captured in a CUDA graph (``testing.capture_moe_forward``: warmed up,
then captured) and its replay timed with ``triton.testing.do_bench`` (median). Paths per (model, T):

    w4          the 4-bit op as the heuristic runs it (the decode path up to ``tuning.QUANT4_DECODE_MAX_T``; on it the
                dot-free GEMV kernels up to ``tuning.QUANT4_GEMV_MAX_T``)
    w4 gemv     (T <= 16) MOECOMP_W4_DECODE=gemv, MOECOMP_DECODE_MAX_T=16: the decode path on the GEMV kernels (kernels/quant4_gemv.py)
    w4 dot      (T <= 16) MOECOMP_W4_DECODE=dot, MOECOMP_DECODE_MAX_T=16: the decode path on the DIRECT dot kernels; with "w4 gemv" this places
                QUANT4_GEMV_MAX_T (the largest T where gemv wins)
    w4 aligned  (T <= 16) the same with MOECOMP_DECODE_MAX_T=0: the aligned path, to place the decode threshold
    w4 split    MOECOMP_W4_FORM=split: A's even / odd columns times the low / high nibbles, two dots a step
    w4 interleave  MOECOMP_W4_FORM=interleave: the nibbles interleaved into one tile, one dot a step (the default
                before 2026-12-03; the default is now dot_scaled for mxfp4 on CUDA, interleave for int4)
    w4 scaled   MOECOMP_W4_FORM=dot_scaled (mxfp4): tl.dot_scaled (Hopper has no fp4 MMA: Triton upcasts)
    w4 asm      MOECOMP_W4_FORM=asm (mxfp4): the inline-PTX decode, two dots of K = 16 a step
    bf16        the same spec, unquantized bf16 weights
    fp8         QuantSpec() (128x128 blocks, dynamic; the heuristic's w8a8 + prequant) on the same weights; FP8
                experts take gate / up concatenated and no expert biases, so this spec differs in that (same work)

--gemv-variants adds, at T <= 16, the GEMV path with one option changed (``GEMV_VARIANTS``: no prefetch, a
reduction every K step, the inline-PTX conversions, BLOCK_N halved / doubled), printed under each row.
--quick: gpt-oss-120b only, T in 1, 2, 4, 8, 16, paths w4 gemv / w4 dot / bf16 (what places QUANT4_GEMV_MAX_T).

floor: the weight bytes the call must read (the experts its routing touches: codes, scales, zeros, biases) over
--hbm-tbs (4.8 TB/s, H200); "x floor" = time / floor. err: the 4-bit op against ``moecomp.oracle.reference`` (fp32, same
packed tensors), rel. Frobenius.

    PYTHONPATH=. python3 benchmarks/diag_quant4.py --tokens 1,4,16,64,128,1024 --out-json /tmp/q4.json
    PYTHONPATH=. python3 benchmarks/diag_quant4.py --quick --gemv-variants --out-json /tmp/q4-gemv.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moecomp.core import quant as q8  # noqa: E402
from moecomp.oracle import reference  # noqa: E402
from moecomp.ops import tuning  # noqa: E402
from moecomp.core.args import MOE_ARGS  # noqa: E402
from moecomp.core.spec import MoESpec, QuantSpec  # noqa: E402
from moecomp.testing import capture_moe_forward, quantize_moe_args, random_moe_args  # noqa: E402


def gpt_oss(E: int) -> MoESpec:
    return MoESpec(num_experts=E, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                   activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                   has_router_bias=True, score_order="topk_then_score", quant=QuantSpec.mxfp4())


MODELS = {
    "gpt-oss-20b": lambda: gpt_oss(32),
    "gpt-oss-120b": lambda: gpt_oss(128),
    "qwen3-int4": lambda: MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                                  quant=QuantSpec.int4(128, zero_point=True)),
}


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pack(spec: MoESpec, t: dict) -> tuple[dict, dict]:
    """w13 / w2 quantized to the spec's 4-bit format, a few experts at a time -> (tensors, scale / zero kwargs)."""
    t, extra = dict(t), {}
    for name in ("w13", "w2"):
        parts = [q8.quantize_4bit(t[name][e:e + 4], spec.quant) for e in range(0, spec.num_experts, 4)]
        t[name] = torch.cat([p[0] for p in parts])
        extra[f"{name}_scale"] = torch.cat([p[1] for p in parts])
        if parts[0][2] is not None:
            extra[f"{name}_zero"] = torch.cat([p[2] for p in parts])
    torch.cuda.empty_cache()
    return t, extra


def expert_bytes(t: dict, extra: dict) -> int:
    """Bytes of one expert's weights (codes, scales, zeros, biases) in these tensors."""
    names = [n for n in ("w13", "w2", "b13", "b2") if t.get(n) is not None] + list(extra)
    src = {**t, **extra}
    return sum(src[n][0].numel() * src[n].element_size() for n in names)


def touched(spec: MoESpec, x: torch.Tensor, t: dict) -> int:
    """Distinct experts the routing of x picks (the router's top-k; the score order does not change the set)."""
    logits = x.float() @ t["router_w"].float().T
    if t.get("router_b") is not None:
        logits = logits + t["router_b"].float()
    return int(logits.topk(spec.top_k, dim=-1).indices.unique().numel())


def time_op(x, t: dict, spec: MoESpec, extra: dict) -> float:
    """us of one CUDA-graph replay of the op (median of do_bench)."""
    import triton.testing as tt

    args = tuple(t[n] for n in MOE_ARGS)
    graph, _ = capture_moe_forward(x.clone(), args, spec, extra=extra)
    us = tt.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3
    del graph
    return us


# GEMV options timed with --gemv-variants (MOECOMP_W4_GEMV tile overrides, MOECOMP_W4_ASM): name -> environment
GEMV_VARIANTS = {
    "no prefetch": {"MOECOMP_W4_GEMV": '{"gemv1": {"PREFETCH": 0}, "gemv2": {"PREFETCH": 0}}'},
    "reduce every step": {"MOECOMP_W4_GEMV": '{"gemv1": {"REDUCE_END": 0}, "gemv2": {"REDUCE_END": 0}}'},
    "inline ptx": {"MOECOMP_W4_ASM": "1"},
    "BLOCK_N / 2": "half",
    "BLOCK_N x 2": "double",
}


def _gemv_env(variant, spec: MoESpec, T: int) -> dict:
    """The environment of one GEMV variant; "half" / "double": both launches' heuristic BLOCK_N (for this T on this
    device, ``triton_quant4_gemv.tiles``) halved / doubled, BLOCK_K kept."""
    if isinstance(variant, dict):
        return variant
    from moecomp.ops import triton_quant4_gemv as g

    dev = torch.device("cuda")
    H, I, P = spec.hidden_size, spec.intermediate_size, T * spec.top_k
    c1, c2 = g.tiles("gemv1", 2 if spec.gated else 1, P, I, H, dev), g.tiles("gemv2", 1, T, H, I, dev)
    f = (lambda bn: max(4, bn // 2)) if variant == "half" else (lambda bn: bn * 2)  # noqa: E731
    tiles = {"gemv1": {"BLOCK_N": f(c1["BLOCK_N"]), "BLOCK_K": c1["BLOCK_K"]},
             "gemv2": {"BLOCK_N": f(c2["BLOCK_N"]), "BLOCK_K": c2["BLOCK_K"]}}
    return {"MOECOMP_W4_GEMV": json.dumps(tiles)}


def run_model(name: str, tokens: list[int], hbm: float, rows: list, check: bool, quick: bool = False,
              variants: bool = False) -> None:
    spec = MODELS[name]()
    T_max = max(tokens)
    raw = random_moe_args(spec, T_max, torch.bfloat16, "cuda", std=0.02, seed=0)
    t16 = dict(zip(MOE_ARGS, raw[1:]))
    t4, extra4 = pack(spec, t16)
    spec16 = spec.replace(quant=None)
    spec8 = spec.replace(quant=QuantSpec(), gate_up="concat", has_expert_bias=False)
    t8, extra8 = {}, {}
    if not quick:  # FP8 weights: another copy of the layer
        t8raw = dict(t16, b13=None, b2=None)
        args8, extra8 = quantize_moe_args(spec8, (raw[0],) + tuple(t8raw[n] for n in MOE_ARGS))
        t8 = dict(zip(MOE_ARGS, args8[1:]))
        del args8
    torch.cuda.empty_cache()
    per4, per16 = expert_bytes(t4, extra4), expert_bytes(t16, {})
    per8 = expert_bytes(t8, extra8) if t8 else 0
    for T in tokens:
        x = raw[0][:T].contiguous()
        n_exp = touched(spec, x, t16)
        floor_us = n_exp * per4 / (hbm * 1e12) * 1e6
        rec = dict(model=name, T=T, experts_touched=n_exp, floor4_us=floor_us,
                   floor16_us=n_exp * per16 / (hbm * 1e12) * 1e6, floor8_us=n_exp * per8 / (hbm * 1e12) * 1e6)
        small = T <= 16
        dec = {"MOECOMP_DECODE_MAX_T": 16}  # the decode path forced on up to 16 tokens, in either form
        gemv = [("w4 gemv", t4, spec, extra4, {"MOECOMP_W4_DECODE": "gemv", **dec}),
                ("w4 dot", t4, spec, extra4, {"MOECOMP_W4_DECODE": "dot", **dec})] if small else []
        if quick:
            paths = gemv + [("bf16", t16, spec16, {}, {})]
        else:
            paths = [("w4", t4, spec, extra4, {}), ("w4 split", t4, spec, extra4, {"MOECOMP_W4_FORM": "split"}),
                     ("w4 interleave", t4, spec, extra4, {"MOECOMP_W4_FORM": "interleave"})]
            if spec.quant.weight == "mxfp4":
                paths.append(("w4 scaled", t4, spec, extra4, {"MOECOMP_W4_FORM": "dot_scaled"}))
                paths.append(("w4 asm", t4, spec, extra4, {"MOECOMP_W4_FORM": "asm"}))
            if small:
                paths += gemv + [("w4 aligned", t4, spec, extra4, {"MOECOMP_DECODE_MAX_T": 0})]
            paths += [("bf16", t16, spec16, {}, {}), ("fp8", t8, spec8, extra8, {})]
        if variants and small:
            paths += [(f"gemv {v}", t4, spec, extra4, {"MOECOMP_W4_DECODE": "gemv", **dec, **_gemv_env(e, spec, T)})
                      for v, e in GEMV_VARIANTS.items()]
        for label, t, s, extra, kv in paths:
            try:
                with env(**kv):
                    rec[label] = time_op(x, t, s, extra)
            except Exception as e:  # one path failing (memory, compile) is reported, the rest still run
                rec[label] = None
                rec[f"{label} error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if check:  # the heuristic's path, and the GEMV path where it runs (T <= 16)
            ref = reference.moe_forward(x, *(t4[n] for n in MOE_ARGS), spec, **extra4)
            for key, kv in [("err", {})] + ([("err gemv", {"MOECOMP_W4_DECODE": "gemv"})] if small else []):
                with env(**kv):
                    out = torch.ops.moecomp.moe_forward(x, *(t4[n] for n in MOE_ARGS), spec.key, **extra4)
                rec[key] = float((out.float() - ref.float()).norm() / ref.float().norm())
            del ref
        rows.append(rec)
        _print_row(rec)
    del raw, t16, t4, extra4, t8, extra8
    torch.cuda.empty_cache()


def _fmt(v):
    return "-" if v is None else f"{v:.1f}"


# timing columns in this order (a path a row lacks prints "-")
PATHS = ("w4", "w4 gemv", "w4 dot", "w4 aligned", "w4 split", "w4 interleave", "w4 scaled", "w4 asm", "bf16", "fp8")
HEAD = ("| model | T | experts | " + " | ".join(f"{p} us" for p in PATHS) + " | bf16 / w4 | fp8 / w4 | floor4 us "
        "| w4 x floor | best w4 x floor | bf16 x floor16 | err | err gemv |")


def _print_row(r: dict) -> None:
    w4 = r.get("w4")
    ratio = lambda k: "-" if not (w4 and r.get(k)) else f"{r[k] / w4:.2f}"  # noqa: E731
    xfloor = "-" if not w4 else f"{w4 / r['floor4_us']:.1f}"
    best = min((r[p] for p in PATHS if p.startswith("w4") and r.get(p)), default=None)
    xbest = "-" if not best else f"{best / r['floor4_us']:.1f}"
    x16 = "-" if not r.get("bf16") else f"{r['bf16'] / r['floor16_us']:.1f}"
    err = lambda k: f"{r[k]:.1e}" if k in r else "-"  # noqa: E731
    print(f"| {r['model']} | {r['T']} | {r['experts_touched']} | " + " | ".join(_fmt(r.get(p)) for p in PATHS)
          + f" | {ratio('bf16')} | {ratio('fp8')} | {r['floor4_us']:.1f} | {xfloor} | {xbest} | {x16} | {err('err')} | {err('err gemv')} |",
          flush=True)
    for k, v in r.items():
        if k.startswith("gemv ") and not k.endswith(" error"):
            print(f"  {k}: {_fmt(v)} us (w4 gemv {_fmt(r.get('w4 gemv'))})", flush=True)
    for k, v in r.items():
        if k.endswith(" error"):
            print(f"  {k}: {v}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-oss-20b,gpt-oss-120b", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--tokens", default="1,4,16,64,128,1024")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the floor (TB/s)")
    ap.add_argument("--int4", action="store_true", help="add the int4 layer (qwen3-int4)")
    ap.add_argument("--no-check", action="store_true", help="skip the error column (the fp32 reference)")
    ap.add_argument("--quick", action="store_true",
                    help="gpt-oss-120b, T = 1,2,4,8,16, paths w4 gemv / w4 dot / bf16 (places QUANT4_GEMV_MAX_T)")
    ap.add_argument("--gemv-variants", action="store_true", help="also time GEMV_VARIANTS at T <= 16")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_quant4: needs CUDA")
        return 1
    import triton

    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM",
                "MOECOMP_FP8_MODE", "MOECOMP_W4_DECODE", "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM"):
        os.environ.pop(var, None)
    models = [m for m in a.models.split(",") if m] + (["qwen3-int4"] if a.int4 else [])
    tokens = [int(v) for v in a.tokens.split(",")]
    if a.quick:
        models = ["gpt-oss-120b"] + (["qwen3-int4"] if a.int4 else [])
        tokens = [1, 2, 4, 8, 16]
    rows: list = []
    print(HEAD)
    print("|" + "---|" * (HEAD.count("|") - 1))
    for m in models:
        run_model(m, tokens, a.hbm_tbs, rows, not a.no_check, a.quick, a.gemv_variants)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, commit=os.environ.get("MOECOMP_COMMIT"),
                           hbm_tbs=a.hbm_tbs, quick=a.quick, gemv_max_t=tuning.QUANT4_GEMV_MAX_T,
                           date=time.strftime("%Y-%m-%d")), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
