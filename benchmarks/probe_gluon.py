"""Probe of the Gluon FP8 gemm2 (kernels/gluon_fp8.py) on this machine, in seconds: Triton's version, whether each
Gluon name / keyword the kernel uses exists here (feature checks, as ops/triton_fp8_gluon.gluon_api), then on CUDA
(compute capability 9.x) a few tiny gemm2 calls and gemm1 calls (``moecomp.testing.gluon_gemm1_case``) against
plain-torch dequantized references (max error printed).

    PYTHONPATH=. python3 benchmarks/probe_gluon.py

``make_case`` / ``reference`` / ``run_gluon`` / ``run_tma`` build and run one synthetic gemm2 (sorted rows already
aligned, e4m3 codes and fp32 scales drawn directly): benchmarks/diag_fp8_gluon.py times them.
"""

from __future__ import annotations

import inspect
import sys

import torch
import triton


def api_report() -> dict:
    """{what: present} for every Gluon name and keyword the kernels and their launcher use (the launcher's lists,
    ops/triton_fp8_gluon); where Triton versions spell a thing differently (3.6 / 3.9), one entry names the
    spelling found here."""
    from moecomp.ops import triton_fp8_gluon as fg

    out = {}
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
    except ImportError as e:
        return {f"triton.experimental.gluon ({e})": False}
    out["gluon.jit"] = hasattr(gluon, "jit")
    for n in fg.GL_NAMES + fg.GEMM1_NAMES:
        out[f"gl.{n}"] = hasattr(gl, n)
    for n in fg.HOPPER_NAMES:
        out[f"hopper.{n}"] = hasattr(hopper, n)
    load = next((n for n in fg.TMA_LOADS if hasattr(getattr(hopper, "tma", None), n)), None)
    out[f"TMA load: tma.{load}" if load else "TMA load: tma." + " / ".join(fg.TMA_LOADS)] = load is not None
    out["shared_memory_descriptor.slice"] = hasattr(getattr(gl, "shared_memory_descriptor", None), "slice")
    for n in ("init", "expect", "wait", "invalidate", "MBarrierLayout"):
        out[f"mbarrier.{n}"] = hasattr(getattr(hopper, "mbarrier", None), n)
    lacking = fg.missing_keywords(hopper)
    for path, kws in fg.KEYWORDS:
        out.update({f"{path}({k}=)": f"{path}({k}=)" not in lacking for k in kws})
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        out["gluon.nvidia.hopper.TensorDescriptor(layout)"] = "layout" in inspect.signature(TensorDescriptor).parameters
    except ImportError:
        out["gluon.nvidia.hopper.TensorDescriptor"] = False
    out.update(_offline_report(gluon))
    return out


def _offline_report(gluon) -> dict:
    """The offline compile's (moecomp/testing/gluon_sm90) version-dependent pieces: where GluonASTSource lives and
    how a descriptor argument gets its signature type."""
    out = {}
    if hasattr(gluon, "GluonASTSource"):
        out["GluonASTSource: gluon.GluonASTSource"] = True
    else:
        try:
            from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401

            out["GluonASTSource: gluon._runtime.GluonASTSource"] = True
        except ImportError:
            out["GluonASTSource (gluon / gluon._runtime)"] = False
    try:
        from triton.runtime.jit import mangle_type  # noqa: F401

        out["descriptor signature: triton.runtime.jit.mangle_type"] = True
    except ImportError:
        out["descriptor signature: triton.runtime.jit.mangle_type"] = False
    return out


