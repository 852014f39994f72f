"""One synthetic FP8 gemm1 call, as the op makes it, for the Gluon gemm1 (``kernels/gluon_fp8_gemm1.py``) against the
Triton TMA fp8 gemm1 and a plain-torch dequantized reference: GPU tests (tests/ops/test_fp8_gluon_gpu.py), the probe
and the diag (benchmarks/probe_gluon.py, diag_fp8_gluon.py).

``make_case1`` draws x [T, H] (bf16), e4m3 codes of w13 [E, 2I, H] with fp32 128 x 128 block scales, per-expert row
counts (pair p is token p // top_k; each expert's rows padded to BLOCK_M with the sentinel P), optional bias and
routing weights (weight on input). ``run1`` calls ``triton_fp8_tma.gemm1`` (x gathered into sorted order and
quantized, ``tma_a``) with MOECOMP_FP8_GLUON on (the Gluon kernel) or off (the Triton kernel); ``reference1`` is
h from x quantized per token and 128 columns in torch, both operands dequantized, fp32 matmuls.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from ..core.spec import MoESpec

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "relu": F.relu,
        "relu2": lambda v: F.relu(v).square()}


def padded_order(counts: list[int], bm: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(sorted_ids, block_expert) as the alignment makes them: the P = sum(counts) pairs in a random order, expert e
    taking the next ``counts[e]`` of them, each expert's rows padded to a multiple of ``bm`` with the sentinel P."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    P = sum(counts)
    perm = torch.randperm(P, generator=g)
    sorted_ids, block_expert, start = [], [], 0
    for e, c in enumerate(counts):
        n = -(-c // bm) * bm
        sorted_ids += perm[start:start + c].tolist() + [P] * (n - c)
        block_expert += [e] * (n // bm)
        start += c
    return sorted_ids, block_expert


def make_case1(E: int, H: int, I: int, counts: list[int], bm: int, top_k: int = 2, act: str = "silu",
               bias: bool = False, w_on_input: bool = False, h_quant: bool = False, device="cuda",
               seed: int = 0) -> dict:
    """A gemm1 call (see the module docstring); ``h_quant``: gemm2 reads h quantized (the launchers may then return
    a QAct)."""
    P = sum(counts)
    sorted_ids, block_expert = padded_order(counts, bm, seed)
    dev = torch.device(device)
    gd = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gd, device=dev)  # noqa: E731
    w13 = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=dev)
    for e in range(E):  # one expert at a time: no fp32 copy of a large w13
        w13[e] = (rnd(2 * I, H) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    spec = MoESpec(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I, activation=act,
                   has_expert_bias=bias, expert_bias="gemm1" if bias else "both", weight_on_input=w_on_input)
    ws = rnd(E, 2 * I // 128, H // 128).abs() * 1e-3 + 1e-4
    return dict(
        spec=spec, E=E, H=H, I=I, P=P, bm=bm, k=top_k, x=rnd(-(-P // top_k), H).to(torch.bfloat16), w13=w13,
        ws=ws, b13=(rnd(E, 2 * I) * 0.5).to(torch.bfloat16) if bias else None,
        weights=rnd(P).abs() + 0.1 if w_on_input else None,
        q=dict(A_QUANT=3, W_SCALE=1, Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False, ws_ptr=ws, stride_se=ws.stride(0),
               stride_sn=ws.stride(1), stride_sk=ws.stride(2), **({"_h_quant": True} if h_quant else {})),
        aligned=(torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
                 torch.tensor(block_expert, dtype=torch.int32, device=dev),
                 torch.tensor([len(sorted_ids)], dtype=torch.int32, device=dev), len(block_expert)),
    )


@contextlib.contextmanager
def gluon_env(on: bool):
    """MOECOMP_FP8_GLUON set to 1 / 0 inside, restored after."""
    old = os.environ.get("MOECOMP_FP8_GLUON")
    os.environ["MOECOMP_FP8_GLUON"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MOECOMP_FP8_GLUON"]
        else:
            os.environ["MOECOMP_FP8_GLUON"] = old


def run1(c: dict, gluon: bool, bn: int = 128, tma_a: bool = True):
    """``triton_fp8_tma.gemm1`` on the case: the Gluon kernel (``gluon``) or the Triton one (BLOCK_N ``bn``, x read by
    TMA in sorted order or by pointer loads per token). Returns h [S, I] or its QAct."""
    from ..ops import triton_fp8_tma
    from ..ops.weight_on_input import gemm1_kwargs

    c1 = dict(BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3 if bn == 128 else 4, tma=1,
              tma_a=int(tma_a))
    with gluon_env(gluon):
        return triton_fp8_tma.gemm1(c["x"], c["w13"], c["b13"], c["spec"], c["aligned"], c["k"], c["bm"], c1, c["q"],
                                    gemm1_kwargs(c["spec"], c["weights"]), {})


def dense_h(out) -> torch.Tensor:
    """h as fp32: a QAct's codes times their 128-column group scales, else the tensor itself."""
    if hasattr(out, "s") and out.s is not None:
        return out.q.float() * out.s.repeat_interleave(128, 1)[:, :out.q.shape[1]]
    return out.float()


def valid_rows(c: dict) -> torch.Tensor:
    """The sorted rows that hold a pair (the only rows gemm1 stores)."""
    return (c["aligned"][0] < c["P"]).nonzero().squeeze(1)


def reference1(c: dict) -> torch.Tensor:
    """h [S, I] fp32 (rows without a pair 0) from x quantized per token and 128 columns (s = max|x| / 448, codes
    round to nearest) and both operands dequantized."""
    x = c["x"].float()
    T, H, I = x.shape[0], c["H"], c["I"]
    grp = x.view(T, H // 128, 128)
    s = grp.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448
    xd = ((grp / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(T, H)
    sorted_ids, block_expert = c["aligned"][0].long(), c["aligned"][1].long()
    h = torch.zeros(sorted_ids.numel(), I, device=x.device)
    rows = valid_rows(c)
    e_of = block_expert[rows // c["bm"]]
    act = ACTS[c["spec"].activation]
    for e in e_of.unique().tolist():
        r = rows[e_of == e]
        w = c["w13"][e].float() * c["ws"][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        gu = xd[sorted_ids[r] // c["k"]] @ w.T
        if c["weights"] is not None:
            gu = gu * c["weights"][sorted_ids[r]][:, None]
        if c["b13"] is not None:
            gu = gu + c["b13"][e].float()
        h[r] = act(gu[:, :I]) * gu[:, I:]
    return h
