"""Warm-up of the one-liner in fresh processes (issue 20): how long a new user waits before ``generate()`` runs fast.

For each model, two child processes run the same thing one after the other:

    cold   a fresh process with empty on-disk compile caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point
           at a new temporary directory): what a first run on a machine costs
    warm   a fresh process with the caches the cold one left: every later run of the program

Each child builds the model (random weights, bf16, on the GPU), calls ``moecomp.optimize``, then for each batch size
makes three short greedy ``generate`` calls (``--new`` tokens, a ``--prompt``-token prompt): the first compiles the
decode step's layers and captures the step, the second compiles the prefill, the third is the first fast call.
Warm-up = wall time of calls one and two (until the first fast call can start). It prints one JSON line.

    PYTHONPATH=. python3 benchmarks/bench_warmup.py --models qwen3=48,qwen2=24 --batches 1,32 --out-json w.json
    python3 benchmarks/bench_warmup.py --device cpu --tiny          # CPU smoke run (no compile caches to speak of)
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
                                      graphs=last.get("graphs"), prefill_layers=last.get("prefill_layers"))
    return rec


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
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    rows = []
    for spec in a.models.split(","):
        cache = tempfile.mkdtemp(prefix="moecomp-warmup-")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), MOECOMP_PROGRESS="0")
        args = ["--model", spec, "--batches", a.batches, "--prompt", str(a.prompt), "--new", str(a.new), "--device",
                a.device] + (["--tiny"] if a.tiny else [])
        for state in ("cold", "warm"):
            rec = dict(run_child(args, env, a.timeout_s), caches=state, model_arg=spec)
            rows.append(rec)
            if "error" in rec:
                print(f"[warmup] {spec} {state}: {rec['error']}", flush=True)
                continue
            for B, r in rec["batches"].items():
                print(f"[warmup] {spec} {state} B={B}: calls " + " / ".join(f"{c:.1f}" for c in r["calls_s"])
                      + f" s -> warm-up {r['warmup_s']:.1f} s (paths {r['paths']}; import {rec['import_s']:.1f} s, "
                      f"build {rec['build_s']:.1f} s, optimize {rec['optimize_s']:.1f} s)", flush=True)
    if a.out_json:
        import torch

        from bench_moe import environment

        env_info = environment(torch.device(a.device)) if a.device == "cuda" else {}
        with open(a.out_json, "w") as f:
            json.dump(dict(env_info, argv=sys.argv[1:], commit=os.environ.get("MOECOMP_COMMIT"), rows=rows), f,
                      indent=1)
    print("\n| model | caches | B | 1st call s | 2nd call s | 3rd (fast) call s | warm-up s |\n|---|---|---|---|---|---|---|")
    for rec in rows:
        for B, r in rec.get("batches", {}).items():
            c = r["calls_s"]
            print(f"| {rec['model_arg']} | {rec['caches']} | {B} | {c[0]:.1f} | {c[1]:.1f} | {c[2]:.2f} | "
                  f"{r['warmup_s']:.1f} |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
