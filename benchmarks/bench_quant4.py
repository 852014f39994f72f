#!/usr/bin/env python3
"""4-bit experts (issue 22): gpt-oss-20b / gpt-oss-120b layers in MXFP4 and int4 against moecomp bf16 and FP8 and
the peers' bf16 paths, every path in the same run.

Each model's block is transformers' own ``GptOssMLP`` at the real sizes (H = I = 2880, top-4 of 32 / 128 experts),
built on the device in bf16 with random weights (N(0, 0.02)); moecomp's recogniser gives its spec and tensors
(``layer.families.block_spec``, as ``optimize`` would bind it). Two variants of the same sizes are timed:

* **gpt-oss** (the model's own experts: gate / up rows interleaved, clamped swiglu, expert biases):
  ``hf`` (the HF block, bf16, its default experts implementation), ``moecomp_bf16``, ``moecomp_mxfp4`` (the routed
  experts as a gpt-oss checkpoint holds them: e2m1 codes + one ue8m0 scale per 32 inputs), ``moecomp_int4``
  (group-128 int4 with zero points, GPTQ / AWQ-style).
* **plain** (gate rows then up rows, silu, no biases: the layout FP8 block checkpoints and vLLM's kernel take):
  ``plain_moecomp_bf16``, ``plain_moecomp_fp8`` (e4m3, 128 x 128 fp32 block scales, the kernel table's mode),
  ``plain_moecomp_mxfp4``, ``plain_vllm_bf16`` (vLLM's Triton fused-MoE kernel, ``--vllm-peer``; the peer has no
  4-bit path, so vLLM 4-bit is n/a, and it cannot run gpt-oss's own activation).

The router is the block's (linear + bias, top-4, softmax) in every path. Each quantized path is checked against
``moecomp.oracle.reference.moe_forward`` on the same quantized tensors (dequantized exactly, fp32 math); bf16 paths
against the HF block (gpt-oss) or the reference (plain). Times: ``triton.testing.do_bench`` medians, plain launches
and a CUDA-graph replay (T <= 1024), the better taken. The floor of a cell is the bytes of the experts the batch
touched (at their stored size, scales and biases included) plus router and activations over the measured copy
rate, or the FLOPs over the bf16 matmul rate if larger.

    python3 benchmarks/bench_quant4.py --vllm-peer .peers/vllm_fused_moe            # H200: ~3-5 min
    python3 benchmarks/bench_quant4.py --device cpu --tiny                           # smoke run (CPU)

Output: ``benchmarks/results/<gpu>-<date>-<commit>-quant4.json`` (+ a PNG when matplotlib imports), a table on
stdout with the ratios the issue's targets name (MXFP4 >= 2.5x bf16 and >= 1.4x FP8 at T <= 128).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from layer import common  # noqa: E402
from layer.env import environment, git_commit, save  # noqa: E402
from layer.families import FAMILIES, block_spec, build_block  # noqa: E402
from layer.floors import floor_of  # noqa: E402
from layer.peers import load_vllm_peer, make_vllm_fn  # noqa: E402
from layer.timing import Path, Timer, measure_ceilings, run_path  # noqa: E402

MODELS = ("gpt_oss20b", "gpt_oss120b")
TOKENS = (1, 4, 16, 64, 128, 1024, 8192)
TARGETS = dict(vs_bf16=2.5, vs_fp8=1.4, max_t=128)  # issue 22: memory-bound cells (T <= 128)
TOL = 2e-2  # bf16 output against an fp32 reference of the same weights (policy.BENCH_TOLERANCE's order)


def _variants(spec, tensors):
    """{variant: (spec, float tensors [out, in] layout)}: gpt-oss's own spec, and the plain one of the same sizes."""
    from moecomp.core.args import MOE_ARGS

    t = dict(tensors)
    if spec.w_layout == "in_out":  # HF's gpt-oss experts are [E, in, out]; 4-bit and FP8 store [E, out, in]
        t["w13"], t["w2"] = t["w13"].transpose(1, 2).contiguous(), t["w2"].transpose(1, 2).contiguous()
    own = dataclasses.replace(spec, w_layout="out_in")
    plain = dataclasses.replace(own, gate_up="concat", activation="silu", has_expert_bias=False,
                                activation_clamp=False)
    tp = dict(t, b13=None, b2=None)
    return {"gpt-oss": (own, t), "plain": (plain, tp)}, MOE_ARGS


