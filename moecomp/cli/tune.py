"""``python -m moecomp tune``: measure the grouped-GEMM configs on this GPU and write the JSON table read at run time.

For each shape (a layer preset of ``moecomp.testing.LAYER_PRESETS`` or ``--shape E,I,H,k``) and each token-count
bucket: route once, then for every BLOCK_M candidate align the tokens and time each gemm1 candidate and each gemm2
candidate on their own (``triton.testing.do_bench`` medians, L2 flushed). Each candidate is checked against the
first one that ran (relative error), so a broken config is never chosen; the best (align + gemm1 + gemm2) wins.

Output: ``moecomp/kernels/configs/<gpu>.json`` by default (``ops.tuning.device_key``), the format that
``moecomp.ops.tuning`` documents and looks up: ``"E=<E>,N=<I>,K=<H>,dtype=<dtype>"`` -> ``{"<bucket>": config}``.
``tuning.get_config`` reads every key of a shape's table as a bucket (``int(key)``), so no ``"_meta"`` key can go
there: the measurements (best total ms, per GEMM, per BLOCK_M; date, commit, torch, triton, device) go to a sidecar
``<gpu>.meta.json`` next to the table, of the same layout (shape key -> bucket -> record), which nothing reads at
run time.

* Resumable: the file is rewritten (temporary file + ``os.replace``, merged with what is on disk, so entries of
  other shapes stay) after every finished (shape, bucket); a rerun skips the entries already there unless
  ``--restart``. Ctrl-C or ``--budget-s`` leave a valid file; rerun the same command to go on.
* Progress on stderr: one line redrawn with ``\\r`` on a terminal; otherwise one line per finished bucket.
* Exit status: 0 done, 1 an entry found no working candidate, 3 stopped by ``--budget-s`` (rerun to resume),
  130 interrupted (Ctrl-C), 2 refused (no CUDA and no ``--interpret``).

``--fp8 both|plain|lean|prequant|w8a8|w8a16``: the FP8 experts' tables (``dtype=fp8``: each bucket's fastest mode,
its config's "fp8" key saying which, with the speed candidates that won, "fp8_prequant" / "fp8_fold"; "prequant":
w8a8+prequant alone, into ``dtype=fp8``; ``dtype=fp8_<mode>``: one mode), FP8 tiles (BLOCK_K 128), TMA tiles under
prequant (``tune_fp8.FP8_TILES``).

``--interpret`` (tests only): CPU tensors through the Triton interpreter (``TRITON_INTERPRET=1``), a tiny shape,
two candidates per GEMM and wall-clock timings that mean nothing; it exercises the plumbing, not the GPU.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time

import torch

from ..ops import tuning
from ..core.spec import MoESpec
from .tune_fp8 import (  # noqa: F401  (re-exported: tests and tools use them through this module)
    FP8_CHOICES, FP8_DECODE_TILES, FP8_TILES, FP8_VARIANT_KEYS, FP8_VARIANTS, as_quantized as _as_quantized, mode_keys)
from .tune_args import (  # noqa: F401  (re-exported: tests read them through this module)
    DTYPES, INTERPRET_SHAPE, INTERPRET_TOKENS, TOKENS, arg_parser, resolve_out, setup_device, tune_jobs)
from .tune_io import (  # noqa: F401  (re-exported: tests and tools use them through this module)
    Progress, bench, bench_graph, fmt_seconds as _fmt_s, is_done as _done, meta_path, read_json, save_entry, source_commit as _commit,
    write_json_atomic)
from .tune_quant4_run import run_quant4

# (BLOCK_N, BLOCK_K, num_warps, num_stages); gemm1's weight tile is 2 * BLOCK_N wide (gate and up columns)
# A fifth field makes a tile a TMA one (``kernels/grouped_gemm_tma.py``), tried at BLOCK_M >= TMA_MIN_BLOCK_M on
# 16-bit dtypes only: "tma" (weights by TMA; gemm1's x rows by pointer loads), or on gemm1 "tma_a" (x gathered into
# sorted order first and read by TMA too, warp-specialised). gemm1's were 1.16-1.20x faster than the table's pointer
# tiles on Mixtral, Qwen3, OLMoE, DeepSeek-V3 at T=1024 / 8192 (H200, diag_kernels.py --parts tma, e2dab59).
TILES = {
    "g1": [(16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 64, 8, 4),
           (64, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 3, "tma"), (128, 64, 8, 4, "tma"),
           (128, 64, 8, 3, "tma_a")],
    "g2": [(32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3),
           (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 3, "tma"),
           (256, 64, 8, 4, "tma"), (128, 128, 8, 3, "tma")],
}
TMA_MIN_BLOCK_M = 64
# The decode path (``triton_moe.routed``): DIRECT gemm1 tiles (as above) and ``decode_down`` tiles (..., mode):
# "fused" = the down-combine kernel, "pairs" = gemm2 DIRECT + combine.
DECODE_TILES = {
    "g1": [(16, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (32, 64, 4, 6)],
    "g2": [(16, 256, 4, 3, "fused"), (32, 128, 4, 4, "fused"), (32, 256, 4, 3, "fused"), (64, 128, 4, 3, "fused"),
           (32, 128, 4, 4, "pairs"), (64, 128, 4, 3, "pairs"), (32, 256, 4, 3, "pairs"), (128, 64, 4, 4, "pairs")],
}
DECODE_BUCKETS_BELOW = 64  # buckets under this many tokens also measure the decode path
# --interpret: two candidates per GEMM (the interpreter runs every program in Python; the shape: tune_args)
INTERPRET_TILES = {"g1": [(16, 32, 4, 1), (32, 32, 4, 1)], "g2": [(16, 32, 4, 1), (32, 32, 4, 1)]}
INTERPRET_DECODE_TILES = {"g1": [(16, 32, 4, 1), (32, 32, 4, 1)],
                          "g2": [(16, 32, 4, 1, "fused"), (16, 32, 4, 1, "pairs")]}
REL_TOL = 1e-2  # a candidate further than this from the first one is rejected
EXIT_BUDGET, EXIT_INTERRUPTED, EXIT_REFUSED = 3, 130, 2


class TuneError(RuntimeError):
    """No candidate ran for an entry (every tile out of resources, or rejected)."""


# --------------------------------------------------------------------------------------------------- measuring
def block_ms(T: int, k: int, E: int) -> list[int]:
    """BLOCK_M candidates: up to twice the mean rows per active expert (rounded up to a power of two), >= 16."""
    rows = T * k / max(1, min(E, T * k))
    cap = max(16, 2 * (1 << max(0, int(rows) - 1).bit_length()))
    return [bm for bm in (16, 32, 64, 128) if bm <= cap]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _run_checked(fn, ref_out, label: str, note, device: torch.device, rows=None, norm=None):
    """Run one candidate once: ("failed", None) when it does not compile or launch (out of shared memory or
    registers for its tile), ("rejected", out) when its output (``norm(out)`` if given, ``rows`` of it if given) is
    further than REL_TOL from ``ref_out`` (the first candidate that ran), else ("ok", out)."""
    try:
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        note(f"skip {label}: {type(e).__name__}")
        return "failed", None
    if norm is not None:
        out = norm(out)
    elif hasattr(out, "dequantize") and not torch.is_tensor(out):  # gemm1's h quantized by its epilogue (a QAct)
        out = out.dequantize()
    if rows is not None:
        out = out[rows]
    if ref_out is not None and _rel(out, ref_out) > REL_TOL:
        note(f"REJECT {label}: rel err {_rel(out, ref_out):.2e}")
        return "rejected", out
    return "ok", out


def _tile(c: dict) -> str:
    """A GEMM config in short: BLOCK_NxBLOCK_K/w<num_warps>s<num_stages>[/tma|/tma_a][@<programs per SM>] (GROUP_M
    follows BLOCK_M)."""
    kind = "/gluon" if c.get("gluon") else "/tma_a" if c.get("tma_a") else "/tma" if c.get("tma") else ""
    per_sm = f"@{c['per_sm']}" if c.get("per_sm", 1) != 1 else ""
    return f"{c['BLOCK_N']}x{c['BLOCK_K']}/w{c['num_warps']}s{c['num_stages']}{kind}{per_sm}"


def _config(tile, bm: int) -> dict:
    """A tile tuple as a GEMM config; a fifth field "tma" / "tma_a", optionally "@<n>" (n persistent programs per SM:
    the FP8 TMA kernels' "per_sm"), or "gluon" (FP8 only: the Gluon GEMM, ``ops/triton_fp8_gluon.py``, on the TMA
    path; its own fixed tile, the TMA kernel's where it does not take the call)."""
    bn, bk, nw, ns, *kind = tile
    c = dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if bm >= 64 else 1, num_warps=nw, num_stages=ns)
    name, _, per_sm = (kind[0] if kind else "").partition("@")
    if name in ("tma", "tma_a", "gluon"):
        c["tma"] = 1
    if name == "gluon":
        c["gluon"] = 1
    if name == "tma_a":
        c["tma_a"] = 1
    if per_sm:
        c["per_sm"] = int(per_sm)
    return c


