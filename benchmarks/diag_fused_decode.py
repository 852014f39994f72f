#!/usr/bin/env python3
"""Issue 41 item 1, fused decode launches against the unfused ones, each timed in a CUDA graph
(``triton.testing.do_bench_cudagraph``; us a call) and checked against each other:

    qkv       q / k / v projections: three ``skinny_linear`` launches against one ``skinny_group`` (bf16 weights, and
              e4m3 128x128 blocks weight-only), Qwen3-30B-A3B (2048 -> 4096 / 512 / 512) and gpt-oss-120b
              (2880 -> 4096 / 512 / 512) at 1, 2 and 4 rows (4 rows in bf16 runs cuBLAS for each member either way)
    norm      the RMSNorm (and the residual add) before q / k / v: the norm compiled by Inductor (one kernel, as in
              the decode step) then one ``skinny_group``, against one ``norm_group`` (MOECOMP_FUSE_NORM's op),
              Qwen3-30B-A3B sizes, bf16 and e4m3 128x128 blocks weight-only, with and without the residual, 1, 2,
              4 rows (4 rows in bf16 run the unfused members either way)
    oproj     the attention output projection, the residual add and the post-attention RMSNorm: o_proj's own op
              (``skinny_linear`` / ``fp8_linear``) then the add and norm compiled by Inductor (one kernel, as in the
              decode step), against one ``linear_add_norm`` (MOECOMP_FUSE_OPROJ's op), Qwen3-30B-A3B (4096 -> 2048)
              and gpt-oss-120b (4096 -> 2880, a bias), bf16 and e4m3 128x128 blocks weight-only, --rows (4 rows in
              bf16 run the op's unfused path: the check column says which path the op took)
    qkrope    what follows q / k / v: per-head q / k RMSNorm, rotary, the k / v cache writes (transformers' steps
              compiled by Inductor, as in the decode step) against one ``qk_norm_rope_cache`` (MOECOMP_FUSE_QKROPE's
              op), Qwen3-30B-A3B (Hq 32, Hkv 4, head 128, q / k norms) and gpt-oss (64, 8, 64, no norms, cos / sin
              of D / 2), B = --batches, cache 2048, bf16
    attention the decode attention: split + combine (two launches, MOECOMP_ATTN_ONE_LAUNCH=0) against the one launch
              (=1; one split: no partials, no counter), Qwen3-30B-A3B (Hq 32, Hkv 4, head 128), gpt-oss (Hq 64,
              Hkv 8, head 64, sinks; full layers and sliding ones, window 128), DeepSeek-V3 MLA as cached (Hq = Hkv
              = 128, Dk 192, Dv 128); B = --batches (1, 8, 32), context = --contexts (576, 2048, 8192: the valid
              length, cache 64 longer); the weights column gives the splits S

PDL stays as the op sets it (MOECOMP_PDL). Results: a table on stdout and, with --out-json, every row.

    PYTHONPATH=. python3 benchmarks/diag_fused_decode.py --out-json /tmp/fused.json
    PYTHONPATH=. python3 benchmarks/diag_fused_decode.py --parts oproj --rows 1,2,4
    PYTHONPATH=. python3 benchmarks/diag_fused_decode.py --parts qkrope --batches 1,8,32
    PYTHONPATH=. python3 benchmarks/diag_fused_decode.py --parts attention --batches 1,8,32 --contexts 576,2048,8192
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QKV = {"qwen3": (2048, (4096, 512, 512)), "gpt-oss-120b": (2880, (4096, 512, 512))}


def _bench(fn) -> float:
    import triton.testing as tt

    return tt.do_bench_cudagraph(fn, rep=50) * 1e3


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def qkv_rows(rows: list[int]) -> list[dict]:
    from moecomp.core import quant as q8
    from moecomp.core.spec import QuantSpec

    out, q = [], QuantSpec(activation="none")
    for (name, (K, Ns)), fmt in ((m, f) for m in QKV.items() for f in ("bf16", "fp8")):
        dense = [torch.randn(n, K, device="cuda") * 0.02 for n in Ns]
        if fmt == "bf16":
            ws, ss, key = [w.bfloat16() for w in dense], [None] * 3, ""
            one = lambda x, w, s: torch.ops.moecomp.skinny_linear(x, w, None)  # noqa: E731
        else:
            pairs = [q8.quantize(w, q) for w in dense]
            ws, ss, key = [p[0] for p in pairs], [p[1] for p in pairs], q.key
            one = lambda x, w, s: torch.ops.moecomp.fp8_linear(x, w, s, None, None, key)  # noqa: E731
        for M in rows:
            x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
            apart = lambda: [one(x, w, s) for w, s in zip(ws, ss)]  # noqa: E731
            group = lambda: torch.ops.moecomp.skinny_group(x, ws, [None] * 3, ss, key)  # noqa: E731
            err = max(_rel(a, b) for a, b in zip(group(), apart()))
            t_apart, t_group = _bench(apart), _bench(group)
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            out.append(dict(part="qkv", model=name, weights=fmt, rows=M, unfused_us=t_apart, fused_us=t_group,
                            ratio=t_group / t_apart, fused_tb_s=nbytes / t_group / 1e6, rel_diff=err))
    return out


def norm_rows(rows: list[int]) -> list[dict]:
    from moecomp.core import quant as q8
    from moecomp.core.spec import QuantSpec

    K, Ns = QKV["qwen3"]
    eps, q, out = 1e-6, QuantSpec(activation="none"), []

    def rms(x, r, g):
        h = x + r if r is not None else x
        hf = h.float()
        return h, g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)

    norm = torch.compile(rms, dynamic=False)
    g = (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16()
    for fmt in ("bf16", "fp8"):
        dense = [torch.randn(n, K, device="cuda") * 0.02 for n in Ns]
        if fmt == "bf16":
            ws, ss, key = [w.bfloat16() for w in dense], [None] * 3, ""
        else:
            pairs = [q8.quantize(w, q) for w in dense]
            ws, ss, key = [p[0] for p in pairs], [p[1] for p in pairs], q.key
        for residual in (False, True):
            for M in rows:
                x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
                r = torch.randn_like(x) if residual else None
                apart = lambda: torch.ops.moecomp.skinny_group(norm(x, r, g)[1], ws, [None] * 3, ss, key)  # noqa
                fused = lambda: torch.ops.moecomp.norm_group(x, r, g, eps, False, ws, [None] * 3, ss, key)  # noqa
                err = max(_rel(a, b) for a, b in zip(fused(), apart()))
                t_apart, t_fused = _bench(apart), _bench(fused)
                out.append(dict(part="norm", model="qwen3", weights=fmt + (" +res" if residual else ""), rows=M,
                                unfused_us=t_apart, fused_us=t_fused, ratio=t_fused / t_apart, rel_diff=err))
    return out


OPROJ = {"qwen3": (4096, 2048, False), "gpt-oss-120b": (4096, 2880, True)}  # K, N, bias


def oproj_rows(rows: list[int]) -> list[dict]:
    from moecomp.core import quant as q8
    from moecomp.core.counters import counters
    from moecomp.core.spec import QuantSpec

    eps, q, out = 1e-6, QuantSpec(activation="none"), []

    def add_norm(a, r, g):  # transformers' Qwen3 form, one Inductor kernel
        h = r + a
        hf = h.float()
        return h, g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)

    norm = torch.compile(add_norm, dynamic=False)
    for (name, (K, N, has_bias)), fmt in ((m, f) for m in OPROJ.items() for f in ("bf16", "fp8")):
        w32 = torch.randn(N, K, device="cuda") * 0.02
        b = (torch.randn(N, device="cuda") * 0.1).bfloat16() if has_bias else None
        g = (1 + 0.1 * torch.randn(N, device="cuda")).bfloat16()
        if fmt == "bf16":
            w, s, key = w32.bfloat16(), None, ""
            lin = lambda x: torch.ops.moecomp.skinny_linear(x, w, b)  # noqa: E731
        else:
            w, s = q8.quantize(w32, q)
            key = q.key
            lin = lambda x: torch.ops.moecomp.fp8_linear(x, w, s, b, None, key)  # noqa: E731
        for M in rows:
            x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(M, 1, N, device="cuda", dtype=torch.bfloat16)
            apart = lambda: norm(lin(x), r, g)  # noqa: E731
            fused = lambda: torch.ops.moecomp.linear_add_norm(x, w, b, s, key, r, g, eps, False, True)  # noqa: E731
            counters["linear_add_norm"].clear()
            got = fused()
            path = ",".join(counters["linear_add_norm"])
            err = max(_rel(a, b_) for a, b_ in zip(got, apart()))
            t_apart, t_fused = _bench(apart), _bench(fused)
            out.append(dict(part="oproj", model=name, weights=f"{fmt} ({path})", rows=M, unfused_us=t_apart,
                            fused_us=t_fused, ratio=t_fused / t_apart, rel_diff=err))


def _hf_qkrope(q, k, v, qw, kw, cos, sin, kc, vc, idx, eps=1e-6):
    """transformers' steps (Qwen3 / gpt-oss attention) between the projections and the attention."""
    B, T, D = q.shape[0], q.shape[1], kc.shape[-1]

    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) if w is not None else x

    def rope(x):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        if c.shape[-1] == D:
            return x * c + torch.cat((-x2, x1), -1) * s
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    qs = rope(norm(q.view(B, T, -1, D), qw).transpose(1, 2))
    ks = rope(norm(k.view(B, T, -1, D), kw).transpose(1, 2))
    kc.index_copy_(2, idx, ks)
    vc.index_copy_(2, idx, v.view(B, T, -1, D).transpose(1, 2))
    return qs