def _quantized(spec, t: dict, quant, names):
    """(spec with quant, positional op tensors, {scale / zero name: tensor}) from the float tensors."""
    from moecomp.core import quant as q8

    extra, tt = {}, dict(t)
    for n in ("w13", "w2"):
        w = t[n]
        if quant.packed:
            parts = [q8.quantize_4bit(w[i:i + 8], quant) for i in range(0, w.shape[0], 8)]  # 8 experts at a time
            tt[n] = torch.cat([p[0] for p in parts])
            extra[f"{n}_scale"] = torch.cat([p[1] for p in parts])
            if quant.zero_point:
                extra[f"{n}_zero"] = torch.cat([p[2] for p in parts])
        else:
            tt[n], extra[f"{n}_scale"] = q8.quantize(w, quant, 2 if (n == "w13" and spec.gated) else 1)
    qspec = dataclasses.replace(spec, quant=quant)
    return qspec, tuple(tt[n] for n in names), extra


def _op_path(name, spec, args, extra, ref_fn=None):
    op, key, H = torch.ops.moecomp.moe_forward, spec.key, spec.hidden_size

    def fn(x):
        return op(x.view(-1, H), *args, key, **extra).view(x.shape)

    return Path(name, fn, check=name if ref_fn is not None else "hf"), ref_fn


def build_paths(fam_name: str, tiny: bool, device, seed: int, vllm):
    """Every path of one model: [(Path, reference fn or None)], the gpt-oss spec and tensors (for the floors)."""
    from moecomp.oracle import reference
    from moecomp.core.spec import QuantSpec

    cfg, block = build_block(FAMILIES[fam_name], tiny, device, seed)
    spec, tensors = block_spec(block)
    variants, names = _variants(spec, tensors)
    paths = [(Path("hf", block), None)]
    quants = {"mxfp4": QuantSpec.mxfp4(), "int4": QuantSpec.int4(128, zero_point=True), "fp8": QuantSpec()}
    floors = {}
    for var, (vs, t) in variants.items():
        pre = "" if var == "gpt-oss" else "plain_"
        base = tuple(t[n] for n in names)
        if var == "plain":  # the reference is the plain spec's own, in fp32
            def ref_plain(x, _s=vs, _a=base):
                return reference.moe_forward(x.view(-1, _s.hidden_size), *_a, _s).view(x.shape)
            paths.append(_op_path(f"{pre}moecomp_bf16", vs, base, {}, ref_plain))
        else:
            paths.append(_op_path("moecomp_bf16", vs, base, {}))
        floors[f"{pre}moecomp_bf16"] = (vs, t, {})
        for qn in (("mxfp4", "int4") if var == "gpt-oss" else ("fp8", "mxfp4")):
            qspec, qargs, extra = _quantized(vs, t, quants[qn], names)

            def ref_q(x, _s=qspec, _a=qargs, _e=extra):
                from moecomp.core.quant import weight_only

                specs = [_s] if _s.quant.activation == "none" else [_s, dataclasses.replace(_s, quant=weight_only(
                    _s.quant))]  # fp8: the op's table runs w8a8 or weight-only; the closer reference judges it
                return [reference.moe_forward(x.view(-1, s.hidden_size), *_a, s, **_e).view(x.shape) for s in specs]

            paths.append(_op_path(f"{pre}moecomp_{qn}", qspec, qargs, extra, ref_q))
            floors[f"{pre}moecomp_{qn}"] = (qspec, dict(zip(names, qargs)), extra)
        if var == "plain":
            if vllm is None:
                paths.append((Path("plain_vllm_bf16", None, error="vLLM peer not loaded (--vllm-peer)"), None))
            else:
                cd = common.DTYPE if device.type == "cuda" else torch.float32
                paths.append((Path("plain_vllm_bf16", make_vllm_fn(vllm, vs, t, None, cd), check="plain_vllm_bf16"),
                              ref_plain))
    return cfg, block, spec, tensors, paths, floors