def _tiles_for(cands: list, bm: int, dtype: torch.dtype, quantized: bool = False, prequant: bool = False,
               gluon: bool = False) -> list:
    """The candidates that apply at this BLOCK_M and dtype: TMA tiles only from TMA_MIN_BLOCK_M, with 16-bit
    activations, and for fp8 weights only under prequant (the FP8 TMA kernels read activations quantized once);
    "gluon" tiles only where ``gluon`` (the device runs the Gluon FP8 GEMMs: ``gluon_tiles_ok``) and for fp8 weights."""
    tma_ok = bm >= TMA_MIN_BLOCK_M and dtype in (torch.bfloat16, torch.float16) and (not quantized or prequant)
    return [t for t in cands if len(t) == 4 or tma_ok and (t[4] != "gluon" or gluon and quantized)]


def gluon_tiles_ok(device: torch.device) -> bool:
    """Whether "gluon" candidates run on ``device``: compute capability 9.x and a Triton whose Gluon has every name
    the kernels use (``triton_fp8_gluon.gluon_api``)."""
    from ..ops import triton_fp8_gluon

    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and triton_fp8_gluon.gluon_api() is None and triton_fp8_gluon.gluon_api(gemm1=True) is None)


def _tune_args(spec: MoESpec, T: int, dtype: torch.dtype, device: torch.device, seed: int):
    """(x, {argument: tensor}) for a measurement: ``random_moe_args`` (std 0.02), the experts quantized (with their
    scales) when the spec says; no shared-expert gate (the routed path is tuned)."""
    from ..testing import quantize_moe_args, random_moe_args

    args = random_moe_args(spec, T, dtype, device, std=0.02, seed=seed)
    args, scales = quantize_moe_args(spec, args) if spec.quant is not None else (args, {})
    named = dict(zip(("router_w", "router_b", "correction_bias", "w13", "b13", "w2", "b2"), args[1:8]))
    return args[0], dict(named, shared_gate_w=None, **scales)


