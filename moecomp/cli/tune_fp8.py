"""The FP8 part of ``python -m moecomp tune`` (``--fp8``): its tiles, the modes and speed candidates it measures,
and the config keys a measured mode becomes. ``cli/tune.py`` runs the measurements."""

from __future__ import annotations

import torch

# FP8 (``--fp8``): 128x128 block scales, dynamic activations (the checkpoints' format); BLOCK_K 128 tiles (the
# activation group). "--fp8 both" measures each bucket in both modes (w8a8, w8a16), each with its speed candidates,
# and keeps the fastest, its keys in the config ("fp8", "fp8_prequant", "fp8_fold"; table key "dtype=fp8");
# "--fp8 w8a8" / "--fp8 w8a16" one mode ("dtype=fp8_<mode>", read when MOECOMP_FP8_MODE forces it); "--fp8 prequant"
# w8a8+prequant alone (dtype=fp8: the many-token buckets, where it has won every entry tuned so far).
# TMA tiles (fifth field, as in ``tune.TILES``: ``kernels/grouped_gemm_tma_fp8.py``) are tried only with prequant (the
# FP8 TMA kernels read activations quantized once) and from ``tune.TMA_MIN_BLOCK_M`` rows. Their accumulator and each
# K step's product are both live (the step's scales are applied to the product), so 128 x 128 fp32 per 8 warps is the
# widest tile that compiles without spills for sm_90 (cuobjdump: 227 registers for gemm1 128 x 2*64, 194 for gemm2
# 128 x 128; 128 x 256 spills). Triton waits for each step's wgmma before its scaling (wgmma.wait_group 0 in the
# loop, also with the next step's dot issued first): "@2" tiles (4 warps, BLOCK_M 64: half the registers and shared
# memory) run two persistent programs per SM, so one's scaling overlaps the other's tensor-core steps. The first
# TMA tune (H200, 2ab69e3) took BLOCK_M 128 with 64 x 128 / w8s3 tma_a and 128 x 128 / w8s3 tma at T = 8192 in all
# five presets and at T = 1024 in three: 0.79-0.87x the pointer kernels' time.
FP8_TILES = {
    "g1": [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3),
           (64, 128, 8, 4, "tma_a"), (64, 128, 8, 3, "tma_a"), (64, 128, 4, 3, "tma_a@2"), (64, 128, 4, 4, "tma_a@2"),
           (128, 128, 8, 3, "tma_a"), (128, 128, 4, 4, "gluon")],
    "g2": [(32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3),
           (128, 128, 8, 4, "tma"), (128, 128, 8, 3, "tma"), (128, 128, 4, 3, "tma@2"), (128, 128, 4, 4, "tma@2"),
           (128, 128, 4, 4, "gluon")],
}
# "gluon": the Gluon GEMMs (``kernels/gluon_fp8*.py``: each K step's product promoted while the next MMA runs), a
# candidate on compute capability 9.x where this Triton's Gluon has the kernels' names (``tune.gluon_tiles_ok``); their
# tile is their own (BLOCK_N 128, BLOCK_K 128, 4 warps per 64 rows, 4 stages), the tuple's fields name it only. H100,
# 1c088c1 (BENCHMARKS.md): gemm1 1.05-1.22x faster than the TMA kernel, gemm2 1.03-1.33x on DeepSeek-V3 / Mixtral and
# 0.78-0.82x on Qwen3-30B-A3B: a choice per bucket and GEMM, so the tuner makes it.
FP8_DECODE_TILES = {"g1": [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3)],
                    "g2": [(16, 128, 4, 4, "fused"), (32, 128, 4, 4, "fused"), (64, 128, 4, 3, "fused"),
                           (32, 128, 4, 4, "pairs"), (64, 128, 4, 3, "pairs"), (128, 128, 4, 3, "pairs")]}
# Each mode is measured with its speed candidates (docs/FP8.md): "w8a8+prequant" = the config's "fp8_prequant": 1,
# "w8a16+fold1" / "+fold2" = "fp8_fold": 1 / 2. The winner's keys go into its config; "plain" skips the candidates.
FP8_VARIANTS = {"w8a8": ("w8a8", "w8a8+prequant"), "w8a16": ("w8a16", "w8a16+fold1", "w8a16+fold2")}
# "lean": w8a8+prequant (fastest in 7 of the 8 entries of the first full tune, H200, 2f93783) and w8a16+fold1 (the
# eighth, and the fastest weight-only variant in all 8): two fifths of the measuring time of "both"
FP8_CHOICES = {"both": FP8_VARIANTS["w8a8"] + FP8_VARIANTS["w8a16"], "plain": ("w8a8", "w8a16"),
               "lean": ("w8a8+prequant", "w8a16+fold1"), "prequant": ("w8a8+prequant",),
               "w8a8": FP8_VARIANTS["w8a8"], "w8a16": FP8_VARIANTS["w8a16"]}
FP8_VARIANT_KEYS = {"prequant": ("fp8_prequant", 1), "fold1": ("fp8_fold", 1), "fold2": ("fp8_fold", 2)}


def mode_keys(mode: str | None) -> dict:
    """A measured FP8 mode -> its config keys: "w8a16+fold2" -> {"fp8": "w8a16", "fp8_fold": 2}; None -> {}."""
    if mode is None:
        return {}
    base, *cands = mode.split("+")
    return dict([("fp8", base)] + [FP8_VARIANT_KEYS[c] for c in cands])


def as_quantized(h) -> torch.Tensor:
    """gemm1's h as gemm2 reads it under prequant: a QAct (written by gemm1's epilogue) dequantized, a 16-bit h
    quantized the same way first (``triton_fp8.quantize_act``: the codes the epilogue writes), so the two kinds of
    gemm1 candidate compare on equal terms."""
    from ..ops.triton_fp8 import QAct, quantize_act

    return (h if isinstance(h, QAct) else quantize_act(h)).dequantize()
