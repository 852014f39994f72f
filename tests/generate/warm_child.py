"""One fresh process of tests/generate/test_warm_cache.py: a tiny Qwen3-MoE (tests/generate/models.py, seed 0)
optimized, its engine compiling on CPU with Inductor, then

    warmup   moecomp.warmup(batch 2, cache_dir=ARGV[2]) and one generate() of a fixed prompt
    plain    two generate() calls of that prompt (no warmup: the first compiles the decode step, the second the prefill)

ARGV[2] "-": no cache_dir argument; ARGV[3]: the device (default cpu; on CUDA the step is captured too).

Prints one JSON line: the tokens of the last call, warmup's report, the engine's warm-cache report, torch's compile
counters, the warm-cache warnings, the Triton cache directories of moecomp's kernels this process ran ("kernels";
none under TRITON_INTERPRET=1) and what the warm cache restored of them. The caller sets TORCHINDUCTOR_CACHE_DIR
(and MOECOMP_CACHE_DIR / MOECOMP_WARM_CACHE for "plain")."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)


def main() -> None:
    mode, cache_dir = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    import torch
    from torch._dynamo.utils import counters

    import moecomp
    from models import build, prompts

    model = build("qwen3_moe", device=device)
    moecomp.optimize(model)
    model.generate.cpu = True
    eng = model.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "inductor"
    ids, mask = (t.to(device) for t in prompts(model.config.vocab_size, 2, 7, seed=4, left_pad=(0, 2)))
    report = None
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode == "warmup":
            report = moecomp.warmup(model, batch_sizes=[2], max_length=64, prompt_length=5, cache_dir=cache_dir)
        calls = 1 if mode == "warmup" else 2
        for _ in range(calls):
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    last = model.generate.last
    from moecomp.generate import warm_cache, warm_triton

    groups = [warm_triton._group(k) for k in warm_triton.compiled_kernels()]
    print(json.dumps(dict(
        kernels=sorted(g[0] for g in groups if g), restored={k: v for k, v in warm_cache._restored.items()},
        tokens=out.tolist(), warmup={str(k): v for k, v in (report or {}).items()}, seconds=time.perf_counter() - t0,
        warm=eng.warm.report if eng.warm is not None else None, layers=last.get("layers"), graphs=last.get("graphs"),
        prefill_layers=last.get("prefill_layers"), path=last.get("path"),
        counters={k: dict(counters[k]) for k in ("inductor", "aot_autograd")},
        warnings=[str(w.message) for w in caught if "moecomp warm cache" in str(w.message)])), flush=True)


if __name__ == "__main__":
    main()
