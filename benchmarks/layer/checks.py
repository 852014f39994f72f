"""Checks: relative errors, the tokens whose routing two correct implementations may legitimately choose apart
(bf16 ties at the top-k boundary), and a path's verdict against the reference."""

from __future__ import annotations

import math

import torch

from .common import policy


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    num, den = (a - b).norm().item(), b.norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def bad_token_frac(a: torch.Tensor, b: torch.Tensor, thresh: float = policy.BENCH_BAD_TOKEN_REL) -> float:
    """Fraction of tokens whose own relative error exceeds ``thresh`` (routing flips show up here)."""
    a, b = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    per = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    return float((~(per <= thresh)).float().mean().item())


def routing_ambiguous(logits: torch.Tensor, correction_bias, spec, fp32_router: bool) -> torch.Tensor:
    """[T] bool: tokens whose expert choice could legitimately differ between two correct implementations.

    bf16 routers round the logits to bf16, so exact ties at the top-k boundary are common (~10% of tokens at
    E=128), and ``torch.topk`` and our kernels may break them differently; two GEMMs summing in different orders
    can also land one bf16 ulp apart. Each ranking key gets an interval from the logit +- d; a token is ambiguous
    when the worst selected key's lower end does not clear the best rejected key's upper end (likewise for the
    group choice). The window d is ``moecomp.core.policy.bench_tie_window`` (fp32 routers: 2e-5 relative; bf16: half an
    ulp each side)."""
    from moecomp.oracle import reference

    l = logits.float()
    d = policy.bench_tie_window(l, fp32_router)
    T, E, k = l.shape[0], spec.num_experts, spec.top_k
    if spec.score_order == "topk_then_score" or (spec.scoring == "softmax" and not spec.has_correction_bias):
        lo, hi, key = l - d, l + d, l  # softmax ranks like its logits
    elif spec.scoring == "softmax":
        p = torch.softmax(l, -1)
        lo, hi, key = p * torch.exp(-2 * d), p * torch.exp(2 * d), p
    else:
        lo, hi, key = reference.score(l - d, spec.scoring), reference.score(l + d, spec.scoring), \
            reference.score(l, spec.scoring)
    if spec.has_correction_bias and spec.score_order != "topk_then_score":
        b = correction_bias.float()
        lo, hi, key = lo + b, hi + b, key + b
    amb = torch.zeros(T, dtype=torch.bool, device=l.device)
    allowed = torch.ones(T, E, dtype=torch.bool, device=l.device)
    if spec.n_group > 1 and spec.score_order != "topk_then_score":
        G = spec.n_group

        def gscore(v):
            v = v.view(T, G, E // G)
            return v.topk(2, -1).values.sum(-1) if spec.group_score == "top2_sum" else v.max(-1).values

        gk, glo, ghi = gscore(key), gscore(lo), gscore(hi)
        keep = gk.topk(spec.topk_group, -1).indices
        kmask = torch.zeros(T, G, dtype=torch.bool, device=l.device).scatter_(1, keep, True)
        if spec.topk_group < G:
            worst_kept = glo.masked_fill(~kmask, math.inf).min(-1).values
            best_dropped = ghi.masked_fill(kmask, -math.inf).max(-1).values
            amb |= ~(worst_kept > best_dropped)
        allowed = kmask[:, :, None].expand(T, G, E // G).reshape(T, E)
    if k < E:
        masked = key.masked_fill(~allowed, -math.inf)
        sel = masked.topk(k, -1).indices
        smask = torch.zeros(T, E, dtype=torch.bool, device=l.device).scatter_(1, sel, True)
        worst_sel = lo.masked_fill(~smask, math.inf).min(-1).values
        best_rej = hi.masked_fill(smask | ~allowed, -math.inf).max(-1).values
        amb |= ~(worst_sel > best_rej)
    return amb


def rel_err_rows(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> float | None:
    a, b = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    if not bool(rows.any()):
        return None
    return rel_err(a[rows], b[rows])


def check_output(out: torch.Tensor, ref: torch.Tensor, amb: torch.Tensor | None, tol: float,
                 key: str = "rel_err_vs_hf") -> dict:
    """rel err vs the HF block over all tokens and over the tokens with an unambiguous routing; ok when finite
    and the unambiguous part is within ``tol`` (tie flips are legitimate, see ``routing_ambiguous``). ``key``: the name
    of the all-token rel err (fp8 checks compare with the dequantized references, not the HF block)."""
    rel = rel_err(out, ref)
    c = {key: rel}
    judged = rel
    if amb is not None:
        n_amb = int(amb.sum().item())
        c["ambiguous_tokens"] = n_amb
        if n_amb:
            u = rel_err_rows(out, ref, ~amb)
            c["rel_err_unambiguous"] = u
            if u is not None:
                judged = u
                keep = ~amb
                c["bad_token_frac_unambiguous"] = bad_token_frac(out.reshape(-1, out.shape[-1])[keep],
                                                                 ref.reshape(-1, ref.shape[-1])[keep])
    c["check_ok"] = bool(math.isfinite(rel) and judged <= tol)
    return c


def check_record(rec: dict, tol: float, ref_path: str | None, hf_grouped_mm_rel_err: float | None) -> dict:
    """A path's verdict against the HF block (the "check" columns): rel err, ok, and the tie-aware parts."""
    chk = dict(tolerance=tol, against=ref_path)
    if rec.get("rel_err_vs_hf") is not None:
        chk["rel_err"] = rec["rel_err_vs_hf"]
        chk["ok"] = bool(rec.get("check_ok"))
        for k_ in ("ambiguous_tokens", "rel_err_unambiguous", "bad_token_frac_unambiguous"):
            if k_ in rec:
                chk[k_] = rec[k_]
    else:
        chk["rel_err"] = None
        chk["ok"] = False
        chk["error"] = rec.get("error", "no output")
    if hf_grouped_mm_rel_err is not None:
        chk["hf_grouped_mm_rel_err"] = hf_grouped_mm_rel_err  # bf16 noise level between HF's own two paths
    return chk
