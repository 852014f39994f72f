"""``python -m moecomp demo``: a random-weight HF MoE model of a real family's layer sizes, optimized and checked.

On CPU: a small Qwen3-MoE (hidden 256, 16 experts, top-4, 2 layers) in fp32; the optimized logits must match the
original within 1e-4 relative (max abs difference / max abs value).
On GPU: Qwen3-30B-A3B's layer sizes (hidden 2048, 128 experts, top-8, expert width 768, 32 heads / 4 KV heads,
vocab 151936) with 4 of its 48 layers, in bf16; bf16 GEMMs and the odd routing near-tie make elementwise
comparisons loose, so the check there is on the whole tensor: ||optimized - original|| / ||original|| <= 2e-2
(and the max-abs figure is printed too).

It prints the scan report and the forward time before and after (median of timed runs after warm-up).
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


def run(device: str | None = None, layers: int | None = None, batch: int = 1, seq: int = 128, reps: int = 5,
        use_capture: bool = True, print_fn=print) -> dict:
    import moecomp

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
    _, rep = moecomp.optimize(model, report=True, use_capture=use_capture)
    out = fwd().float()
    t_after = _time(fwd, device, reps)
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
    return {"ok": ok, "max_rel": max_rel, "norm_rel": norm_rel, "before_s": t_before, "after_s": t_after,
            "rewritten": len(rep.rewritten), "blocks": len(rep.blocks)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moecomp demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4 on GPU, 2 on CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-capture", action="store_true", help="attribute fallback only (no Dynamo)")
    a = p.parse_args(argv)
    res = run(a.device, a.layers, a.batch, a.seq, a.reps, use_capture=not a.no_capture)
    return 0 if res["ok"] and res["rewritten"] == res["blocks"] > 0 else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