def tune_entry(spec: MoESpec, T: int, dtype: torch.dtype, device: torch.device, tiles: dict, rep_ms: float = 25,
               status=None, note=None, mode: str | None = None) -> dict:
    """Measure one (shape, bucket). Returns ``{"config", "ms", "align_ms", "g1_ms", "g2_ms", "block_m_ms",
    "rejected", "failed"}`` (ms: the winner's align + gemm1 + gemm2). ``status(text)`` is called before each
    candidate, ``note(text)`` for every rejected or failing candidate and every BLOCK_M measured. ``mode``: the FP8
    mode of a quantized spec ("w8a8" | "w8a16", with "+<candidate>"s: ``mode_keys``, which the config gets)."""
    from ..ops import triton_moe

    status = status or (lambda text: None)
    note = note or (lambda text: None)
    x, named = _tune_args(spec, T, dtype, device, seed=T)
    w13, b13, w2, b2 = named["w13"], named["b13"], named["w2"], named["b2"]
    keys = mode_keys(mode)
    q1, q2 = triton_moe.expert_quant(named, spec, keys, T)
    logits, _ = triton_moe.router_logits(x, named, spec)
    ids, weights = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    E, k, P = spec.num_experts, spec.top_k, T * spec.top_k
    gluon_ok = spec.quant is not None and gluon_tiles_ok(device)
    best, per_bm, rejected, failed = None, {}, 0, 0
    for bm in block_ms(T, k, E):
        status(f"BM={bm} align")
        aligned = triton_moe.align(ids, E, bm)
        # gemm1 never writes padding rows or rows past num_padded: its candidates are compared on the real rows
        real_rows = (aligned[0] < P) & (torch.arange(aligned[0].numel(), device=device) < aligned[2])
        t_align = bench_graph(lambda: triton_moe.align(ids, E, bm), rep_ms, device)
        res = {}
        for which in ("g1", "g2"):
            ref_out, best_t, best_c = None, float("inf"), None
            cands = _tiles_for(tiles[which], bm, dtype, spec.quant is not None, bool(keys.get("fp8_prequant")),
                               gluon_ok)
            for i, tile in enumerate(cands):
                c = _config(tile, bm)
                if best:
                    so_far = f"  best so far {best['ms'] * 1e3:.1f} us (BM={best['config']['BLOCK_M']})"
                else:
                    so_far = f"  best {which} so far {best_t * 1e3:.1f} us" if best_c else ""
                status(f"BM={bm} {which} {i + 1}/{len(cands)}{so_far}")
                if which == "g1":
                    fn = lambda c=c: triton_moe.gemm1(x, w13, b13, spec, aligned, k, bm, c, q1,  # noqa: E731
                                                      weights=weights)
                else:
                    h = res["h"]
                    fn = lambda c=c: triton_moe.gemm2(h, w2, b2, weights, spec, aligned, P, bm, c, q2)  # noqa: E731
                norm = _as_quantized if which == "g1" and keys.get("fp8_prequant") else None
                verdict, out = _run_checked(fn, ref_out, f"T={T} BM={bm} {which} {_tile(c)}", note, device,
                                            real_rows if which == "g1" else None, norm)
                failed += verdict == "failed"
                rejected += verdict == "rejected"
                if verdict != "ok":
                    continue
                if ref_out is None:
                    ref_out = out.clone()
                t = bench_graph(fn, rep_ms, device)
                if t < best_t:
                    best_t, best_c = t, c
            res[which] = (best_t, best_c)
            if best_c is None:
                break
            if which == "g1":
                res["h"] = triton_moe.gemm1(x, w13, b13, spec, aligned, k, bm, best_c, q1, weights=weights)
        if res["g1"][1] is None or res.get("g2", (0, None))[1] is None:
            note(f"T={T} BM={bm}: no candidate ran for {'g1' if res['g1'][1] is None else 'g2'}")
            continue
        total = t_align + res["g1"][0] + res["g2"][0]
        per_bm[str(bm)] = total
        note(f"T={T:5d} BM={bm:3d}: align {t_align * 1e3:7.1f} us  g1 {res['g1'][0] * 1e3:8.1f} us  "
             f"g2 {res['g2'][0] * 1e3:8.1f} us  {_tile(res['g1'][1])} / {_tile(res['g2'][1])}")
        if best is None or total < best["ms"]:
            best = dict(config=dict(BLOCK_M=bm, g1=res["g1"][1], g2=res["g2"][1], **keys),
                        ms=total, align_ms=t_align, g1_ms=res["g1"][0], g2_ms=res["g2"][0])
    del named
    if best is None:
        raise TuneError(f"T={T}: no BLOCK_M candidate ran ({failed} failed, {rejected} rejected)")
    return dict(best, block_m_ms=per_bm, rejected=rejected, failed=failed)


