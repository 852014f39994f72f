"""``--dtype fp8``: the paths timed on a block's FP8 weights.

- ``moecomp_fp8``: ``torch.ops.moecomp.moe_forward`` with the quantized spec, the scales passed after ``spec``; the
  kernel table picks w8a8 (e4m3 x e4m3 dots, activations quantized in the kernel) or w8a16 (weight-only) per T.
- ``moecomp_fp8_w8a8`` / ``moecomp_fp8_w8a16``: the same with ``MOECOMP_FP8_MODE`` forcing one kernel (set before the
  path's calls, removed before the others').
- ``vllm_fp8``: vLLM's fused-MoE fp8 block path (``fused_moe(..., use_fp8_w8a8=True, w1_scale, w2_scale,
  block_shape=[128, 128])``, activations quantized per token in groups of 128 by vLLM's Triton kernel) on the same
  fp8 weights and scales, the block's own HF router around it, the shared expert in plain torch on its weights
  dequantized to bf16 (vLLM's kernel has no shared expert).
- ``scaled_grouped_mm``: ``torch._scaled_grouped_mm`` (row-wise scales only: one per token of the activations, one
  per output channel of the weights, no 128x128 blocks) on the same fp8 weight bytes, with per-channel weight scales
  = the largest block scale of each row, per-token activation scales computed in torch; tokens sorted by expert in
  torch as transformers' grouped_mm path does, the HF router, the shared expert in torch (dequantized bf16). Not the
  block's numbers (different scales): timed for reference, checked against its own row-wise reference.
"""

from __future__ import annotations

import inspect
import os

import torch

from . import common, fp8, peers
from .timing import Path

VLLM_BLOCK = [128, 128]
SGMM_NOTE = ("torch._scaled_grouped_mm on the same fp8 weight bytes with ROW-WISE scales (per-token activation "
             "scales, per-channel weight scales = each row's largest 128x128 block scale): not the block's numbers; "
             "checked against a row-wise dequantized reference")


def set_mode(mode: str | None) -> None:
    """MOECOMP_FP8_MODE for the calls that follow (None: the kernel table decides)."""
    if mode is None:
        os.environ.pop(fp8.MODE_ENV, None)
    else:
        os.environ[fp8.MODE_ENV] = mode


def moecomp_paths(fb: fp8.Fp8Block, names: list[str]) -> list[Path]:
    """moecomp's op on the fp8 block, one path per mode named in ``names`` (of ``fp8.MODES``)."""
    op, key = torch.ops.moecomp.moe_forward, fb.spec.key
    args, scales, H = fb.op_args(), fb.scale_args(), fb.spec.hidden_size

    def fn(x, _op=op, _a=args, _k=key, _s=scales, _H=H):
        return _op(x.view(-1, _H), *_a, _k, *_s).view(x.shape)

    out = []
    for name, mode in fp8.MODES.items():
        if name in names:
            note = (f"{fp8.MODE_ENV}={mode} (forced)" if mode else "the kernel table's mode per T (w8a8 or w8a16)")
            out.append(Path(name, fn, prepare=lambda m=mode: set_mode(m), check=name, note=note))
    return out


def vllm_fp8_supported(fused, spec, fb: fp8.Fp8Block) -> str | None:
    """Why vLLM's fp8 block path cannot run this block, or None."""
    why = peers.vllm_unsupported(spec, fb.tensors)
    if why:
        return why
    if "use_fp8_w8a8" not in inspect.signature(fused).parameters:
        return "this vLLM entry point takes no fp8 arguments (use --vllm-peer DIR with the standalone copy)"
    if spec.hidden_size % 128 or spec.intermediate_size % 128:
        return (f"H {spec.hidden_size} / I {spec.intermediate_size}: vLLM's fp8 block path needs multiples of 128 "
                "(--tiny --dtype fp8 uses such sizes)")
    return None


