"""``python -m moecomp demo``: a random-weight HF MoE model of a real family's layer sizes, optimized and checked.

On CPU: a small Qwen3-MoE (hidden 256, 16 experts, top-4, 2 layers) in fp32; the optimized logits must match the
original within 1e-4 relative (max abs difference / max abs value).
On GPU: Qwen3-30B-A3B's layer sizes (hidden 2048, 128 experts, top-8, expert width 768, 32 heads / 4 KV heads,
vocab 151936) with 4 of its 48 layers, in bf16; bf16 GEMMs and the odd routing near-tie make elementwise
comparisons loose, so the check there is on the whole tensor: ||optimized - original|| / ||original|| <= 2e-2
(and the max-abs figure is printed too).

It prints the scan report, the forward time before and after (median of timed runs after warm-up), and the time per
decode step of greedy `generate()` (batch 1) before and after, each step timed inside the call: transformers' loop
before; after, on GPU moecomp's generate() (static cache, CUDA-graph steps), on CPU transformers' loop with the
op in the blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, norm_topk_prob=True,
    max_position_embeddings=4096,
)
CPU_SIZES = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024, norm_topk_prob=True,
    max_position_embeddings=1024,
)
CPU_TOL = 1e-4  # max abs diff / max abs value, fp32
GPU_TOL = 2e-2  # ||diff|| / ||ref||, bf16


def build(device: str, layers: int | None = None, dtype=None, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    gpu = device.startswith("cuda")
    sizes = dict(QWEN3_30B_A3B if gpu else CPU_SIZES)
    cfg = Qwen3MoeConfig(num_hidden_layers=layers or (4 if gpu else 2), use_cache=False, **sizes)
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    return model


def _time(fn, device: str, reps: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _decode_ms(model, prompt, new_tokens: int, device: str, reps: int = 5) -> tuple[float, torch.Tensor, str]:
    """(ms per decode step, tokens, which loop) of greedy generate(), timed step by step inside each call (the
    prompt's prefill is not counted); the median over ``reps`` calls. moecomp's generate() times its own decode
    loop with CUDA events (``model.generate.last``); transformers' loop is timed by a stopping criterion that reads
    the clock at every token. Both are differences of one monotonic clock within a call: never negative."""
    from transformers import StoppingCriteriaList

    from ..testing import StepClock

    def gen(n, **kw):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                                  pad_token_id=0, **kw)

    new_tokens = max(2, new_tokens)
    toks = gen(new_tokens)  # warm-up (compiles, captures); says which loop a plain call takes
    last = getattr(model.generate, "last", None) or {}
    per_step = []
    for _ in range(reps):
        if last.get("path") == "moecomp":
            gen(new_tokens)
            last = model.generate.last
            per_step.append(last["decode_s"] / max(1, last["decode_steps"]))
        else:
            clock = StepClock(device.startswith("cuda"))
            gen(new_tokens, stopping_criteria=StoppingCriteriaList([clock]))
            per_step.append((clock.times[-1] - clock.times[0]) / (len(clock.times) - 1))
    loop = "moecomp generate()" if last.get("path") == "moecomp" else "transformers' loop"
    return statistics.median(per_step) * 1e3, toks[0, prompt.shape[1]:], loop


def run(device: str | None = None, layers: int | None = None, batch: int = 1, seq: int = 128, reps: int = 5,
        use_capture: bool = True, print_fn=print, decode_tokens: int | None = None) -> dict:
    from ..api.optimize import optimize

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    model = build(device, layers)
    cfg = model.config
    print_fn(f"moecomp demo: Qwen3-MoE, {'Qwen3-30B-A3B layer sizes' if gpu else 'small sizes'}, "
             f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-"
             f"{cfg.num_experts_per_tok}, expert width {cfg.moe_intermediate_size}, {next(model.parameters()).dtype}, "
             f"{device}, random weights")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)

    def fwd():
        with torch.no_grad():
            return model(input_ids=ids).logits

    ref = fwd().float()
    t_before = _time(fwd, device, reps)
    n_new = decode_tokens if decode_tokens is not None else (32 if gpu else 8)
    prompt = ids[:1, :16]
    if n_new:
        dec_before, toks_before, loop_before = _decode_ms(model, prompt, n_new, device, min(5, reps))
    _, rep = optimize(model, report=True, use_capture=use_capture)
    out = fwd().float()
    t_after = _time(fwd, device, reps)
    if n_new:
        dec_after, toks_after, loop_after = _decode_ms(model, prompt, n_new, device, min(5, reps))
    print_fn(str(rep))
    max_rel = float((out - ref).abs().max() / ref.abs().max())
    norm_rel = float((out - ref).norm() / ref.norm())
    if gpu:
        ok = norm_rel <= GPU_TOL and bool(torch.isfinite(out).all())
        check = f"||diff||/||ref|| = {norm_rel:.2e} (tolerance {GPU_TOL:g}, bf16); max abs rel. {max_rel:.2e}"
    else:
        ok = max_rel <= CPU_TOL and bool(torch.isfinite(out).all())
        check = f"max |diff| / max |ref| = {max_rel:.2e} (tolerance {CPU_TOL:g}, fp32)"
    print_fn(f"logits vs the unoptimized model: {check} -> {'OK' if ok else 'MISMATCH'}")
    print_fn(f"forward ({batch} x {seq} tokens): before {t_before * 1e3:.2f} ms, after {t_after * 1e3:.2f} ms "
             f"({t_before / t_after:.2f}x)")
    res = {"ok": ok, "max_rel": max_rel, "norm_rel": norm_rel, "before_s": t_before, "after_s": t_after,
           "rewritten": len(rep.rewritten), "blocks": len(rep.blocks)}
    if n_new:
        same = float((toks_before == toks_after).float().mean())
        print_fn(f"greedy generate() ({n_new} new tokens, batch 1; ms per decode step, median of "
                 f"{min(5, reps)} calls): before "
                 f"{dec_before:.2f} ms ({loop_before}), after {dec_after:.2f} ms ({loop_after}), "
                 f"{dec_before / dec_after:.2f}x; same tokens as before: {same:.0%}")
        res.update(decode_ms_before=dec_before, decode_ms_after=dec_after, decode_same_tokens=same,
                   decode_loop_before=loop_before, decode_loop_after=loop_after)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moecomp demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4 on GPU, 2 on CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=11, help="timed forwards (median); host-bound GPU timings are noisy")
    p.add_argument("--no-capture", action="store_true", help="attribute fallback only (no Dynamo)")
    p.add_argument("--decode", type=int, default=None, help="new tokens for the generate() timing (default 32 on "
                   "GPU, 8 on CPU; 0 skips it)")
    a = p.parse_args(argv)
    res = run(a.device, a.layers, a.batch, a.seq, a.reps, use_capture=not a.no_capture, decode_tokens=a.decode)
    return 0 if res["ok"] and res["rewritten"] == res["blocks"] > 0 else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