def tune_modes(spec: MoESpec, T: int, dtype: torch.dtype, device: torch.device, tiles: dict, rep_ms: float,
               modes: tuple, status=None, note=None) -> dict:
    """``tune_entry`` in each FP8 mode of ``modes`` ((None,): 16-bit), the fastest kept; with several modes its
    record gains "mode_ms" ({mode: ms}). TuneError when no mode found a working candidate."""
    runs, err = {}, None
    for mode in modes:
        try:
            runs[mode] = tune_entry(spec, T, dtype, device, tiles, rep_ms, status=status, note=note, mode=mode)
        except TuneError as e:
            err = e
    if not runs:
        raise err
    best = min(runs.values(), key=lambda r: r["ms"])
    return dict(best, mode_ms={m: r["ms"] for m, r in runs.items()}) if len(modes) > 1 else best


def decode_probes(T: int, tokens: list[int]) -> list[int]:
    """Token counts at which a bucket's decode path is weighed against its aligned path: T, 2T, 4T, 8T below the
    next bucket and up to DECODE_BUCKETS_BELOW; [] for buckets from DECODE_BUCKETS_BELOW up."""
    if T >= DECODE_BUCKETS_BELOW:
        return []
    nxt = min([b for b in tokens if b > T] + [DECODE_BUCKETS_BELOW + 1])
    return [T << i for i in range(4) if T << i < nxt]