def make_vllm_fp8_fn(fused, spec, fb: fp8.Fp8Block, router, compute_dtype: torch.dtype):
    """x [1, T, H] -> [1, T, H]: the router, vLLM's fp8 fused experts on the fp8 weights and block scales, plus the
    shared expert in torch on its dequantized bf16 weights. ``compute_dtype`` (fp32 under the CPU interpreter): x's
    dtype as the kernel sees it (it quantizes x itself; the output is cast back)."""
    H = spec.hidden_size
    w13, w2 = fb.tensors["w13"], fb.tensors["w2"]
    s13, s2 = fb.scales["w13_scale"], fb.scales["w2_scale"]
    route = peers.routing_fn(spec, fb.tensors, router)
    shared = peers.torch_shared_expert(spec, fb.dequantized_shared(common.DTYPE))

    return peers.vllm_block_fn(lambda xin, tw, ti: fused(xin, w13, w2, tw, ti, use_fp8_w8a8=True, w1_scale=s13,
                                                         w2_scale=s2, block_shape=VLLM_BLOCK),
                               H, route, shared, compute_dtype)


# ------------------------------------------------------------------------------------- torch._scaled_grouped_mm
def sgmm_probe(device: torch.device) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run here (absent, or a tiny 2-D x 3-D call with row-wise scales and
    unaligned group sizes fails on this device), or None."""
    f = getattr(torch, "_scaled_grouped_mm", None)
    if f is None:
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        a = torch.randn(32, 64, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(2, 48, 64, device=device).to(torch.float8_e4m3fn).transpose(-2, -1)
        offs = torch.tensor([7, 32], device=device, dtype=torch.int32)
        f(a, b, torch.ones(32, device=device), torch.ones(2, 48, device=device), offs=offs, out_dtype=torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        return f"torch._scaled_grouped_mm does not run on {device.type} here ({common.root_msg(e, 140)})"
    return None


def row_scales(block_scale: torch.Tensor, rows: int, halves: int, block_n: int = 128) -> torch.Tensor:
    """[E, row blocks, col blocks] block scales -> [E, rows] fp32: each row's largest block scale."""
    per = rows // halves
    nb = -(-per // block_n)
    r = torch.arange(rows, device=block_scale.device)
    return block_scale.float().amax(-1)[:, (r // per) * nb + (r % per) // block_n].contiguous()


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [P, K] -> (e4m3 [P, K], fp32 [P]): one scale per row, max|x| / 448."""
    from moecomp.core.spec import FP8_MAX

    s = x.abs().amax(-1).float().clamp(min=1e-10) / FP8_MAX
    return (x.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def sgmm_weights(spec, fb: fp8.Fp8Block) -> dict:
    I, H = spec.intermediate_size, spec.hidden_size
    return dict(w13=fb.tensors["w13"], w2=fb.tensors["w2"],
                s13=row_scales(fb.scales["w13_scale"], spec.w13_rows, 2 if spec.gated else 1),
                s2=row_scales(fb.scales["w2_scale"], H, 1), I=I)


def make_sgmm_fn(spec, fb: fp8.Fp8Block, router):
    """x [1, T, H] -> [1, T, H] through torch._scaled_grouped_mm (see the module docstring)."""
    import torch.nn.functional as F

    E, H, k = spec.num_experts, spec.hidden_size, spec.top_k
    w = sgmm_weights(spec, fb)
    I = w["I"]
    w13_t, w2_t = w["w13"].transpose(-2, -1), w["w2"].transpose(-2, -1)  # column-major [E, H, 2I] / [E, I, H]
    route = peers.routing_fn(spec, fb.tensors, router)
    shared = peers.torch_shared_expert(spec, fb.dequantized_shared(common.DTYPE))
    gmm = torch._scaled_grouped_mm

    def sgmm_fn(x):
        x2 = x.reshape(-1, H)
        tw, ti = route(x2)
        flat = ti.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)  # (no host sync: capturable)
        xq, sa = per_token_quant(x2[tok])
        h = gmm(xq, w13_t, sa, w["s13"], offs=offs, out_dtype=torch.bfloat16)  # [P, 2I]
        a = F.silu(h[:, :I]) * h[:, I:]
        aq, sh = per_token_quant(a)
        y = gmm(aq, w2_t, sh, w["s2"], offs=offs, out_dtype=torch.bfloat16)  # [P, H]
        out = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y.float() * tw.reshape(-1)[order, None])
        out = out.to(x.dtype)
        if shared is not None:
            out = out + shared(x2)
        return out.view(x.shape)

    return sgmm_fn


def sgmm_reference(x2: torch.Tensor, spec, fb: fp8.Fp8Block, router) -> torch.Tensor:
    """What the row-wise path computes, per expert in fp32: per-token fake-quantized activations against the fp8
    weights times their per-channel scales; GEMM outputs rounded to bf16 and the gated activation in bf16 as the
    path's are; the same shared expert."""
    import torch.nn.functional as F

    w = sgmm_weights(spec, fb)
    I = w["I"]
    tw, ti = peers.routing_fn(spec, fb.tensors, router)(x2)
    shared = peers.torch_shared_expert(spec, fb.dequantized_shared(common.DTYPE))

    def fq(v):
        q, s = per_token_quant(v)
        return q.float() * s[:, None]

    out = torch.zeros(x2.shape, dtype=torch.float32, device=x2.device)
    with torch.no_grad():
        for e in range(spec.num_experts):
            tok, slot = torch.nonzero(ti == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = (fq(x2[tok]) @ (w["w13"][e].float() * w["s13"][e][:, None]).T).to(torch.bfloat16)
            a = F.silu(h[:, :I]) * h[:, I:]  # in bf16, as the path computes it
            y = (fq(a) @ (w["w2"][e].float() * w["s2"][e][:, None]).T).to(torch.bfloat16).float()
            out.index_add_(0, tok, y * tw[tok, slot, None])
        out = out.to(x2.dtype)
        return out + shared(x2) if shared is not None else out


# ------------------------------------------------------------------------------------------------ all paths
def family_paths(spec, fb: fp8.Fp8Block | None, fb_err: str | None, router, peer_names: list[str], vllm_fused,
                 vllm_info: dict, vllm_named: bool, sgmm_why: str | None, device: torch.device) -> list[Path]:
    """The fp8 paths of one family, in the order they are timed (HF peers: n/a with the reason)."""
    paths = [Path(n, None, skip=fp8.HF_NA) for n in ("hf_eager", "hf_grouped_mm", "compile") if n in peer_names]
    if fb is None:  # moecomp's modes: an error (as a refused bf16 block is); the peers have nothing to run on
        why = f"no fp8 block ({fb_err})"
        layout = spec is not None and fp8.unquantizable(spec)  # no FP8 checkpoint layout stores it: n/a, no failure
        if layout:
            why = f"n/a: no FP8 checkpoint layout for this block ({layout})"
        return paths + [Path(n, None, error=why) if n in fp8.MODES and not layout else Path(n, None, skip=why)
                        for n in common.FP8_PATHS if n in peer_names]
    paths += moecomp_paths(fb, peer_names)
    if "vllm_fp8" in peer_names:
        if vllm_fused is None:
            msg = f"vLLM peer not loaded: {vllm_info.get('error')}"
            paths.append(Path("vllm_fp8", None, error=msg) if vllm_named else Path("vllm_fp8", None, skip=msg))
        elif (why := vllm_fp8_supported(vllm_fused, spec, fb)) is not None:
            paths.append(Path("vllm_fp8", None, skip=why))
        else:
            cd = common.DTYPE if device.type == "cuda" else torch.float32  # the interpreter: fp32 in, fp8 dots
            paths.append(Path("vllm_fp8", make_vllm_fp8_fn(vllm_fused, spec, fb, router, cd), check="vllm_fp8",
                              note="vLLM fused_moe fp8 block path (use_fp8_w8a8, block_shape [128, 128]), HF router, "
                                   "shared expert in torch on dequantized bf16 weights"))
    if "scaled_grouped_mm" in peer_names:
        why = sgmm_why or peers.vllm_unsupported(spec, fb.tensors)  # the same expert shapes as vLLM's kernel
        if why is None and (spec.hidden_size % 16 or spec.intermediate_size % 16):
            why = "H and I must be multiples of 16 (16-byte rows of fp8)"
        paths.append(Path("scaled_grouped_mm", None, skip=why) if why else
                     Path("scaled_grouped_mm", make_sgmm_fn(spec, fb, router), check="scaled_grouped_mm",
                          note=SGMM_NOTE))
    return paths
