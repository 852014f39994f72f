"""Issue 39: where does an FP8 model's optimized forward leave its dequantized reference? (Mixtral-8x7B FP8 at 32
layers agreed with the reference on 0 of 16 greedy tokens, 3 of 16 at 8 layers, with the kernel table on or off,
while the op at Mixtral's sizes and a tiny Mixtral FP8 model agree.)

One prompt through the FP8 model (``gen_build_fp8.build``: real layer sizes, random weights, depth cut), three ways:

    ref w8a8    transformers' forward, every FP8 module on its plain-PyTorch forward (``plain_fp8``): activations
                quantized as the checkpoint says (per token and 128 columns, e4m3)
    ref w8a16   the same with the activations left unquantized (the format's own activation error, for scale)
    moecomp     ``moecomp.optimize``d, its eager forward (the bound op and linears, no engine)

Each decoder layer's attention and MoE block, fed the reference's own input for that module (hooks), gives the
relative difference ||a - b|| / ||b|| against both references; the logits at every prompt position give the argmax
agreement and the chosen token's logit below the top (over the largest |logit|). A kernel fault shows as a block far
from both references; a mode choice as a block near one and as far from the other as the references are apart.

    PYTHONPATH=. python3 benchmarks/diag_fp8_blocks.py --model mixtral --layers 8 --prompt 512 --out-json /tmp/d.json
    PYTHONPATH=. python3 benchmarks/diag_fp8_blocks.py --tiny                                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_build_fp8 as gb  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def modules(model) -> dict:
    """{"L.attn" / "L.moe": module} for every decoder layer."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        out[f"{i}.attn"] = layer.self_attn
        out[f"{i}.moe"] = layer.mlp
    return out


def record(model, ids) -> tuple[dict, torch.Tensor]:
    """({name: (args, kwargs, output)}, logits) of one forward, every module's input and output kept."""
    got, hooks = {}, []
    for name, m in modules(model).items():
        def hook(mod, args, kwargs, out, name=name):
            got[name] = (args, kwargs, out[0] if isinstance(out, tuple) else out)
        hooks.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return got, logits


def replay(model, rec: dict) -> dict:
    """{name: output} of every module run on the recorded inputs."""
    mods, out = modules(model), {}
    with torch.no_grad():
        for name, (args, kwargs, _) in rec.items():
            o = mods[name](*args, **kwargs)
            out[name] = o[0] if isinstance(o, tuple) else o
    return out


def logit_stats(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """argmax agreement of ``logits`` with ``ref`` over every position, and ref's view of the chosen tokens."""
    chosen = logits.argmax(-1)
    top2 = ref.topk(2, -1).values
    scale = float(ref.abs().amax()) or 1.0
    gap = top2[..., 0] - ref.gather(-1, chosen[..., None])[..., 0]
    return dict(agreement=float((chosen == ref.argmax(-1)).float().mean()), chosen_gap_median=float(gap.median()) / scale,
                top2_gap_median=float((top2[..., 0] - top2[..., 1]).median()) / scale, rel=rel(logits, ref))


def engine_agreement(model, ids, new: int) -> dict:
    """The engine's greedy tokens (``generate`` after optimize: compiled, captured steps) fed to the same model's
    eager forward: the share of positions where the eager argmax is the engine's token (the engine against the op
    and linears it is built from)."""
    S = ids.shape[1]
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        logits = model(input_ids=seq[:, :-1]).logits[:, S - 1:].float()
    st = logit_stats(logits, logits)  # (the gaps of the eager logits)
    chosen = seq[:, S:]
    scale = float(logits.abs().amax()) or 1.0
    gap = logits.max(-1).values - logits.gather(-1, chosen[..., None])[..., 0]
    return dict(agreement=float((logits.argmax(-1) == chosen).float().mean()), positions=int(chosen.numel()),
                chosen_gap_median=float(gap.median()) / scale, top2_gap_median=st["top2_gap_median"],
                last=dict(getattr(model.generate, "last", {}) or {}))


def main() -> None:
    from gen_optimize import optimize_checked
    from moecomp.formats.fp8 import plain_fp8

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new", type=int, default=16, help="tokens the engine generates (checked teacher-forced)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny sizes)")
    ap.add_argument("--out-json", default="")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model, info = gb.build(a.model, device, dtype, 2 if a.tiny else a.layers, a.tiny, a.seed)
    vocab = model.config.vocab_size
    S = 16 if a.tiny else a.prompt
    ids = torch.randint(3, vocab, (a.batch, S), generator=torch.Generator().manual_seed(a.seed)).to(device)
    print(f"[diag] {a.model} {len(model.model.layers)} layers fp8 on {device} "
          f"({torch.cuda.get_device_name() if cuda else 'cpu'}), MOECOMP_FP8_MODE={os.environ.get('MOECOMP_FP8_MODE', '-')}",
          flush=True)
    with plain_fp8(model):
        rec8, logits8 = record(model, ids)
    with plain_fp8(model, activations="none"):
        rec16, logits16 = record(model, ids)
        out16 = replay(model, rec8)  # w8a16 on the w8a8 reference's inputs
    opt = optimize_checked(model)
    print(f"[diag] optimize: {opt['rewritten']} of {opt['blocks']} blocks rewritten, left: {opt['unrewritten']}",
          flush=True)
    outm = replay(model, rec8)
    with torch.no_grad():
        logitsm = model(input_ids=ids).logits.float()
    engine = engine_agreement(model, ids, 4 if a.tiny else a.new)
    print(f"[diag] engine (generate) tokens under moecomp's eager forward: {engine}", flush=True)
    rows = []
    for name, (_, _, ref) in rec8.items():
        row = dict(module=name, moecomp_vs_w8a8=rel(outm[name], ref), moecomp_vs_w8a16=rel(outm[name], out16[name]),
                   w8a16_vs_w8a8=rel(out16[name], ref), finite=bool(torch.isfinite(outm[name]).all()))
        rows.append(row)
        print(f"[diag] {name:8s} moecomp vs ref w8a8 {row['moecomp_vs_w8a8']:.2e}  vs ref w8a16 "
              f"{row['moecomp_vs_w8a16']:.2e}  (refs apart {row['w8a16_vs_w8a8']:.2e})  finite {row['finite']}",
              flush=True)
    res = dict(model=a.model, optimize=opt, engine=engine, layers=len(model.model.layers), prompt=S, batch=a.batch, build=info,
               fp8_mode=os.environ.get("MOECOMP_FP8_MODE"), gpu=torch.cuda.get_device_name() if cuda else "cpu",
               versions=dict(torch=torch.__version__), commit=os.environ.get("MOECOMP_COMMIT"), blocks=rows,
               logits=dict(moecomp_vs_w8a8=logit_stats(logitsm, logits8), moecomp_vs_w8a16=logit_stats(logitsm, logits16),
                           w8a16_vs_w8a8=logit_stats(logits16, logits8)))
    for k, v in res["logits"].items():
        print(f"[diag] logits {k}: argmax agreement {v['agreement']:.3f} over {a.batch * S} positions, chosen below "
              f"the top {v['chosen_gap_median']:.2e} (median), top-2 gap {v['top2_gap_median']:.2e}, rel {v['rel']:.2e}",
              flush=True)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