def tune_decode(spec: MoESpec, probes: list[int], dtype: torch.dtype, device: torch.device, aligned_cfg: dict,
                tiles: dict, rep_ms: float = 25, status=None, note=None) -> dict:
    """The decode path for one bucket: its tiles at ``probes[0]`` tokens (DIRECT gemm1, then ``decode_down``; the
    candidates of ``tiles`` and the aligned winner's tiles, each checked against the first candidate), then the
    whole routed step (``triton_moe.routed``) on the decode path and on the aligned path (``aligned_cfg``) at every
    probe, both in CUDA graphs. ``max_t`` is the largest probe up to which the decode path won at every probe (0:
    never). Returns ``{"decode": config, "ms": {T: [decode, aligned]}, "rejected", "failed"}``. FP8 (a quantized
    spec): in the mode of ``aligned_cfg["fp8"]``."""
    from ..ops import triton_moe

    status = status or (lambda text: None)
    note = note or (lambda text: None)
    x_all, named = _tune_args(spec, max(probes), dtype, device, seed=max(probes) + 1)
    k, H, rejected, failed = spec.top_k, spec.hidden_size, 0, 0
    q1, q2 = triton_moe.expert_quant(named, spec, aligned_cfg, probes[0])

    def routing(T):
        x = x_all[:T]
        logits, _ = triton_moe.router_logits(x, named, spec)
        return (x, *triton_moe.route(logits, named["correction_bias"], spec, x.dtype))

    x, ids, weights = routing(probes[0])
    d = triton_moe.direct(ids)
    best = {}
    for which in ("g1", "g2"):
        ref_out, best_t = None, float("inf")
        c0 = aligned_cfg[which]  # the aligned path's winner is a candidate too (as gemm1 / gemm2 DIRECT)
        own = (c0["BLOCK_N"], c0["BLOCK_K"], c0["num_warps"], c0["num_stages"]) + (("pairs",) if which == "g2" else ())
        cands = list(tiles[which]) + ([own] if own not in tiles[which] else [])
        for i, tile in enumerate(cands):
            c = _config(tile[:4], 16)
            if which == "g2":
                c["mode"] = tile[4]
            status(f"decode {which} {i + 1}/{len(cands)}")
            if which == "g1":
                fn = lambda c=c: triton_moe.gemm1(x, named["w13"], named["b13"], spec, d, k, 16, c, q1,  # noqa: E731
                                                  weights=weights)
            else:
                out = torch.empty(x.shape[0], H, dtype=dtype, device=device)
                fn = lambda c=c, out=out: triton_moe.decode_down(  # noqa: E731
                    h, named["w2"], named["b2"], d[0], weights.reshape(-1), spec, out, None, None, c, q=q2)
            verdict, got = _run_checked(fn, ref_out, f"decode {which} {_tile(c)}", note, device)
            failed += verdict == "failed"
            rejected += verdict == "rejected"
            if verdict != "ok":
                continue
            if ref_out is None:
                ref_out = got.clone()
            t = bench_graph(fn, rep_ms, device)
            note(f"decode T={probes[0]} {which} {_tile(c)}{' ' + c['mode'] if which == 'g2' else ''}: {t * 1e3:.1f} us")
            if t < best_t:
                best_t, best[which] = t, c
        if which not in best:
            raise TuneError(f"decode T={probes[0]}: no {which} candidate ran ({failed} failed, {rejected} rejected)")
        if which == "g1":
            h = triton_moe.gemm1(x, named["w13"], named["b13"], spec, d, k, 16, best["g1"], q1, weights=weights)

    ms, max_t = {}, 0
    on = dict(aligned_cfg, decode=dict(max_t=1 << 30, g1=best["g1"], g2=best["g2"]))
    off = dict(aligned_cfg, decode=dict(max_t=0))
    for T in probes:
        status(f"decode vs aligned T={T}")
        x, ids, weights = routing(T)
        outs = [torch.empty(T, H, dtype=dtype, device=device) for _ in range(2)]
        fns = [lambda cfg=cfg, o=o: triton_moe.routed(x, ids, weights, named, spec, o, cfg=cfg)
               for cfg, o in ((on, outs[0]), (off, outs[1]))]
        got = [f().clone() for f in fns]
        if _rel(got[0], got[1]) > REL_TOL:
            rejected += 1
            note(f"REJECT decode path at T={T}: rel err {_rel(got[0], got[1]):.2e} against the aligned path")
            break
        ms[T] = [bench_graph(f, rep_ms, device) for f in fns]
        note(f"T={T:3d}: decode {ms[T][0] * 1e3:7.1f} us  aligned {ms[T][1] * 1e3:7.1f} us")
        if ms[T][0] >= ms[T][1]:
            break
        max_t = T
    del named, x_all
    return dict(decode=dict(max_t=max_t, g1=best["g1"], g2=best["g2"]), ms=ms, rejected=rejected, failed=failed)