def qkrope_rows(batches: list[int]) -> list[dict]:
    hf, out = torch.compile(_hf_qkrope, dynamic=False), []
    for name, (Hq, Hkv, D, norms) in {"qwen3": (32, 4, 128, True), "gpt-oss": (64, 8, 64, False)}.items():
        for B in batches:
            r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            q, k, v = r(B, 1, Hq * D), r(B, 1, Hkv * D), r(B, 1, Hkv * D)
            qw, kw = (r(D), r(D)) if norms else (None, None)
            cos, sin = r(B, 1, D if norms else D // 2), r(B, 1, D if norms else D // 2)
            kc, vc = r(B, Hkv, 2048, D), r(B, Hkv, 2048, D)
            idx = torch.tensor([1000], device="cuda")
            apart = lambda: hf(q, k, v, qw, kw, cos, sin, kc, vc, idx)  # noqa: E731
            fused = lambda: torch.ops.moecomp.qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, False, cos, sin, kc, vc,  # noqa
                                                                 idx)
            y0, k0 = apart(), kc[:, :, 1000].clone()
            y1, k1 = fused(), kc[:, :, 1000].clone()
            t0, t1 = _bench(apart), _bench(fused)
            out.append(dict(part="qkrope", model=name, weights="bf16" + (" +norms" if norms else ""), rows=B,
                            unfused_us=t0, fused_us=t1, ratio=t1 / t0, rel_diff=max(_rel(y1, y0), _rel(k1, k0))))
    return out