def run_model(fam_name, args, device, timer, ceilings, vllm) -> dict:
    rec = dict(model=FAMILIES[fam_name].label, cells=[])
    t0 = time.perf_counter()
    cfg, block, spec, tensors, paths, floors = build_paths(fam_name, args.tiny, device, args.seed, vllm)
    rec.update(spec=spec.describe(), setup_s=round(time.perf_counter() - t0, 1))
    common.log(f"[quant4] {rec['model']}: {spec.describe()} (setup {rec['setup_s']} s)")
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    for T in args.tokens:
        x = torch.randn(1, T, spec.hidden_size, device=device, dtype=common.DTYPE, generator=gen)
        with torch.no_grad():
            ref = block(x)
            logits = x.view(T, -1).float() @ tensors["router_w"].float().T
            ids = logits.topk(spec.top_k, dim=-1).indices
            cell = dict(T=T, paths={}, floors={})
            for name, (fs, ft, fe) in floors.items():
                cell["floors"][name] = floor_of(fs, T, ids, ft, ceilings, fe)
            for p, ref_fn in paths:
                check = None
                if ref_fn is not None:
                    want = ref_fn(x)

                    def check(out, _w=want if isinstance(want, list) else [want]):
                        from layer.checks import rel_err

                        e = min(rel_err(out, w) for w in _w)
                        return dict(rel_err_vs_reference=e, check_ok=bool(e <= TOL))
                if p.fn is None:
                    cell["paths"][p.name] = dict(error=p.error, best_ms=None)
                    continue
                cell["paths"][p.name] = run_path(p, x, ref, timer, args, device, TOL, check=check)
        rec["cells"].append(cell)
        common.log(_cell_line(T, cell))
    del block, paths, floors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _cell_line(T, cell) -> str:
    parts = []
    for n, pr in cell["paths"].items():
        v = pr.get("best_ms")
        parts.append(f"{n}={v:.4f}" if v else f"{n}=({(pr.get('error') or pr.get('skipped') or '-')[:40]})")
    return f"[quant4]   T={T}: " + " ".join(parts)


def ratios(cell) -> dict:
    """The issue's ratios in one cell (None where a path did not run): bf16 / mxfp4 (gpt-oss layout), fp8 / mxfp4
    (plain layout), and each 4-bit path's time over its floor."""
    ms = {n: pr.get("best_ms") for n, pr in cell["paths"].items()}

    def div(a, b):
        return ms[a] / ms[b] if ms.get(a) and ms.get(b) else None

    out = dict(mxfp4_vs_bf16=div("moecomp_bf16", "moecomp_mxfp4"), mxfp4_vs_fp8=div("plain_moecomp_fp8",
                                                                                     "plain_moecomp_mxfp4"),
               int4_vs_bf16=div("moecomp_bf16", "moecomp_int4"), mxfp4_vs_hf=div("hf", "moecomp_mxfp4"),
               plain_mxfp4_vs_vllm_bf16=div("plain_vllm_bf16", "plain_moecomp_mxfp4"))
    for n in ("moecomp_mxfp4", "moecomp_int4", "moecomp_bf16", "plain_moecomp_fp8"):
        fl = cell["floors"].get(n)
        out[f"{n}_over_floor"] = ms[n] / fl["floor_ms"] if ms.get(n) and fl else None
    return out


