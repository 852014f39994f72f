"""``MoESpec.describe``: a one-line summary of a spec for reports and messages (split from spec.py, which passed
600 lines). Reads the spec's fields only; imports nothing of moecomp."""

from __future__ import annotations


def describe(spec) -> str:
    """E, k, H, I, then [routing] activation / experts, the shared experts and the parallel shard, in words."""
    route = spec.scoring if spec.score_order == "score_then_topk" else f"topk->{spec.scoring}"
    if spec.score_order == "sparsemixer":
        route = f"sparsemixer eps={spec.jitter_eps:g}"
    if spec.n_group > 1:
        route += f" grouped {spec.topk_group}/{spec.n_group}"
    if spec.has_correction_bias:
        route += " +bias(logits)" if spec.bias_on_logits else " +bias"
    if spec.group_mask_zero:
        route += " mask0"
    if spec.renormalize:
        route += " renorm"
    if spec.routed_scaling_factor != 1.0:
        route += f" x{spec.routed_scaling_factor:g}"
    if spec.weight_on_input:
        route += " on-input"
    if spec.zero_experts:
        route += f" +{spec.zero_experts} zero"
    if spec.hash_routing:
        route += " hash"
    if spec.router_prefix:
        route = ("r:" + ("own " if spec.router_input else "") + ("rms " if spec.router_norm else "")
                 + ("*s " if spec.router_in_scale else "")
                 + (f"*{spec.router_in_const:.4g} " if spec.router_in_const != 1.0 else "")) + route
    if spec.expert_scale:
        route += " *s[e]"
    if spec.shared_gamma != "none":
        route += f" +{spec.gamma_rows} shared gammas ({spec.shared_gamma})"
    if spec.has_weight_scale:
        route += " x weight_scale"
    if spec.has_capacity:
        route += f" cap {spec.capacity or f'{spec.capacity_factor:g}T'}/{spec.capacity_per}" + (
            " renorm-kept" if spec.renorm_after_drop else "")
    sh, s = "", spec.shared
    if s is not None:
        sh = (f", shared I={s.intermediate_size}" + (f" x{s.stacked} stacked" if s.stacked else "")
              + (" gated" if s.gate != "none" else "") + (f" x{s.scale:g}" if s.scale != 1.0 else "")
              + (f" {s.norm}-norm" if s.norm != "none" else ""))
    act = spec.activation + ("*up" if spec.gated and spec.activation != "swiglu_oai" else "")
    if spec.has_expert_bias:
        act += {"both": " +b", "gemm1": " +b13", "gemm2": " +b2"}[spec.expert_bias]
    if spec.latent_size:
        act = f"latent L={spec.latent_size}{'+b' if spec.latent_bias else ''} " + act
    if spec.latent_norm != "none":
        act = f"latent-norm {spec.latent_norm} " + act
    if spec.expert_norm != "none":
        act += f" out-norm {spec.expert_norm}"
    if spec.router_scale != 1.0:
        route = f"logits x{spec.router_scale:g} " + route
    if spec.quant is not None:
        q = spec.quant
        lay = f"{q.block_n}x{q.block_k}" if q.scale == "block" else f"g{q.block_k}" if q.scale == "group" else q.scale
        fmt = {"fp8_e4m3": "fp8"}.get(q.weight, q.weight) + ("+zp" if q.zero_point else "")
        act = f"{fmt} {lay}{' ue8m0' if q.scale_dtype == 'ue8m0' else ''} a:{q.activation} " + act
    if spec.activation_clamp:
        act = f"clamp{spec.activation_limit:g} " + act
    if spec.activation_clamp_after:
        act = f"act-clamp{spec.activation_limit:g} " + act
    if spec.gate_softcap or spec.up_softcap:
        act = f"softcap g{spec.gate_softcap:g}/u{spec.up_softcap:g} " + act
    par = "" if spec.parallel is None else f" ({spec.parallel.describe()})"
    return (
        f"E={spec.num_experts} k={spec.top_k} H={spec.hidden_size} I={spec.intermediate_size} "
        f"[{route}] {act}{sh}{par}"
    )
