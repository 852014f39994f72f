"""Issue 41 item 1 on CUDA: the engine's captured decode step at batch 1, its launches counted and its tokens within
bf16 tolerance of the unoptimized model's (teacher forcing, as test_generate_gpu.py's bf16 test), in three settings:

    default  (MOECOMP_FUSE_NORM unset: on at <= 2 rows) the pre-attention RMSNorm + q / k / v as one
             ``skinny_norm_group_kernel`` launch a layer; o_proj one ``skinny_kernel``
    group    (MOECOMP_FUSE_LINEARS=1, MOECOMP_FUSE_NORM=0) q / k / v as one ``skinny_group_kernel`` launch a layer
    off      (both 0) four ``skinny_kernel`` launches a layer

and in each the router GEMV and the routing as two launches (``router_gemv_kernel``, ``route_topk_kernel``); then
MOECOMP_FUSE_QKROPE=1: one ``qk_norm_rope_cache_kernel`` a layer. The fused kernels themselves at real sizes:
tests/kernels/test_skinny_group.py, tests/kernels/test_skinny_norm_gpu.py, tests/kernels/test_qk_rope.py."""

from __future__ import annotations

import copy

import pytest
import torch

import moecomp
from moecomp.testing import routing_near_ties

from .models import build, prompts

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2
LAYERS, S, NEW = 3, 16, 12  # S = 16 prompt tokens: the prefill's routing has more than 4 tokens (two kernels)


def _kernel_counts(opt, ids, mask) -> tuple[dict, int, torch.Tensor]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = opt.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    counts = {k: sum(n.startswith(k) for n in names)
              for k in ("skinny_group_kernel", "skinny_kernel", "skinny_norm_group_kernel", "route_topk_kernel",
                        "router_gemv_kernel", "qk_norm_rope_cache_kernel")}
    return counts, int(opt.generate.last["decode_steps"]), out


@pytest.mark.parametrize("setting", ["default", "group", "off"])
def test_decode_step_launches_and_tokens(setting, monkeypatch):
    if setting == "default":
        monkeypatch.delenv("MOECOMP_FUSE_LINEARS", raising=False)
        monkeypatch.delenv("MOECOMP_FUSE_NORM", raising=False)
    else:
        monkeypatch.setenv("MOECOMP_FUSE_LINEARS", "1" if setting == "group" else "0")  # (opt-in: measured no faster)
        monkeypatch.setenv("MOECOMP_FUSE_NORM", "0")
    ref = build("qwen3_moe", "cuda", torch.bfloat16, layers=LAYERS, hidden_size=256, moe_intermediate_size=128,
                intermediate_size=256, num_experts=32, num_experts_per_tok=4)
    opt = moecomp.optimize(copy.deepcopy(ref))
    ids, mask = prompts(ref.config.vocab_size, 1, S, seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    opt.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)  # compiles and captures
    counts, steps, out = _kernel_counts(opt, ids, mask)
    assert opt.generate.last["graphs"] == "replayed" and opt.generate.last["layers"] == "compiled"
    fusing = opt.generate.engine._compiled[1]["decode"][0].run.fusing
    per_step = LAYERS * steps
    if setting == "group":
        assert fusing.fused and all(f == [3] for f in fusing.fused), fusing.fused  # q / k / v of the one layer graph
        assert counts["skinny_group_kernel"] == per_step and counts["skinny_kernel"] == per_step, counts  # + o_proj
    elif setting == "off":
        assert fusing is None
        assert counts["skinny_group_kernel"] == counts["skinny_norm_group_kernel"] == 0, counts
        assert counts["skinny_kernel"] == 4 * per_step, counts
    else:  # one fold a layer graph: the pre-attention norm into q / k / v (no residual: it is the previous graph's)
        found = fusing.then.found
        assert found and all(len(r["folded"]) == 1 for r in found), found
        assert counts["skinny_norm_group_kernel"] == per_step and counts["skinny_kernel"] == per_step, counts
        assert counts["skinny_group_kernel"] == 0, counts
    assert counts["router_gemv_kernel"] == per_step, counts
    assert counts["route_topk_kernel"] == LAYERS * (steps + 1), counts  # + the prefill's 16 tokens, once a layer
    _tokens_within_tolerance(ref, opt, out)


def _tokens_within_tolerance(ref, opt, out) -> None:
    """Each new token's logit (teacher forcing through the unoptimized model) within BF16_TOL of the largest, or at
    a routing near-tie, up to the first EOS."""
    with torch.no_grad():
        logits = ref(out).logits[:, S - 1:-1].float()  # [1, n, V]: the logits that chose each new token
    chosen = logits.gather(-1, out[:, S:, None]).squeeze(-1)
    short = (logits.max(-1).values - chosen) / logits.abs().amax()
    eos = torch.as_tensor(ref.generation_config.eos_token_id, device=out.device).reshape(-1)
    is_eos = torch.isin(out[:, S:], eos).long()
    off = (short > BF16_TOL) & ~(is_eos.cumsum(-1) - is_eos > 0)
    near = routing_near_ties(opt, out)[:, S - 1:-1]
    assert not bool((off & ~near).any()), (short, near)


def test_decode_step_qkrope(monkeypatch):
    """MOECOMP_FUSE_QKROPE=1 (with the linear and norm folds): the layer graph's q / k norms, rotary and cache writes
    fold into one ``qk_norm_rope_cache_kernel`` launch a layer a decode step; tokens as above."""
    from moecomp.generate import fuse_qkrope

    for name in ("MOECOMP_FUSE_LINEARS", "MOECOMP_FUSE_NORM", "MOECOMP_FUSE_QKROPE"):
        monkeypatch.setenv(name, "1")
    ref = build("qwen3_moe", "cuda", torch.bfloat16, layers=LAYERS, hidden_size=256, moe_intermediate_size=128,
                intermediate_size=256, num_experts=32, num_experts_per_tok=4)
    opt = moecomp.optimize(copy.deepcopy(ref))
    ids, mask = prompts(ref.config.vocab_size, 1, S, seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    opt.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)  # compiles and captures
    counts, steps, out = _kernel_counts(opt, ids, mask)
    assert opt.generate.last["graphs"] == "replayed" and opt.generate.last["layers"] == "compiled"
    after = opt.generate.engine._compiled[1]["decode"][0].run.fusing.after
    p = next(p for p in after if isinstance(p, fuse_qkrope.QkRopePass))
    assert [(r["attentions"], len(r["folded"]), r["left"]) for r in p.found] == [(1, 1, [])], p.found
    assert counts["qk_norm_rope_cache_kernel"] == LAYERS * steps, (counts, steps)
    _tokens_within_tolerance(ref, opt, out)