def table(result) -> str:
    cols = ("hf", "moecomp_bf16", "moecomp_mxfp4", "moecomp_int4", "plain_vllm_bf16", "plain_moecomp_bf16",
            "plain_moecomp_fp8", "plain_moecomp_mxfp4")
    lines = ["| model | T | " + " | ".join(cols) + " | mxfp4 floor | mxfp4/floor | bf16/mxfp4 | fp8/mxfp4 | checks |",
             "|" + "---|" * (len(cols) + 7)]
    for m in result["models"]:
        for c in m["cells"]:
            r = c["ratios"]
            ms = [c["paths"].get(n, {}).get("best_ms") for n in cols]
            bad = [n for n, pr in c["paths"].items() if n != "hf" and (pr.get("check_ok") is False or pr.get("error")
                   and n != "plain_vllm_bf16")]
            f = c["floors"].get("moecomp_mxfp4", {}).get("floor_ms")

            def fmt(v, d=4):
                return f"{v:.{d}f}" if v else "-"

            lines.append(f"| {m['model']} | {c['T']} | " + " | ".join(fmt(v) for v in ms)
                         + f" | {fmt(f)} | {fmt(r['moecomp_mxfp4_over_floor'], 2)} | {fmt(r['mxfp4_vs_bf16'], 2)}x"
                         + f" | {fmt(r['mxfp4_vs_fp8'], 2)}x | {'FAIL: ' + ', '.join(bad) if bad else 'ok'} |")
    return "\n".join(lines)


def plot(result, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no plot ({e})"
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(6 * len(result["models"]), 4.2), squeeze=False)
    for ax, m in zip(axes[0], result["models"]):
        Ts = [c["T"] for c in m["cells"]]
        for n in ("moecomp_mxfp4", "moecomp_int4", "moecomp_bf16", "plain_moecomp_fp8", "plain_vllm_bf16", "hf"):
            ys = [c["paths"].get(n, {}).get("best_ms") for c in m["cells"]]
            if any(ys):
                ax.plot(Ts, [y if y else float("nan") for y in ys], marker="o", label=n)
        ax.plot(Ts, [c["floors"]["moecomp_mxfp4"]["floor_ms"] for c in m["cells"]], "k--", label="mxfp4 floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(m["model"])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=None, help="comma-separated T (default 1,4,16,64,128,1024,8192)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke runs)")
    ap.add_argument("--vllm-peer", default=None, help="directory holding vllm_fused_moe.py")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<gpu>-<date>-<commit>-quant4)")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(
        (1, 4, 16) if args.tiny else TOKENS)
    args.verbose, args.no_graph, args.graph_max_t = False, False, 1024
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    prev = common.set_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        timer = Timer(device, args.quick or device.type != "cuda")
        ceilings = measure_ceilings(device, timer)
        vllm, vinfo = (load_vllm_peer(args.vllm_peer, device) if args.vllm_peer else (None, dict(requested=False)))
        env = environment(device)
        result = dict(benchmark="quant4", date=datetime.date.today().isoformat(), commit=git_commit(), env=env,
                      ceilings=ceilings, vllm=vinfo, targets=TARGETS, tolerance=TOL, models=[],
                      method=__doc__.split("\n\n")[1].replace("\n", " "))
        for m in args.models.split(","):
            rec = run_model(m.strip(), args, device, timer, ceilings, vllm)
            for c in rec["cells"]:
                c["ratios"] = ratios(c)
            result["models"].append(rec)
        stem = args.out or os.path.join(HERE, "results", f"{_slug(env['gpu'])}-{result['date']}-"
                                                         f"{result['commit'][:7]}-quant4")
        save(result, stem + ".json")
        result["plot"] = plot(result, stem + ".png")
        print(table(result))
        return result
    finally:
        common.set_dtype(prev)


def _slug(s: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in s.lower()).strip("-")


if __name__ == "__main__":
    main()