# -------------------------------------------------------------------------------------------------------- CLI
def _tune_one(a, spec: MoESpec, T: int, dtype, device, tiles: dict, dec_tiles: dict, modes, tokens: list[int],
              prog: Progress, short: str) -> tuple[dict, dict | None]:
    """One entry measured: (tune_modes' result with the decode path in its config, the decode timings or None).
    TuneError when no candidate ran."""
    r = tune_modes(spec, T, dtype, device, tiles, a.rep, modes, status=prog.status, note=prog.note)
    decode_ms = None
    probes = decode_probes(T, tokens)
    if probes:
        try:
            rd = tune_decode(spec, probes, dtype, device, r["config"], dec_tiles, a.rep,
                             status=prog.status, note=prog.note)
            r["config"]["decode"], decode_ms = rd["decode"], {str(t): v for t, v in rd["ms"].items()}
        except TuneError as e:
            prog.note(f"{short} T={T}: decode path not used: {e}", always=True)
            r["config"]["decode"] = dict(max_t=0)
    r["config"]["top_k"] = spec.top_k  # what ops/tuning_nearest.py weighs rows per expert with
    return r, decode_ms


def _save_one(a, path: str, key: str, label: str, T: int, r: dict, decode_ms, stamp: dict, t0: float) -> None:
    """The entry into the table and its sidecar (and their copies under ``--copy-to``)."""
    meta = dict(stamp, ms=r["ms"], align_ms=r["align_ms"], g1_ms=r["g1_ms"], g2_ms=r["g2_ms"],
                decode_ms=decode_ms,
                block_m_ms=r["block_m_ms"], rejected=r["rejected"], failed=r["failed"], preset=label,
                **({"fp8_ms": r["mode_ms"]} if "mode_ms" in r else {}),
                seconds=round(time.time() - t0, 2),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    save_entry(path, key, T, r["config"], meta)
    if a.copy_to:
        os.makedirs(a.copy_to, exist_ok=True)
        for p in (path, meta_path(path)):
            dst = os.path.join(a.copy_to, os.path.basename(p))
            if not (os.path.exists(dst) and os.path.samefile(p, dst)):
                shutil.copyfile(p, dst)


def _summary(short: str, T: int, r: dict, decode_ms, seconds: float) -> str:
    """The progress line of a saved entry: its time, mode, tiles and decode path."""
    c = r["config"]
    extra = "".join(f", {r[n]} {n}" for n in ("rejected", "failed") if r[n])
    dec = ""
    if "decode" in c:
        dec = f"; decode up to T={c['decode']['max_t']}"
        if decode_ms:
            dec += " (" + ", ".join(f"T={t}: {v[0] * 1e3:.1f} vs {v[1] * 1e3:.1f} us" for t, v in
                                    decode_ms.items()) + ")"
    mode = "".join(f" {c[n]}" if n == "fp8" else f" {n[4:]}={c[n]}" for n in c if n.startswith("fp8"))
    if "mode_ms" in r:  # every FP8 variant's best, in us
        mode += " [" + ", ".join(f"{m} {v * 1e3:.1f}" for m, v in r["mode_ms"].items()) + "]"
    return (f"{short} T={T}: {r['ms'] * 1e3:.1f} us{mode} BM={c['BLOCK_M']} g1 {_tile(c['g1'])} g2 "
            f"{_tile(c['g2'])}{dec} ({seconds:.0f} s{extra})")


def _stamp(a, device, dtype) -> tuple[str, dict]:
    """(device name, what every entry's sidecar record says about the run)."""
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    import triton

    commit, dirty = _commit()
    return dev_name, dict(commit=commit, dirty=dirty, torch=torch.__version__, triton=triton.__version__,
                          device=dev_name, dtype=str(dtype).replace("torch.", ""), rep_ms=a.rep,
                          interpret=a.interpret, **({"fp8": a.fp8} if a.fp8 else {}))


def main(argv=None) -> int:
    a = arg_parser().parse_args(argv)
    device = setup_device(a.interpret)
    if device is None:
        return EXIT_REFUSED
    dtype = DTYPES[a.dtype or ("fp32" if a.interpret else "bf16")]
    tokens = [int(t) for t in (a.tokens.split(",") if a.tokens else INTERPRET_TOKENS if a.interpret else TOKENS)]
    if not tokens or min(tokens) < 1:
        raise SystemExit("--tokens: positive token counts, comma-separated")
    tiles = INTERPRET_TILES if a.interpret else FP8_TILES if a.fp8 else TILES
    dec_tiles = INTERPRET_DECODE_TILES if a.interpret else FP8_DECODE_TILES if a.fp8 else DECODE_TILES
    modes = FP8_CHOICES[a.fp8] if a.fp8 else (None,)
    for var, why in (("MOECOMP_DECODE_MAX_T", "the tuner weighs both paths itself"),
                     ("MOECOMP_FP8_MODE", "the tuner sets the mode it measures"),
                     ("MOECOMP_FP8_PREQUANT", "the tuner measures the candidates itself"),
                     ("MOECOMP_FP8_FOLD", "the tuner measures the candidates itself")):
        if os.environ.pop(var, None) is not None:
            print(f"[tune] {var} ignored while tuning ({why})", file=sys.stderr)
    gpu = tuning.device_key(device)
    path = resolve_out(a.out, gpu, a.interpret)
    table = read_json(path)
    read_json(meta_path(path))  # fail now, not after the first entry, when the sidecar does not parse
    if a.quant4:  # 4-bit experts: their presets, candidates and decode kernels (cli/tune_quant4_run.py)
        return run_quant4(a, device, dtype, tokens, path)

    jobs = tune_jobs(a, dtype, tokens)
    todo = [j for j in jobs if a.restart or not _done(table, j[0], j[3])]
    skipped = len(jobs) - len(todo)
    if skipped:
        what = "all entries skipped" if not todo else f"skipping {skipped}/{len(jobs)} entries"
        print(f"[tune] {what}: already in {path} (--restart measures them again)", file=sys.stderr)
    if not todo:
        return 0

    dev_name, stamp = _stamp(a, device, dtype)
    prog = Progress(len(todo), verbose=a.verbose)
    print(f"[tune] {len(todo)} entries ({len({j[0] for j in todo})} shapes) on {dev_name} -> {path}",
          file=sys.stderr)
    t_start, left, status, saved = time.time(), 0, 0, 0
    try:
        for i, (key, label, spec, T) in enumerate(todo):
            if i and a.budget_s is not None and time.time() - t_start > a.budget_s:  # one entry per run at least
                left = len(todo) - i
                break
            short = key.replace(",dtype=", " ").replace("bfloat16", "bf16").replace("float16", "fp16")
            prog.start(f"{short} T={T}")
            t0 = time.time()
            try:
                r, decode_ms = _tune_one(a, spec, T, dtype, device, tiles, dec_tiles, modes, tokens, prog, short)
            except TuneError as e:
                prog.finished(f"{short} T={T}: FAILED, nothing saved: {e}", None)
                status = 1
                continue
            _save_one(a, path, key, label, T, r, decode_ms, stamp, t0)
            saved += 1
            prog.finished(_summary(short, T, r, decode_ms, time.time() - t0), time.time() - t0)
            if device.type == "cuda" and (i + 1 == len(todo) or todo[i + 1][0] != key):
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        prog.close()
        print(f"\n[tune] interrupted: {saved}/{len(todo)} entries saved in {path}; rerun the same command to "
              f"resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    prog.close()
    if left:
        print(f"[tune] budget of {a.budget_s:g} s spent: {left} entries left; rerun the same command to resume "
              f"({path})", file=sys.stderr)
        return EXIT_BUDGET
    print(f"[tune] wrote {path} ({saved} entries, {time.time() - t_start:.0f} s)", file=sys.stderr)
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
