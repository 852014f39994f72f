"""The decode path of the 4-bit tuner (``python -m moecomp tune --quant4``; ``tune_quant4.py`` measures the aligned
path): for a token bucket below ``DECODE_BUCKETS_BELOW`` tokens, which decode kernels, with which tiles, up to how
many tokens.

    at the bucket's T (the first probe), each candidate checked against the dequantized reference (``REL_TOL``):
      GEMV   (``ops/triton_quant4_gemv.py``, when its layout holds) gemv1's tiles (``gemv_candidates``: the
             launcher's own tiles for this T, and those with one knob changed: BLOCK_N / 2 and x 2, BLOCK_K / 2 and
             x 2, the other warp count, REDUCE_END and PREFETCH flipped), then gemv2's on gemv1's winner; then on
             CUDA the inline-PTX conversions (decode entry ``w4_asm``: 1) on both, kept when the pair is faster
      dot    the DIRECT dot kernels (``triton_moe.gemm1`` DIRECT, ``decode_down`` "fused" or "pairs"):
             ``Q4_DECODE_TILES`` and the aligned winner's tiles
    at T, 2T, 4T, 8T (below the next bucket, up to 64: ``decode_probes``): the routed step (``triton_moe.routed``)
    on each decode kernel set and on the aligned path (the bucket's tuned config), checked against the reference;
    "mode" (the decode entry's "gemv" | "dot") is the faster set at T, ``max_t`` the largest probe up to which it
    beat the aligned path at every probe (0: never; the probes stop at its first loss)

The decode entry: {"max_t", "mode", "g1", "g2" (DIRECT tiles; g2 with its "mode" fused | pairs), "gemv1", "gemv2"
(``triton_quant4_gemv.TILE_KEYS``)[, "w4_asm": 1]}: what ``tuning.decode_config`` and ``triton_moe.routed`` read
(the GEMV tiles stay as a fallback in "dot" mode, the DIRECT ones in "gemv" mode where the GEMV layout fails).
"""

from __future__ import annotations

import torch

from .tune_quant4 import Run, TuneError, fitted, pair_reference, tile_config, tile_str

DECODE_BUCKETS_BELOW = 64  # buckets under this many tokens also measure the decode path (as the 16-bit tuner)
# DIRECT dot tiles (BLOCK_N, BLOCK_K, num_warps, num_stages[, decode_down mode]); the aligned winner's join them
Q4_DECODE_TILES = {"g1": [(16, 128, 4, 4), (32, 128, 4, 4)],
                   "g2": [(32, 128, 4, 4, "fused"), (64, 128, 4, 3, "pairs")]}
INTERPRET_DECODE_TILES = {"g1": [(16, 32, 4, 1)], "g2": [(16, 32, 4, 1, "fused")]}
GEMV_MAX_BLOCK_K = 1024  # (``triton_quant4_gemv.MAX_BLOCK_K``)


def decode_probes(T: int, tokens: list[int]) -> list[int]:
    """T, 2T, 4T, 8T below the next bucket and up to DECODE_BUCKETS_BELOW; [] from DECODE_BUCKETS_BELOW up (as
    ``tune.decode_probes``)."""
    if T >= DECODE_BUCKETS_BELOW:
        return []
    nxt = min([b for b in tokens if b > T] + [DECODE_BUCKETS_BELOW + 1])
    return [T << i for i in range(4) if T << i < nxt]


