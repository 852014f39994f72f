"""The 4-bit experts' part of ``python -m moecomp tune`` (``--quant4``): presets, random packed layers, the
dequantized per-pair reference, and the aligned path's measurement (the decode path: ``tune_quant4_decode.py``; the
command's loop: ``tune_quant4_run.py``).

Per (shape, token bucket T), on one random layer made packed on the device (``packed_layer``: uint8 codes, scale
bytes / fp16 scales and zero points drawn directly; no 16-bit copy of the experts at any size):

    route once (the op's router and routing kernels)
    reference   h and y of every routed pair from the dequantized weights (``pair_reference``: moecomp.core.quant's fp32
                dequantization, h rounded to x's dtype as the kernels store it); every candidate's output is checked
                against it: relative Frobenius error at most ``REL_TOL``, else rejected (a candidate that does not
                compile or launch is skipped)
    forms       each K-step form of the format (``form_candidates``: mxfp4 dot_scaled / interleave / split / asm,
                int4 interleave / split / interleave with the scale folded) at the static heuristic's BLOCK_M and
                tiles (gemm1 + gemm2); the fastest form is kept for the tile search (forms x tiles would be their
                product: too many compiles for one device call)
    tiles       for each BLOCK_M (the largest two of ``block_ms`` and the heuristic's): align, gemm1's candidates
                (``Q4_TILES``, BLOCK_K fitted to the group by ``triton_quant4.tile``), then gemm2's on gemm1's
                winner; the fastest align + gemm1 + gemm2 wins

Timings: ``triton.testing.do_bench`` medians of each launch captured in a CUDA graph (``bench_graph``), as the 16-bit
tuner times them. The table entry: ``{"BLOCK_M", "g1", "g2", "w4_form"[, "w4_fold"], "decode", "top_k"}`` under
``tuning.shape_key(E, I, H, tuning.quant4_key(quant))``, what ``tuning.quant4_config`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import torch

from ..core import quant as q8
from ..core.args import MOE_ARGS
from ..core.spec import MoESpec, QuantSpec
from ..ops import triton_quant4, tuning
from ..oracle import reference
from ..testing import LAYER_PRESETS
from .tune_io import bench_graph

# The formats. int4: GPTQ / AWQ-style, group 128 with zero points (AWQ's layout, GPTQ's asymmetric one), fp16 scales.
MXFP4 = QuantSpec.mxfp4()
INT4 = QuantSpec.int4(128, zero_point=True)
FORMATS = {"mxfp4": (MXFP4,), "int4": (INT4,), "both": (MXFP4, INT4)}


def _gpt_oss(E: int) -> MoESpec:
    """A gpt-oss MoE layer (``testing.mxfp4_write.gpt_oss_config``: hidden = intermediate = 2880, top-4, SwiGLU with
    alpha 1.702 and clamp 7, expert and router biases, gate / up interleaved, softmax over the top-k logits)."""
    return MoESpec(num_experts=E, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                   activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                   has_router_bias=True, score_order="topk_then_score", quant=MXFP4)


# 4-bit layer presets (kept apart from ``testing.LAYER_PRESETS``, which the 16-bit tuner, the GPU tests and the
# benchmarks iterate): each in the format its checkpoints ship in.
QUANT4_PRESETS = {
    "gpt_oss_120b": _gpt_oss(128),
    "gpt_oss_20b": _gpt_oss(32),
    "qwen3_30b_a3b_int4": LAYER_PRESETS["qwen3_30b_a3b"].replace(quant=INT4),
    "mixtral_8x7b_int4": LAYER_PRESETS["mixtral_8x7b"].replace(quant=INT4),
}
# --interpret: a tiny gpt-oss-like layer (E, I, H, k), two candidates per choice
INTERPRET_SHAPE = (4, 32, 64, 2)

# (BLOCK_N, BLOCK_K, num_warps, num_stages). They hold the static heuristic's tiles (``tuning._quant4_heuristic``:
# compiled without spills for sm90) and a few neighbours from the sweep of benchmarks/sweep_quant4.py (longer K steps,
# wider N); ``tiles_at`` keeps 8 warps for BLOCK_M >= 64 and BLOCK_N 16 for BLOCK_M <= 32 (as the heuristic does):
# every candidate is a Triton compile, and one device call has to hold the presets' entries.
Q4_TILES = {
    "g1": [(32, 128, 4, 4), (16, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (32, 64, 8, 4),
           (64, 64, 8, 4)],
    "g2": [(64, 128, 4, 4), (64, 64, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 8, 3),
           (128, 64, 8, 3)],
}
INTERPRET_TILES = {"g1": [(16, 32, 4, 1), (32, 64, 4, 1)], "g2": [(16, 32, 4, 1), (32, 64, 4, 1)]}
MAX_BLOCK_MS = 2  # BLOCK_M candidates: the largest this many of ``block_ms`` (and the heuristic's)
REL_TOL = 1e-2  # a candidate further than this from the dequantized reference (relative Frobenius) is rejected
MXFP4_SCALE_BYTES = (118, 122)  # random mxfp4 scale bytes in [lo, hi): 2 ** (byte - 127); weights of rms ~0.026
INT4_SCALES = (0.002, 0.004)  # random int4 scales, uniform: (code - zero) * scale of rms ~0.02

QUANT4_HELP = ("tune 4-bit experts (weight-only, 16-bit x of --dtype): 'mxfp4' (gpt-oss), 'int4' (GPTQ / AWQ-style, "
               "group 128 with zero points), 'both', or another int4 table key 'int4_g<G>[_zp]'; presets: "
               + ", ".join(f"{n} ({s.quant.weight})" for n, s in QUANT4_PRESETS.items())
               + "; K-step forms, aligned tiles, GEMV / DIRECT decode tiles and the decode path's token limit are "
                 "measured per bucket (table key dtype=mxfp4 | int4_g<G>[_zp])")


class TuneError(RuntimeError):
    """No candidate ran for an entry (every tile out of resources, or rejected)."""


# ------------------------------------------------------------------------------------------------ formats, presets
def parse_formats(arg: str) -> tuple[QuantSpec, ...]:
    """``--quant4``'s value -> the formats: "mxfp4", "int4" (group 128 with zero points), "both", or a table key of
    another int4 variant, "int4_g<G>" / "int4_g<G>_zp" (G a multiple of 32)."""
    if arg in FORMATS:
        return FORMATS[arg]
    m = re.fullmatch(r"int4_g(\d+)(_zp)?", arg)
    if m and int(m.group(1)) > 0 and int(m.group(1)) % 32 == 0:
        return (QuantSpec.int4(int(m.group(1)), zero_point=bool(m.group(2))),)
    raise argparse.ArgumentTypeError(f"{arg!r}: expected mxfp4, int4, both, or int4_g<G>[_zp] (G a multiple of 32)")


def interpret_spec(quant: QuantSpec) -> MoESpec:
    E, I, H, k = INTERPRET_SHAPE
    return MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, gate_up="interleaved",
                   activation="swiglu_oai", has_expert_bias=True, has_router_bias=True,
                   score_order="topk_then_score", quant=quant)


def check_spec(spec: MoESpec) -> None:
    """The layers ``pair_reference`` covers: routed experts alone (no shared, latent, zero experts, weight on input,
    expert norms), 4-bit."""
    if spec.quant is None or not spec.quant.packed:
        raise ValueError(f"spec.quant: expected a 4-bit format (mxfp4 / int4), got {spec.quant}")
    extra = [n for n, on in (("shared", spec.shared is not None), ("latent_size", bool(spec.latent_size)),
                             ("zero_experts", bool(spec.zero_experts)), ("weight_on_input", spec.weight_on_input),
                             ("expert_norm", spec.expert_norm != "none")) if on]
    if extra:
        raise ValueError(f"spec: the 4-bit tuner measures routed experts alone; {extra} not supported")


# ------------------------------------------------------------------------------------------------ inputs, reference
def packed_layer(spec: MoESpec, T: int, dtype: torch.dtype, device: torch.device, seed: int) -> tuple:
    """(x [T, H], {op argument: tensor}) of a random layer: router N(0, 2 / sqrt(H)) (bias N(0, 0.5)), expert codes
    uniform bytes, mxfp4 scale bytes in ``MXFP4_SCALE_BYTES`` / int4 scales in ``INT4_SCALES`` (zero points uniform
    0..15), biases N(0, 0.5), x N(0, 1); every tensor drawn on ``device`` in its stored form."""
    check_spec(spec)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    q = spec.quant
    E, H = spec.num_experts, spec.hidden_size

    def randn(*shape, std, dt=dtype):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dt)

    def bytes_(shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.uint8)

    named = dict.fromkeys(MOE_ARGS)
    named["router_w"] = randn(E, H, std=2 / H ** 0.5)
    if spec.has_router_bias:
        named["router_b"] = randn(E, std=0.5)
    if spec.has_correction_bias:
        named["correction_bias"] = randn(E, std=0.05, dt=torch.float32)
    shapes, qshapes = spec.expert_weight_shapes(), spec.quant_shapes()
    for w in ("w13", "w2"):
        named[w] = bytes_(shapes[w])
        s = qshapes[f"{w}_scale"]
        if q.weight == "mxfp4":
            named[f"{w}_scale"] = bytes_(s, *MXFP4_SCALE_BYTES).view(q8.scale_dtype(q))
        else:
            lo, hi = INT4_SCALES
            named[f"{w}_scale"] = (torch.rand(s, generator=g, device=device) * (hi - lo) + lo).to(q8.scale_dtype(q))
            named[f"{w}_zero"] = bytes_(s, 0, 16) if q.zero_point else None
    for b in ("b13", "b2"):
        if b in shapes:
            named[b] = randn(*shapes[b], std=0.5)
    return randn(T, H, std=1.0), named


def scale_args(named: dict) -> dict:
    """The scale / zero-point keyword arguments of the op among ``named``."""
    return {n: named[n] for n in ("w13_scale", "w2_scale", "w13_zero", "w2_zero") if named.get(n) is not None}


def pair_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, named: dict,
                   spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [P, I], y [P, H]) in fp32 for every routed pair p (token p // k, slot p % k), the oracle's arithmetic
    (``reference.experts``, which sums these y over each token's slots): each expert's weights dequantized in fp32
    (``moecomp.core.quant.dequantize``, one expert at a time), h = act(x . w13 + b13) rounded to x's dtype (as the kernels
    store it), y = weight * (h . w2 + b2)."""
    T, k = ids.shape
    I, H, q = spec.intermediate_size, spec.hidden_size, spec.quant
    flat, wflat = ids.reshape(-1).long(), weights.reshape(-1).float()
    h_ref = torch.zeros(flat.numel(), I, dtype=torch.float32, device=x.device)
    y_ref = torch.zeros(flat.numel(), H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        w13 = q8.dequantize(named["w13"][e], named["w13_scale"][e], q, zero=_at(named, "w13_zero", e))
        h = xf[pairs // k] @ w13.T
        del w13
        if named.get("b13") is not None:
            h = h + named["b13"][e].float()
        if spec.gated:
            gate, up = (h[:, :I], h[:, I:]) if spec.gate_up == "concat" else (h[:, 0::2], h[:, 1::2])
            h = reference.spec_gated(gate, up, spec)
        else:
            h = reference.activation(h, spec.activation)
        h = h.to(x.dtype).float()
        h_ref[pairs] = h
        y = h @ q8.dequantize(named["w2"][e], named["w2_scale"][e], q, zero=_at(named, "w2_zero", e)).T
        if named.get("b2") is not None:
            y = y + named["b2"][e].float()
        y_ref[pairs] = y * wflat[pairs, None]
    return h_ref, y_ref


def _at(named: dict, name: str, e: int):
    t = named.get(name)
    return None if t is None else t[e]


# ------------------------------------------------------------------------------------------------ measuring
# (timings: ``tune_io.bench_graph``, the 16-bit tuner's)
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b`` (NaN when ``a`` holds a non-finite value)."""
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@dataclasses.dataclass
class Run:
    """One entry's measuring state: the device, the timing repetitions, the progress callbacks, the counts of
    failed (not compiled / launched) and rejected (wrong) candidates, and the measurements made (``memo``)."""
    device: torch.device
    rep_ms: float
    status: object
    note: object
    failed: int = 0
    rejected: int = 0
    memo: dict = dataclasses.field(default_factory=dict)

    def measure(self, key, fn, ref: torch.Tensor, label: str, rows=None) -> tuple[float, float] | None:
        """(ms, error) of one candidate, None when it fails or is rejected: ``fn()`` run once (``rows`` of its
        output, a boolean mask or indices, checked against ``ref``), then timed in a CUDA graph. Measured once per
        ``key``."""
        if key in self.memo:
            return self.memo[key]
        try:
            out = fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:  # (a tile out of shared memory or registers: skipped, counted, named with -v)
            self.note(f"skip {label}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            self.failed += 1
            self.memo[key] = None
            return None
        err = rel_err(out if rows is None else out[rows], ref)
        if not err <= REL_TOL:
            self.note(f"REJECT {label}: rel err {err:.2e} against the dequantized reference")
            self.rejected += 1
            self.memo[key] = None
            return None
        self.memo[key] = (bench_graph(fn, self.rep_ms, self.device), err)
        return self.memo[key]


def _key(c: dict) -> tuple:
    return tuple(sorted(c.items()))


# ------------------------------------------------------------------------------------------------ candidates
def block_ms(T: int, k: int, E: int) -> list[int]:
    """BLOCK_M candidates (``tune.block_ms``): up to twice the mean rows per active expert (rounded up to a power of
    two), >= 16."""
    rows = T * k / max(1, min(E, T * k))
    cap = max(16, 2 * (1 << max(0, int(rows) - 1).bit_length()))
    return [bm for bm in (16, 32, 64, 128) if bm <= cap]


def form_candidates(quant: QuantSpec, device: torch.device) -> list[tuple[str, dict]]:
    """(label, config keys) of each K-step form measured (``ops/triton_quant4.py``): the interpreter two (interleave,
    split); CUDA mxfp4 dot_scaled (the default), interleave, split, asm; int4 interleave (the default), split, and
    interleave with the scale folded into the weight tile (one rounding of each scaled weight to x's dtype: within
    ``REL_TOL``, which the check holds it to)."""
    if device.type != "cuda":
        return [("interleave", {"w4_form": "interleave"}), ("split", {"w4_form": "split"})]
    if quant.weight == "mxfp4":
        return [(f, {"w4_form": f}) for f in ("dot_scaled", "interleave", "split", "asm")]
    return [("interleave", {"w4_form": "interleave"}), ("split", {"w4_form": "split"}),
            ("interleave+fold", {"w4_form": "interleave", "w4_fold": 1})]


def tiles_at(tiles: list, bm: int) -> list:
    """The tiles measured at BLOCK_M ``bm``: 8 warps from BLOCK_M 64, BLOCK_N 16 up to BLOCK_M 32 (``Q4_TILES``)."""
    return [t for t in tiles if (t[2] < 8 or bm >= 64) and (t[0] > 16 or bm <= 32)]


def tile_config(tile, bm: int) -> dict:
    """A (BLOCK_N, BLOCK_K, num_warps, num_stages) tuple as a GEMM config (GROUP_M 8 from BLOCK_M 64, else 1)."""
    bn, bk, nw, ns = tile
    return dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if bm >= 64 else 1, num_warps=nw, num_stages=ns)


def fitted(configs: list[dict], q: dict) -> list[dict]:
    """The configs with the BLOCK_K the 4-bit launch takes (``triton_quant4.tile``: a divisor of the int4 group,
    or with the scale folded a multiple), duplicates dropped (order kept)."""
    out = {}
    for c in configs:
        c = triton_quant4.tile(c, q)
        out.setdefault(_key(c), c)
    return list(out.values())


def tile_str(c: dict) -> str:
    return f"{c['BLOCK_N']}x{c['BLOCK_K']}/w{c['num_warps']}s{c['num_stages']}"


def baseline(T: int, spec: MoESpec, device: torch.device, tiles: dict) -> dict:
    """The config the forms are compared at: the static heuristic's (``tuning._quant4_heuristic``, what the op runs
    without a table entry) on CUDA; under the interpreter the largest BLOCK_M candidate with the first tiles."""
    k, E = spec.top_k, spec.num_experts
    if device.type == "cuda":
        return tuning._quant4_heuristic(T, k, E, spec.quant)
    bm = block_ms(T, k, E)[-1]
    return dict(BLOCK_M=bm, g1=tile_config(tiles["g1"][0], bm), g2=tile_config(tiles["g2"][0], bm))


# ------------------------------------------------------------------------------------------------ the aligned path
def tune_aligned(spec: MoESpec, x: torch.Tensor, named: dict, run: Run, tiles: dict) -> dict:
    """The aligned path's config for x's T tokens (module docstring): the forms at ``baseline``, then BLOCK_M and
    the tiles in the fastest form. Returns {"config", "ms", "align_ms", "g1_ms", "g2_ms", "err", "block_m_ms",
    "form_ms"}; TuneError when no candidate ran."""
    from ..ops import triton_moe

    T, E, k = x.shape[0], spec.num_experts, spec.top_k
    logits, _ = triton_moe.router_logits(x, named, spec)
    ids, weights = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    h_ref, y_ref = pair_reference(x, ids, weights, named, spec)
    ctx = (spec, x, named, ids, weights, h_ref, y_ref, run)
    base = baseline(T, spec, run.device, tiles)
    form_ms, forms = {}, dict(form_candidates(spec.quant, run.device))
    for label, keys in forms.items():
        run.status(f"form {label}")
        r = _measure_bm(ctx, base["BLOCK_M"], {"g1": [base["g1"]], "g2": [base["g2"]]}, label, keys)
        if r is not None:
            form_ms[label] = r["ms"]
            run.note(f"T={T:5d} form {label:16s} {r['ms'] * 1e3:8.1f} us at BM={base['BLOCK_M']} "
                     f"{tile_str(r['g1'])} / {tile_str(r['g2'])}")
    if not form_ms:
        raise TuneError(f"T={T}: no K-step form ran at the baseline tiles ({run.failed} failed, "
                        f"{run.rejected} rejected)")
    form = min(form_ms, key=form_ms.get)
    best, per_bm = None, {}
    for bm in sorted(set(block_ms(T, k, E)[-MAX_BLOCK_MS:]) | {base["BLOCK_M"]}):
        at_bm = {w: [tile_config(t, bm) for t in tiles_at(tiles[w], bm)] for w in ("g1", "g2")}
        if bm == base["BLOCK_M"]:  # the baseline's tiles are candidates too (measured already)
            at_bm = {w: [base[w]] + at_bm[w] for w in at_bm}
        r = _measure_bm(ctx, bm, at_bm, form, forms[form])
        if r is None:
            continue
        per_bm[str(bm)] = r["ms"]
        if best is None or r["ms"] < best["ms"]:
            best = r
    if best is None:
        raise TuneError(f"T={T}: no BLOCK_M candidate ran ({run.failed} failed, {run.rejected} rejected)")
    config = dict(BLOCK_M=best["bm"], g1=best["g1"], g2=best["g2"], **forms[form])
    return dict(config=config, ms=best["ms"], align_ms=best["align_ms"], g1_ms=best["g1_ms"], g2_ms=best["g2_ms"],
                err=best["err"], block_m_ms=per_bm, form_ms=form_ms)


def _measure_bm(ctx, bm: int, cands: dict, form: str, keys: dict) -> dict | None:
    """One BLOCK_M in one form: align, then gemm1's candidates (``cands["g1"]``), then gemm2's on gemm1's winner.
    {"bm", "ms" (align + gemm1 + gemm2), "align_ms", "g1_ms", "g2_ms", "g1", "g2", "err": [gemm1's, gemm2's]}, or
    None when no candidate of a GEMM ran."""
    from ..ops import triton_moe

    spec, x, named, ids, weights, h_ref, y_ref, run = ctx
    T, E, k = x.shape[0], spec.num_experts, spec.top_k
    P = T * k
    q1, q2 = triton_moe.expert_quant(named, spec, keys, T)
    aligned = triton_moe.align(ids, E, bm)
    # gemm1 writes no padding row and no row past num_padded: its candidates are compared on the real rows
    real = (aligned[0] < P) & (torch.arange(aligned[0].numel(), device=x.device) < aligned[2])
    h_ref_sorted = h_ref[aligned[0][real].long()]
    t_align = bench_graph(lambda: triton_moe.align(ids, E, bm), run.rep_ms, run.device)
    best = {}
    for which, q in (("g1", q1), ("g2", q2)):
        todo = fitted(cands[which], q)
        for i, c in enumerate(todo):
            run.status(f"BM={bm} {form} {which} {i + 1}/{len(todo)}")
            if which == "g1":
                fn = lambda c=c: triton_moe.gemm1(x, named["w13"], named["b13"], spec, aligned, k, bm, c,  # noqa: E731
                                                  q1, weights=weights)
                key, ref, rows = ("g1", bm, form, _key(c)), h_ref_sorted, real
            else:
                fn = lambda c=c: triton_moe.gemm2(h, named["w2"], named["b2"], weights, spec, aligned, P, bm,  # noqa
                                                  c, q2)
                key, ref, rows = ("g2", bm, form, _key(c), _key(best["g1"][1])), y_ref, None
            r = run.measure(key, fn, ref, f"T={T} BM={bm} {form} {which} {tile_str(c)}", rows)
            if r is not None and (which not in best or r[0] < best[which][0]):
                best[which] = (r[0], c, r[1])
        if which not in best:
            run.note(f"T={T} BM={bm} {form}: no {which} candidate ran")
            return None
        if which == "g1":
            h = triton_moe.gemm1(x, named["w13"], named["b13"], spec, aligned, k, bm, best["g1"][1], q1,
                                 weights=weights)
    (t1, c1, e1), (t2, c2, e2) = best["g1"], best["g2"]
    run.note(f"T={T:5d} BM={bm:3d} {form:16s} align {t_align * 1e3:7.1f} us  g1 {t1 * 1e3:8.1f} us  "
             f"g2 {t2 * 1e3:8.1f} us  {tile_str(c1)} / {tile_str(c2)}")
    return dict(bm=bm, ms=t_align + t1 + t2, align_ms=t_align, g1_ms=t1, g2_ms=t2, g1=c1, g2=c2, err=[e1, e2])
