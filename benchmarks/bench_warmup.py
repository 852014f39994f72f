"""Warm-up of the one-liner in fresh processes (issues 20, 41): how long a new user waits until ``generate()`` is fast.

For each model, three child processes run the same thing one after the other:

    cold       a fresh process with empty on-disk compile caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point
               at a new temporary directory) and an empty moecomp artifact cache (MOECOMP_CACHE_DIR, also new): what a
               first run on a machine costs; after its calls it saves the compile artifacts (generate/warm_cache.py)
    warm       a fresh process with the on-disk caches the cold one left, the artifact cache off
               (MOECOMP_WARM_CACHE=0): every later run of the program on that machine, Inductor's / Triton's caches only
    artifacts  a fresh process with NEW empty Inductor / Triton caches but the artifact cache the cold one saved: the
               first generate() loads it by itself (and optimize restores moecomp's own Triton kernels from it):
               a warm start in another container or on another machine

Each child builds the model (random weights, bf16, on the GPU), calls ``moecomp.optimize``, then for each batch size
makes three short greedy ``generate`` calls (``--new`` tokens, a ``--prompt``-token prompt): the first compiles the
decode step's layers and captures the step, the second compiles the prefill, the third is the first fast call.
Warm-up = wall time of calls one and two (until the first fast call can start); "optimize + warm-up" adds
``moecomp.optimize``'s time (issue 41's target). Each child also records what the artifact cache did (load / save,
bytes, seconds), torch's compile-cache counters and its compile-time breakdown. It prints one JSON line.

    PYTHONPATH=. python3 benchmarks/bench_warmup.py --models qwen3=48,qwen2=24 --batches 1,32 --out-json w.json
    python3 benchmarks/bench_warmup.py --device cpu --tiny   # CPU smoke run: the layers compiled by Inductor on CPU
                                                             # (C++ builds are not in the artifacts: no speed-up there)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def child(a) -> dict:
    t0 = time.perf_counter()
    import torch

    import bench_generate as bg
    from bench_generate import build

    t_import = time.perf_counter() - t0
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    name, _, layers = a.model.partition("=")
    t = time.perf_counter()
    model = build(name, dev, torch.bfloat16 if cuda else torch.float32, int(layers) if layers else None, a.tiny, 0)
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    status = bg.optimize_checked(model, say=lambda m: print(m, file=sys.stderr, flush=True))  # (stdout: the JSON)
    t_opt = time.perf_counter() - t
    vocab = model.config.vocab_size
    rec = dict(model=name, layers=model.config.num_hidden_layers, import_s=t_import, build_s=t_build,
               optimize_s=t_opt, batches={}, optimize=status)
    if not status["generate_replaced"]:  # nothing to warm up: recorded, the child ends cleanly
        rec["error"] = "moecomp.optimize did not replace generate (rec['optimize'] has each block's reason)"
        return rec
    model.generate.cpu = True  # CPU smoke runs take the engine too
    eng = model.generate._engine()
    eng.cpu_compile = True  # (CPU smoke runs: the layers compiled by Inductor, the artifacts path exercised)
    for B in [int(b) for b in a.batches.split(",")]:
        ids = torch.randint(3, vocab, (B, a.prompt), device=dev, generator=torch.Generator(dev).manual_seed(B))
        calls, paths = [], []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
            if cuda:
                torch.cuda.synchronize()
            calls.append(time.perf_counter() - t)
            paths.append(model.generate.last.get("path"))
        last = model.generate.last
        rec["batches"][str(B)] = dict(calls_s=calls, warmup_s=calls[0] + calls[1], paths=paths,
                                      graphs=last.get("graphs"), layers=last.get("layers"),
                                      prefill_layers=last.get("prefill_layers"))
    rec["optimize_plus_warmup_s"] = t_opt + sum(b["warmup_s"] for b in rec["batches"].values())
    from moecomp.generate import warm_cache

    rec["warm_cache"] = dict(eng.warm.report) if eng.warm is not None else None
    # moecomp's Triton kernels restored by optimize (before its checks ran them) from the artifact cache
    rec["triton_restore"] = {d: {k: v for k, v in r.items() if k != "restored_dirs"}
                             for d, r in warm_cache._restored.items()}
    if a.save:
        rec["warm_cache_save"] = warm_cache.save(eng)
    rec.update(compile_stats())
    return rec


def compile_stats() -> dict:
    """torch's compile-cache counters and the largest entries of its compile-time breakdown (where warm time goes)."""
    out = {}
    try:
        from torch._dynamo.utils import counters

        out["compile_counters"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd", "stats")}
    except Exception as e:
        out["compile_counters"] = f"{type(e).__name__}: {e}"
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        top = sorted(zip(names, values), key=lambda nv: -float(nv[1]))[:12]
        out["compile_times_s"] = {n: round(float(v), 3) for n, v in top}
    except Exception as e:
        out["compile_times_s"] = f"{type(e).__name__}: {e}"
    return out


def children():
    """(state, environment, extra child arguments) of the three children of one model (the module docstring)."""
    cold = tempfile.mkdtemp(prefix="moecomp-warmup-")
    fresh = tempfile.mkdtemp(prefix="moecomp-warmup-fresh-")
    base = dict(os.environ, MOECOMP_PROGRESS="0", MOECOMP_CACHE_DIR=os.path.join(cold, "moecomp"))

    def caches(root):
        return dict(TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                    TRITON_CACHE_DIR=os.path.join(root, "triton"))

    yield "cold", dict(base, MOECOMP_WARM_CACHE="1", **caches(cold)), ["--save"]
    yield "warm", dict(base, MOECOMP_WARM_CACHE="0", **caches(cold)), []
    yield "artifacts", dict(base, MOECOMP_WARM_CACHE="1", **caches(fresh)), []


def cache_line(rec: dict) -> str:
    w, sv = rec.get("warm_cache") or {}, rec.get("warm_cache_save")
    line = f"{w.get('load', 'not used')}"
    if w.get("loaded_bytes"):
        line += f" ({w['loaded_bytes'] / 2**20:.1f} MiB in {w['load_s']:.2f} s)"
    for r in (rec.get("triton_restore") or {}).values():
        if "restored" in r:
            line += f"; Triton kernels restored {r['restored']} of {r['kernels']} ({r['seconds']:.2f} s)"
    if sv:
        line += f", save {sv['save']} ({sv.get('saved_bytes', 0) / 2**20:.1f} MiB in {sv.get('save_s', 0):.2f} s"
        t = sv.get("triton_save")
        line += f"; Triton kernels packed {t['packed']} of {t['kernels']})" if isinstance(t, dict) else ")"
    return line


def run_child(args: list[str], env: dict, timeout: float) -> dict:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return dict(error=f"rc {r.returncode}: {r.stderr[-1500:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3=12", help="name[=layers],... (bench_generate.py's models)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=400.0, help="per child process")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    rows = []
    for spec in a.models.split(","):
        args = ["--model", spec, "--batches", a.batches, "--prompt", str(a.prompt), "--new", str(a.new), "--device",
                a.device] + (["--tiny"] if a.tiny else [])
        for state, env, extra in children():
            rec = dict(run_child(args + extra, env, a.timeout_s), caches=state, model_arg=spec)
            rows.append(rec)
            if "error" in rec:
                print(f"[warmup] {spec} {state}: {rec['error']}", flush=True)
                continue
            for B, r in rec["batches"].items():
                print(f"[warmup] {spec} {state} B={B}: calls " + " / ".join(f"{c:.1f}" for c in r["calls_s"])
                      + f" s -> warm-up {r['warmup_s']:.1f} s (paths {r['paths']}; import {rec['import_s']:.1f} s, "
                      f"build {rec['build_s']:.1f} s, optimize {rec['optimize_s']:.1f} s)", flush=True)
            print(f"[warmup] {spec} {state}: optimize + warm-up {rec['optimize_plus_warmup_s']:.1f} s; artifact cache "
                  f"{cache_line(rec)}; inductor {rec.get('compile_counters', {}).get('inductor')}", flush=True)
    if a.out_json:
        import torch

        from layer.env import environment, git_commit

        with open(a.out_json, "w") as f:
            json.dump(dict(environment(torch.device(a.device)), argv=sys.argv[1:], commit=git_commit(),
                           date=time.strftime("%Y-%m-%d %H:%M:%S %z"), rows=rows), f, indent=1)
    print("\n| model | caches | B | 1st call s | 2nd call s | 3rd (fast) call s | warm-up s | optimize + warm-up s |"
          "\n|---|---|---|---|---|---|---|---|")
    for rec in rows:
        for i, (B, r) in enumerate(rec.get("batches", {}).items()):
            c = r["calls_s"]
            total = f"{rec['optimize_plus_warmup_s']:.1f} (all batches)" if i == 0 else ""
            print(f"| {rec['model_arg']} | {rec['caches']} | {B} | {c[0]:.1f} | {c[1]:.1f} | {c[2]:.2f} | "
                  f"{r['warmup_s']:.1f} | {total} |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