def make_case(E: int, H: int, I: int, counts: list[int], bm: int, device="cuda", seed: int = 0) -> dict:
    """A gemm2 call as the op makes it: ``counts[e]`` rows for expert e, each expert's rows padded to a multiple of
    ``bm`` (padding rows: sentinel pair P), h_q / w2_q e4m3 codes with fp32 scales (h per row and 128 columns, w2 per
    128 x 128 block), routing weights per pair."""
    from moecomp.testing.gluon_gemm1_case import padded_order

    P = sum(counts)
    sorted_ids, block_expert = padded_order(counts, bm, seed)
    S = len(sorted_ids)
    dev = torch.device(device)
    gd = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gd, device=dev)  # noqa: E731
    e4m3 = lambda t: (t * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
    w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn, device=dev)
    for e in range(E):  # one expert at a time: DeepSeek-V3's w2 never has an fp32 copy
        w2[e] = e4m3(rnd(H, I))
    case = dict(
        E=E, H=H, I=I, P=P, bm=bm, hq=e4m3(rnd(S, I)), hs=rnd(S, I // 128).abs() * 1e-2 + 1e-3, w2=w2,
        ws=rnd(E, H // 128, I // 128).abs() * 1e-3 + 1e-4, weights=rnd(P).abs(),
        sorted_ids=torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
        block_expert=torch.tensor(block_expert, dtype=torch.int32, device=dev),
        num_padded=torch.tensor([S], dtype=torch.int32, device=dev),
        max_blocks=len(block_expert),
    )
    return case


def reference(c: dict) -> torch.Tensor:
    """y [P, H] fp32 from the dequantized operands (plain torch)."""
    h = c["hq"].float() * c["hs"].repeat_interleave(128, 1)
    w = c["w2"].float() * c["ws"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    y = torch.zeros(c["P"] + 1, c["H"], device=h.device)
    rows = torch.arange(h.shape[0], device=h.device)
    e_of_row = c["block_expert"].long()[rows // c["bm"]]
    for e in range(c["E"]):
        sel = rows[e_of_row == e]
        y[c["sorted_ids"].long()[sel]] = h[sel] @ w[e].T
    return y[:-1] * c["weights"][:, None]


def _q(c: dict) -> dict:
    ws = c["ws"]
    return dict(A_QUANT=3, W_SCALE=1, Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False, ws_ptr=ws, stride_se=ws.stride(0),
                stride_sn=ws.stride(1), stride_sk=ws.stride(2))


def _aligned(c: dict):
    return c["sorted_ids"], c["block_expert"], c["num_padded"], c["max_blocks"]


def run_gluon(c: dict, y: torch.Tensor | None = None) -> torch.Tensor:
    from moecomp.ops import triton_fp8_gluon as fg

    y = torch.empty(c["P"], c["H"], dtype=torch.bfloat16, device=c["hq"].device) if y is None else y
    return fg.gemm2(c["hq"], dict(as_ptr=c["hs"], stride_am=c["hs"].stride(0)), c["w2"], None, c["weights"],
                    _aligned(c), c["P"], c["bm"], _q(c), y, {})


def run_tma(c: dict, y: torch.Tensor | None = None, bn: int = 128, nw: int = 8, stages: int = 4) -> torch.Tensor:
    """The Triton TMA fp8 gemm2 (ops/triton_fp8_tma.gemm2, the Gluon opt-in off) on the same call."""
    import os

    from moecomp.ops import triton_fp8_tma
    from moecomp.ops.triton_fp8 import QAct

    y = torch.empty(c["P"], c["H"], dtype=torch.bfloat16, device=c["hq"].device) if y is None else y
    c2 = dict(BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=stages, tma=1)
    old = os.environ.pop("MOECOMP_FP8_GLUON", None)
    try:
        return triton_fp8_tma.gemm2(QAct(c["hq"], c["hs"], torch.bfloat16), c["w2"], None, c["weights"], _aligned(c),
                                    c["P"], c["bm"], c2, _q(c), y, {}, {})
    finally:
        if old is not None:
            os.environ["MOECOMP_FP8_GLUON"] = old


def main() -> int:
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    rep = api_report()
    for name, ok in rep.items():
        print(f"  {'ok     ' if ok else 'MISSING'} {name}")
    from moecomp.kernels.gluon_fp8 import tma_load
    from moecomp.ops import triton_fp8_gluon as fg

    print(f"kernels' TMA load: tma.{tma_load.__name__}")
    print(f"launcher gluon_api(): {fg.gluon_api() or 'ok'}; gluon_api(gemm1=True): {fg.gluon_api(gemm1=True) or 'ok'}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("no CUDA compute capability 9.x device: nothing run")
        return 0
    worst = 0.0
    for E, H, I, counts, bm in ((2, 256, 256, [70, 33], 64), (3, 256, 768, [5, 0, 130], 64),
                                (2, 384, 1408, [129, 64], 128), (1, 128, 128, [1], 64)):
        c = make_case(E, H, I, counts, bm)
        y = torch.full((c["P"], H), float("nan"), dtype=torch.bfloat16, device="cuda")
        run_gluon(c, y)
        torch.cuda.synchronize()
        ref = reference(c)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))
        nk = I // 128
        print(f"  E={E} H={H} I={I} (K steps {nk}, chunk/tail {fg.chunk(nk)}) rows {counts} BLOCK_M {bm}: "
              f"max |y - ref| / max |ref| = {err:.2e}")
    print(f"gemm2 worst {worst:.2e} ({'ok' if worst < 1e-2 else 'BAD'}: bf16 output rounding is 2^-9 = 2.0e-3 "
          f"relative)")
    worst1 = probe_gemm1(fg.gluon_api(gemm1=True))
    return 0 if worst < 1e-2 and worst1 < 5e-2 else 1


def probe_gemm1(api: str | None) -> float:
    """Tiny Gluon gemm1 calls against the dequantized reference: max |h - ref| / max |ref| over the rows holding a
    pair (bf16 h: 2^-9 rounding plus x's e4m3 codes; Q_OUT: e4m3's 2^-4). Returns the worst, scaled to the bf16
    bound (Q_OUT errors divided by 4)."""
    from moecomp.ops import triton_fp8_gluon as fg
    from moecomp.testing import gluon_gemm1_case as g1

    print(f"launcher gluon_api(gemm1=True): {api or 'ok'}")
    if api is not None:
        return float("inf")
    worst = 0.0
    for E, H, I, counts, bm, kw in ((2, 256, 256, [70, 33], 64, {}), (3, 384, 256, [5, 0, 130], 128, dict(bias=True)),
                                    (2, 256, 128, [64, 1], 64, dict(h_quant=True, act="gelu_tanh")),
                                    (1, 128, 128, [1], 128, dict(top_k=1))):
        c = g1.make_case1(E, H, I, counts, bm, **kw)
        fg.FALLBACKS.clear()
        out = g1.run1(c, gluon=True)
        torch.cuda.synchronize()
        rows = g1.valid_rows(c)
        h, ref = g1.dense_h(out)[rows], g1.reference1(c)[rows]
        err = ((h - ref).abs().max() / ref.abs().max()).item()
        quant = hasattr(out, "s")
        worst = max(worst, (err / 4 if quant else err) if err == err else float("inf"))
        print(f"  gemm1 E={E} H={H} I={I} rows {counts} BLOCK_M {bm} {kw} (Q_OUT {quant}, fallbacks "
              f"{fg.fallbacks() or 'none'}): max |h - ref| / max |ref| = {err:.2e}")
    print(f"gemm1 worst {worst:.2e} ({'ok' if worst < 5e-2 else 'BAD'})")
    return worst


if __name__ == "__main__":
    sys.exit(main())
