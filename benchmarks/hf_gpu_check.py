"""HF integration on the GPU machine's stack: coverage there (CPU, fp32) and `moecomp.optimize` on CUDA.

Part A (CPU, this machine's transformers): every `@use_experts_implementation` family built tiny, optimized and
compared, as `python -m moecomp coverage` does (fp32, logits within 1e-4, one moe_forward per block), run over a
process pool; writes $OUT/coverage-transformers-<version>.md.

Part B (CUDA): for a set of families, the tiny model (hidden 64, 8 experts, top-2; batch 4 x 48 tokens) on the GPU:
  - optimize in bf16 on CUDA, one moe_forward per block, and every rewritten block compared with the untouched
    copy's block on the very inputs that block saw in the untouched model's forward (relative Frobenius error:
    bf16 < 2e-2);
  - then `.half()` both (fp16: < 5e-3) and `.float()` both (fp32: < 1e-5): moves after optimize keep working;
  - optimize on CPU in fp32, then `.to("cuda")`: the moved model is still right (fp32 < 1e-5).
Whole-model logits are compared too and printed (Frobenius), but not judged: in a random tiny model a one-ulp
difference in one layer can flip a later top-k choice, which moves a few logits a lot; the per-block check does
not have that noise.
Prints a table; exit status 1 on any failure.

    PYTHONPATH=. python3 benchmarks/hf_gpu_check.py [--families a b ...] [--jobs 12] [--skip-coverage]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import time

GPU_FAMILIES = [
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss", "granitemoe",
    "hunyuan_v1_moe", "minimax", "dots1", "jamba", "ernie4_5_moe", "nemotron_h", "deepseek_v4", "hy_v4",
    "glm5_next", "minimax_m3_vl", "kolibri1", "mistral4", "beam", "axk1", "gemma4",
]
TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-5}


def _coverage_one(fam: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from moecomp.coverage import families

    return families.check_family(fam).to_dict()


def part_a(jobs: int) -> tuple[list, list[str]]:
    import multiprocessing as mp

    import transformers

    from moecomp.coverage import markdown as coverage_md, families

    fams = families.experts_families()
    t0 = time.time()
    with mp.get_context("spawn").Pool(jobs) as pool:
        rows = pool.map(_coverage_one, fams, chunksize=1)
    results = []
    for d in rows:
        r = families.FamilyResult(d.pop("family"), d.pop("status"))
        for k, v in d.items():
            setattr(r, k, v)
        results.append(r)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"coverage-transformers-{transformers.__version__}.md"), "w") as f:
            f.write(coverage_md.coverage_markdown(results))
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    print(f"\nPart A: transformers {transformers.__version__}: {len(results)} families in {time.time() - t0:.0f}s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for r in results:
        print(f"  {r.family:22s} {r.status:14s} {r.rewritten}/{r.blocks}  {(r.reason or '')[:110]}")
    bad = [f"coverage {r.family}: not equal: {r.reason[:150]}" for r in results if r.status == "not equal"]
    return results, bad


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _first(o):
    return o[0] if isinstance(o, (tuple, list)) else o


def block_errors(ref, opt, names, run_ref, key: str) -> dict:
    """The optimized blocks against the reference blocks, each fed the inputs its reference block saw in
    run_ref(): per-token relative errors -> {"median": .., "flips": fraction of tokens off by more than 10x the
    tolerance, "ok": median < tol and flips <= 5%}. A flip is a routing near-tie in a 16-bit router picking
    another expert for that token; a wrong spec shows in every token, so in the median."""
    import torch

    seen, hooks = {}, []
    for n in names:
        def hook(mod, args, kwargs, out, n=n):
            seen.setdefault(n, (args, kwargs, _first(out).detach().clone()))
        hooks.append(ref.get_submodule(n).register_forward_hook(hook, with_kwargs=True))
    try:
        run_ref()
    finally:
        for h in hooks:
            h.remove()
    if len(seen) != len(names):
        raise RuntimeError(f"only {len(seen)} of {len(names)} blocks ran")
    errs = []
    with torch.no_grad():
        for n, (args, kwargs, want) in seen.items():
            got = _first(opt.get_submodule(n)(*args, **kwargs)).double()
            want = want.double().reshape(got.shape)
            d = (got - want).reshape(-1, got.shape[-1]).norm(dim=-1)
            errs.append(d / want.reshape(-1, got.shape[-1]).norm(dim=-1).clamp_min(1e-30))
    e = torch.cat(errs)
    med, flips = float(e.median()), float((e > 10 * TOL[key]).double().mean())
    return {"median": med, "flips": flips, "ok": med < TOL[key] and flips <= 0.05}


def part_b(fams: list[str], dev: str = "cuda") -> tuple[list[dict], list[str]]:
    import torch

    import moecomp
    from moecomp.coverage import families

    rows, bad = [], []
    for fam in fams:
        row = {"family": fam}
        rows.append(row)
        try:
            model, _ = families.build_tiny(fam, seed=1)
        except Exception as e:  # not in this transformers, or not buildable tiny
            row["status"] = f"not built: {str(e)[:80]}"
            continue
        vocab = getattr(model.config, "vocab_size", None) or getattr(
            getattr(model.config, "text_config", None), "vocab_size", 128)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, min(int(vocab), 128), (4, 48), generator=g)
        kw = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

        def logits(m, dev):
            with torch.no_grad():
                return families._logits(m(input_ids=ids.to(dev), **kw)).clone()

        try:
            cpu_model = copy.deepcopy(model)
            ref = model.to(dev, torch.bfloat16)
            opt = copy.deepcopy(ref)
            _, rep = moecomp.optimize(opt, report=True)
            only = [b for b in rep.blocks if b.status == "experts only"]
            row["rewritten"] = f"{len(rep.rewritten)}/{len(rep.blocks)}" + (f" + {len(only)} experts only"
                                                                              if only else "")
            if not rep.rewritten and not only:
                row["status"] = "not rewritten: " + "; ".join(sorted({b.reason[:80] for b in rep.blocks}))[:160]
                continue

            def fwd():
                return logits(opt, dev)

            out, per, total, runs = families.count_calls_per_block(opt, fwd, with_forwards=True)
            row["calls_ok"] = all(per[n] == runs[n] for n in per) and total == sum(per.values())
            if only:  # experts-only modules really ran moecomp's path (not their original forward)
                sts = [m._moecomp_experts for m in opt.modules() if getattr(m, "_moecomp_experts", None)]
                row["calls_ok"] &= bool(sts) and all(st.calls > 0 and st.fallbacks == 0 for st in sts)
            row["logits_bf16"] = _rel(out, logits(ref, dev))
            names = [b.name for b in rep.rewritten] + [b.name for b in only]  # blocks compared whole
            row["bf16"] = block_errors(ref, opt, names, lambda: logits(ref, dev), "bf16")
            ref.half(), opt.half()
            row["fp16"] = block_errors(ref, opt, names, lambda: logits(ref, dev), "fp16")
            ref.float(), opt.float()
            row["fp32"] = block_errors(ref, opt, names, lambda: logits(ref, dev), "fp32")
            # optimize on CPU, then move to the GPU
            cpu_ref = copy.deepcopy(cpu_model)
            moecomp.optimize(cpu_model)
            cpu_model.to(dev)
            cpu_ref.to(dev)
            row["cpu_then_cuda"] = block_errors(cpu_ref, cpu_model, names, lambda: logits(cpu_ref, dev), "fp32")
            fails = [k for k in ("bf16", "fp16", "fp32", "cpu_then_cuda") if not row[k]["ok"]]
            if not row["calls_ok"]:
                fails.append(f"moe_forward calls {per} for block runs {runs}")
            row["status"] = "ok" if not fails else "FAIL " + ", ".join(fails)
            if fails:
                bad.append(f"gpu {fam}: {row['status']}")
        except Exception as e:
            row["status"] = f"FAIL raised {type(e).__name__}: {str(e)[:160]}"
            bad.append(f"gpu {fam}: {row['status']}")
        finally:
            if dev == "cuda":
                torch.cuda.empty_cache()
    print("\nPart B: optimize on CUDA (tiny models, batch 4 x 48)\n")
    print("Blocks: median per-token relative error vs the untouched block on the same inputs (flips: tokens off by "
          "10x the tolerance, routing near-ties)\n")
    print("| family | rewritten | blocks bf16 | blocks fp16 (after .half()) | blocks fp32 (after .float()) | "
          "CPU-optimized then .to(cuda), fp32 | one op per block | logits bf16 (info) | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k):
            v = r.get(k)
            if isinstance(v, dict):
                return f"{v['median']:.1e}" + (f" ({v['flips']:.1%} flips)" if v["flips"] else "")
            return f"{v:.1e}" if isinstance(v, float) else "-"

        print(f"| {r['family']} | {r.get('rewritten', '-')} | {f('bf16')} | {f('fp16')} | {f('fp32')} | "
              f"{f('cpu_then_cuda')} | {r.get('calls_ok', '-')} | {f('logits_bf16')} | {r['status']} |")
    return rows, bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--families", nargs="*", default=GPU_FAMILIES)
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--skip-coverage", action="store_true")
    p.add_argument("--device", default="cuda", help="part B's device (cpu: a smoke test of this script)")
    a = p.parse_args(argv)
    import torch
    import transformers

    bad, res = [], {"torch": torch.__version__, "transformers": transformers.__version__,
                    "commit": os.environ.get("MOECOMP_COMMIT", "?")}
    if not a.skip_coverage:
        cov, b = part_a(a.jobs)
        bad += b
        res["coverage"] = [{k: v for k, v in r.to_dict().items() if k != "skipped"} for r in cov]
    if a.device != "cuda" or torch.cuda.is_available():
        res["gpu_name"] = torch.cuda.get_device_name() if a.device == "cuda" else a.device
        res["gpu"], b = part_b(a.families, a.device)
        bad += b
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "hf_gpu_check.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("\nFAILURES:" if bad else "\nall checks passed", *bad, sep="\n  ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