def gemv_candidates(base: dict, interpret: bool) -> list[dict]:
    """GEMV tiles to measure: ``base`` (the launcher's heuristic), then each with one knob changed; under the
    interpreter ``base`` and BLOCK_N doubled."""
    bn, bk = base["BLOCK_N"], base["BLOCK_K"]
    out = [base, dict(base, BLOCK_N=bn * 2)]
    if not interpret:
        out += [dict(base, BLOCK_N=max(4, bn // 2)), dict(base, BLOCK_K=max(32, bk // 2)),
                dict(base, BLOCK_K=min(GEMV_MAX_BLOCK_K, bk * 2)),
                dict(base, num_warps=8 if base["num_warps"] == 4 else 4),
                dict(base, REDUCE_END=1 - base["REDUCE_END"]), dict(base, PREFETCH=1 - base["PREFETCH"])]
    return list({tuple(sorted(c.items())): c for c in out}.values())


def _gemv_str(c: dict) -> str:
    return (f"{c['BLOCK_N']}x{c['BLOCK_K']}/w{c['num_warps']}s{c['num_stages']}"
            f"{'' if c['REDUCE_END'] else '/reduce-step'}{'/prefetch' if c['PREFETCH'] else ''}")


class _Step:
    """One token count's routing, reference and 4-bit kernel arguments."""

    def __init__(self, spec, x_all: torch.Tensor, T: int, named: dict, cfg: dict):
        from ..ops import triton_moe

        self.spec, self.named, self.x = spec, named, x_all[:T]
        logits, _ = triton_moe.router_logits(self.x, named, spec)
        self.ids, self.weights = triton_moe.route(logits, named["correction_bias"], spec, self.x.dtype)
        self.h_ref, y_ref = pair_reference(self.x, self.ids, self.weights, named, spec)
        self.out_ref = y_ref.view(T, spec.top_k, spec.hidden_size).sum(1)
        self.flat = triton_moe.direct(self.ids)[0]
        self.q1, self.q2 = triton_moe.expert_quant(named, spec, cfg, T)

    def out(self) -> torch.Tensor:
        return torch.empty_like(self.x)


def _tune_gemv(s: _Step, run: Run) -> tuple[dict, dict] | None:
    """The GEMV kernels' decode keys ({"gemv1", "gemv2"[, "w4_asm"]}) and their timings, or None (no candidate)."""
    from ..ops import triton_quant4_gemv as gemv

    spec, named, x, T = s.spec, s.named, s.x, s.x.shape[0]
    I, H, k = spec.intermediate_size, spec.hidden_size, spec.top_k
    interp = run.device.type != "cuda"
    best, ms = {}, {}
    base1 = gemv.tiles("gemv1", 2 if spec.gated else 1, T * k, I, H, run.device)
    for i, c in enumerate(cands := gemv_candidates(base1, interp)):
        run.status(f"decode gemv1 {i + 1}/{len(cands)}")
        fn = lambda c=c: gemv.gemm1(x, named["w13"], named["b13"], spec, s.flat, k, s.q1, s.weights,  # noqa: E731
                                    {"gemv1": c})
        r = run.measure(("gemv1", T, tuple(sorted(c.items()))), fn, s.h_ref, f"decode T={T} gemv1 {_gemv_str(c)}")
        if r is not None:
            run.note(f"decode T={T} gemv1 {_gemv_str(c)}: {r[0] * 1e3:.1f} us")
            if "gemv1" not in best or r[0] < ms["gemv1"]:
                best["gemv1"], ms["gemv1"] = c, r[0]
    if "gemv1" not in best:
        return None
    h = gemv.gemm1(x, named["w13"], named["b13"], spec, s.flat, k, s.q1, s.weights, {"gemv1": best["gemv1"]})
    wflat = s.weights.reshape(-1)
    base2 = gemv.tiles("gemv2", 1, T, H, I, run.device)
    for i, c in enumerate(cands := gemv_candidates(base2, interp)):
        run.status(f"decode gemv2 {i + 1}/{len(cands)}")
        fn = lambda c=c, o=s.out(): gemv.decode_down(h, named["w2"], named["b2"], s.flat, wflat, spec, o,  # noqa
                                                     None, None, s.q2, {"gemv2": c})
        r = run.measure(("gemv2", T, tuple(sorted(c.items())), tuple(sorted(best["gemv1"].items()))), fn,
                        s.out_ref, f"decode T={T} gemv2 {_gemv_str(c)}")
        if r is not None:
            run.note(f"decode T={T} gemv2 {_gemv_str(c)}: {r[0] * 1e3:.1f} us")
            if "gemv2" not in best or r[0] < ms["gemv2"]:
                best["gemv2"], ms["gemv2"] = c, r[0]
    if "gemv2" not in best:
        return None
    if run.device.type == "cuda":  # the inline-PTX conversions, both launches (one decode key)
        pair = {}
        for asm in (0, 1):
            dec = dict(best, w4_asm=asm)
            fn = lambda dec=dec, o=s.out(): gemv.routed(x, s.flat, s.weights, named, spec, o, None, None,  # noqa
                                                        dec, s.q1, s.q2)
            r = run.measure(("gemv_asm", T, asm), fn, s.out_ref, f"decode T={T} gemv w4_asm={asm}")
            if r is not None:
                pair[asm] = r[0]
        ms["asm"] = [pair.get(0), pair.get(1)]
        if 1 in pair and (0 not in pair or pair[1] < pair[0]):
            best["w4_asm"] = 1
    return best, ms


def _tune_dot(s: _Step, run: Run, aligned_cfg: dict, tiles: dict) -> tuple[dict, dict] | None:
    """The DIRECT dot kernels' decode tiles ({"g1", "g2"}) and their timings, or None (no candidate ran)."""
    from ..ops import triton_moe

    spec, named, x, T, k = s.spec, s.named, s.x, s.x.shape[0], s.spec.top_k
    d = (s.flat, None, None, s.flat.numel())
    own = {w: (aligned_cfg[w]["BLOCK_N"], aligned_cfg[w]["BLOCK_K"], aligned_cfg[w]["num_warps"],
               aligned_cfg[w]["num_stages"]) for w in ("g1", "g2")}
    best, ms = {}, {}
    g1s = fitted([tile_config(t, 16) for t in list(tiles["g1"]) + [own["g1"]]], s.q1)
    for i, c in enumerate(g1s):
        run.status(f"decode g1 {i + 1}/{len(g1s)}")
        fn = lambda c=c: triton_moe.gemm1(x, named["w13"], named["b13"], spec, d, k, 16, c, s.q1,  # noqa: E731
                                          weights=s.weights)
        r = run.measure(("dot g1", T, tuple(sorted(c.items()))), fn, s.h_ref, f"decode T={T} g1 {tile_str(c)}")
        if r is not None and ("g1" not in best or r[0] < ms["g1"]):
            best["g1"], ms["g1"] = c, r[0]
    if "g1" not in best:
        return None
    h = triton_moe.gemm1(x, named["w13"], named["b13"], spec, d, k, 16, best["g1"], s.q1, weights=s.weights)
    wflat = s.weights.reshape(-1)
    g2s = fitted([dict(tile_config(t[:4], 16), mode=t[4]) for t in list(tiles["g2"]) + [own["g2"] + ("pairs",)]],
                 s.q2)
    for i, c in enumerate(g2s):
        run.status(f"decode g2 {i + 1}/{len(g2s)}")
        fn = lambda c=c, o=s.out(): triton_moe.decode_down(h, named["w2"], named["b2"], s.flat, wflat, spec,  # noqa
                                                           o, None, None, c, q=s.q2)
        r = run.measure(("dot g2", T, tuple(sorted(c.items())), tuple(sorted(best["g1"].items()))), fn, s.out_ref,
                        f"decode T={T} g2 {tile_str(c)} {c['mode']}")
        if r is not None and ("g2" not in best or r[0] < ms["g2"]):
            best["g2"], ms["g2"] = c, r[0]
    return (best, ms) if "g2" in best else None


def tune_decode(spec, probes: list[int], x_all: torch.Tensor, named: dict, aligned_cfg: dict, run: Run,
                tiles: dict) -> dict:
    """The decode entry of one bucket (module docstring). Returns {"decode": entry, "ms": {T: {"gemv" | "dot" |
    "aligned": ms}}, "tiles_ms": {launch: ms}}; TuneError when neither decode kernel set has a working candidate."""
    from ..ops import triton_moe
    from ..ops import triton_quant4_gemv as gemv

    s = _Step(spec, x_all, probes[0], named, aligned_cfg)
    kinds, tiles_ms = {}, {}
    g = _tune_gemv(s, run) if gemv.layout_ok(s.x, named["w13"], named["w2"]) else None
    dot = _tune_dot(s, run, aligned_cfg, tiles)
    if g is None and dot is None:
        raise TuneError(f"decode T={probes[0]}: no GEMV or DIRECT candidate ran ({run.failed} failed, "
                        f"{run.rejected} rejected)")
    # (without working DIRECT tiles a GEMV entry keeps the aligned winner's, for calls whose layout refuses GEMV)
    direct = dot[0] if dot else {"g1": aligned_cfg["g1"], "g2": dict(aligned_cfg["g2"], mode="pairs")}
    if g is not None:
        kinds["gemv"] = dict(mode="gemv", **direct, **g[0])
        tiles_ms.update(g[1])
    if dot is not None:
        kinds["dot"] = dict(mode="dot", **direct, **(g[0] if g else {}))
        tiles_ms.update(dot[1])
    kinds["aligned"] = None
    ms, mode, max_t = {}, None, 0
    for T in probes:
        st = s if T == probes[0] else _Step(spec, x_all, T, named, aligned_cfg)
        names = list(kinds) if mode is None else [mode, "aligned"]
        ms[T] = {}
        for name in names:
            run.status(f"decode vs aligned T={T}: {name}")
            dec = dict(max_t=0) if kinds[name] is None else dict(kinds[name], max_t=1 << 30)
            cfg = dict(aligned_cfg, decode=dec)
            fn = lambda cfg=cfg, o=st.out(): triton_moe.routed(st.x, st.ids, st.weights, named, spec, o,  # noqa
                                                               cfg=cfg)
            r = run.measure(("routed", name, T), fn, st.out_ref, f"decode T={T} routed {name}")
            if r is not None:
                ms[T][name] = r[0]
        run.note(f"T={T:3d}: " + "  ".join(f"{n} {v * 1e3:7.1f} us" for n, v in ms[T].items()))
        if mode is None:
            found = {n: v for n, v in ms[T].items() if n != "aligned"}
            if not found:
                break
            mode = min(found, key=found.get)
        if mode not in ms[T] or "aligned" not in ms[T] or ms[T][mode] >= ms[T]["aligned"]:
            break
        max_t = T
    mode = mode or ("gemv" if "gemv" in kinds else "dot")
    return dict(decode=dict(kinds[mode], max_t=max_t), ms={str(t): v for t, v in ms.items()}, tiles_ms=tiles_ms)
