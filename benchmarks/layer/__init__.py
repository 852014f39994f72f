"""The layer benchmark (``benchmarks/bench_moe.py``), split by concern. ``bench_moe.py`` is the CLI entry point and
runs the grid; these modules hold the parts it is made of:

    common     the run's dtype, tolerances, errors, small helpers shared by every module
    families   the five families: configs, building an HF block, moecomp's spec for it (the recogniser's)
    routing    the synthetic routing modes (draw expert ids, plant them through the router), routing statistics
    peers      the vLLM peer (loading it, what it can run, its path with the block's own HF router)
    timing     Timer, the copy / matmul ceilings, a path's timing (plain launches and a CUDA-graph replay)
    checks     relative errors, the tie-aware routing ambiguity, a path's verdict
    floors     the roofline floor of a cell from the routing taken, achieved rates
    breakdown  --breakdown: torch.profiler per kernel, gaps
    env        environment, commit, JSON saving
    logs       the per-cell log line and the notes before the table
    optimize   --via-optimize: moecomp.optimize() on a holder module
    cli        the options, the paths a run times (--peers), the result JSON's header
    fp8        --dtype fp8: the block quantized, its references, checks, floor and the fp8 matmul ceiling
    fp8_paths  --dtype fp8: moecomp's op in its FP8 modes, vLLM's fp8 block path, torch._scaled_grouped_mm

Nothing here imports Triton or transformers at import time (only torch), so ``report.py`` stays independent of it.
"""