# name -> (Hq, Hkv, Dk, Dv, sinks, window)
ATTENTION = {"qwen3": (32, 4, 128, 128, False, 0), "gpt-oss": (64, 8, 64, 64, True, 0),
             "gpt-oss-sliding": (64, 8, 64, 64, True, 128), "deepseek-v3-mla": (128, 128, 192, 128, False, 0)}


def attention_rows(batches: list[int], contexts: list[int]) -> list[dict]:
    from moecomp.ops import triton_attention as ta

    out = []
    for name, (Hq, Hkv, Dk, Dv, sinks, window) in ATTENTION.items():
        for B in batches:
            for ctx in contexts:
                L = ctx + 64
                q = torch.randn(B, Hq, Dk, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, Hkv, L, Dk, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(B, Hkv, L, Dv, device="cuda", dtype=torch.bfloat16)
                keep = torch.ones(B, L, dtype=torch.bool, device="cuda")
                n = torch.tensor(ctx, device="cuda")
                s = (torch.randn(Hq, device="cuda") * 2).bfloat16() if sinks else None
                run = lambda: torch.ops.moecomp.decode_attention(q, k, v, keep, n, Dk ** -0.5, s, window)  # noqa
                got = {}
                for one in ("0", "1"):
                    os.environ[ta.ONE_LAUNCH_ENV] = one
                    got[one] = (run(), _bench(run))  # the first call makes the counters, outside the capture
                (y0, t0), (y1, t1) = got["0"], got["1"]
                S = ta._plan(q, k, v, window)["S"]
                out.append(dict(part="attention", model=f"{name} n={ctx}", weights=f"bf16 S={S}", rows=B,
                                unfused_us=t0, fused_us=t1, ratio=t1 / t0, rel_diff=_rel(y1, y0)))
                del q, k, v
    os.environ.pop(ta.ONE_LAUNCH_ENV, None)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| part | model | weights | rows / tokens | unfused us | fused us | fused / unfused | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = f"rel diff {r['rel_diff']:.1e}"
        lines.append(f"| {r['part']} | {r['model']} | {r.get('weights', 'bf16')} | {r.get('rows', r.get('tokens'))} | "
                     f"{r['unfused_us']:.2f} | {r['fused_us']:.2f} | {r['ratio']:.2f} | {check} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="qkv,norm,oproj,qkrope,attention")
    ap.add_argument("--rows", default="1,2,4", help="qkv / norm / oproj rows")
    ap.add_argument("--batches", default="1,8,32", help="attention / qkrope batch rows")
    ap.add_argument("--contexts", default="576,2048,8192", help="attention valid lengths")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_fused_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    import moecomp.ops  # noqa: F401

    parts, rows = a.parts.split(","), []
    if "qkv" in parts:
        rows += qkv_rows([int(r) for r in a.rows.split(",")])
    if "norm" in parts:
        rows += norm_rows([int(r) for r in a.rows.split(",")])
    if "oproj" in parts:
        rows += oproj_rows([int(r) for r in a.rows.split(",")])
    if "qkrope" in parts:
        rows += qkrope_rows([int(b) for b in a.batches.split(",")])
    if "attention" in parts:
        rows += attention_rows([int(b) for b in a.batches.split(",")], [int(c) for c in a.contexts.split(",")])
    print(table(rows))
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
