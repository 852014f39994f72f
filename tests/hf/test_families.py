"""The coverage sweep: every transformers family with ``@use_experts_implementation``, tiny, fp32, CPU.

Each family: build tiny (batch 2 x 5 tokens), optimize, compare logits (1e-4 relative) and count
``moe_forward`` calls (exactly one per rewritten block). A family may be left alone (reported with a reason), but an
optimized model must never differ from the original, and every family keeps its pinned outcome (``OUTCOME``).
"""

import pytest
import torch

from moecomp.coverage import families as F

# One pinned outcome per family (transformers 5.24, docs/coverage.md): rewritten whole and equal, experts only with
# the named reason, or left alone with the named reason. A family missing from the installed transformers (e.g.
# 5.17 on the GPU machine) is not collected; one that a newer transformers adds is held only to the safety checks
# until it is pinned here.
EQUAL = (
    "afmoe aria axk1 axk2 bailing_hybrid beam cohere2_moe deepseek_ocr2 deepseek_v2 deepseek_v3 deepseek_v32 "
    "deepseek_v4 dots1 "
    "dots3_note ernie4_5_moe ernie4_5_vl_moe exaone_moe flex_olmo flint glm4_moe glm4_moe_lite glm4v_moe glm5_next "
    "glm_moe_dsa gpt_oss granitemoe granitemoe_swa granitemoehybrid granitemoeshared hunyuan_v1_moe hy_v3 hy_v4 "
    "hy_v4_vl inkling2 inkling2_loop jamba kimi_linear kolibri1 kolibri1_1 laguna lara_mini lfm2_moe mellum mimo_v2_flash "
    "minicpm5_moe minimax minimax_m2 "
    "minimax_m3_vl mistral4 mistral_large4 mixtral nemotron_h olmoe openai_privacy_filter phimoe qwen2_moe qwen3_5_moe "
    "qwen3_moe qwen3_next qwen3_omni_moe qwen3_vl_moe qwen4_exp solar_open step3p7 unlimited_ocr").split()
# (kolibri1_1, minicpm5_moe: transformers 5.25; step3p7: decorated from 5.25, found by structure before)
# (deepseek_v4: a hash-routed layer, MoESpec.hash_routing, and a top-k one, both rewritten)
OUTCOME = {
    **{f: ("equal", "") for f in EQUAL},
    # router and experts siblings in a decoder layer (moecomp.api.pair): rewritten together, the router reading its own
    # input (RMS norm, a scale vector, H ** -0.5) and per-expert weight multipliers (MoESpec.router_input, ...)
    "diffusion_gemma": ("equal", ""),
    "gemma4": ("equal", ""),
    # the whole block is beyond the spec (an MLP router over E + 1 classes, a router state passed from layer to layer:
    # recognise/router_probe.py measures it); its standard experts module runs moe_experts, routing stays HF's
    "zaya": ("experts only", "after an MLP router"),
    # found by structure (no @use_experts_implementation): recognise/discover.py
    "llama4": ("equal", ""),
    # a router [E + S, H] whose last S rows give the S stacked shared experts' gammas, renormalised with the chosen
    # weights (MoESpec.shared_gamma, SharedExpertSpec.stacked, has_weight_scale)
    "inkling": ("equal", ""),
    "longcat_flash": ("equal", ""),  # zero experts (MoESpec.zero_experts)
    # its MoE MLPs rewritten (an output bias: epilogue.find_output_bias); its attention experts (JetMoeMoA: a
    # map / reduce module whose forward raises) left alone
    "jetmoe": ("partial", "This module doesn't support call and forward"),
    # Dynamo cannot capture these; the dispatch reader reads them (recognise/dispatch_reader.py). Switch: a fixed expert
    # capacity per sequence (MoESpec.capacity). NLLB-MoE (5.24): its experts module one-hot-encodes the router's
    # one-hot mask, so expert module 0 computes every token's second-choice slots and module 1 every first choice,
    # whatever the router picked: not a routed MoE
    "nllb_moe": ("not rewritten", "took one token"),
    "switch_transformers": ("equal", ""),
    # variants (families.VARIANTS): a family's tiny model with config changes that reach another block style
    "nemotron_h:latent": ("equal", ""),  # experts between latent projections (MoESpec.latent_size)
    # min(silu(gate), L) * clamp(up, +-L) on the routed and the shared experts (MoESpec / SharedExpertSpec
    # activation_clamp_after): the FX pass on 5.25, the attribute reader where Dynamo cannot capture the block (5.17,
    # 5.24: the same variant, found by structure)
    "step3p7:limits": ("equal", ""),
    # logits scaled before the sigmoid, a norm on the latent input and on each expert's output (MoESpec.router_scale,
    # latent_norm, expert_norm)
    "muse_spark": ("equal", ""),
}
# the families the structural scan adds to the decorated ones (test_structural_scan checks it): those of transformers
# 5.24, and those whose experts a later release decorates (dropped where the installed one does): aria (5.17),
# step3p7 (before 5.25)
STRUCTURAL = ["aria", "jetmoe", "llama4", "longcat_flash", "nllb_moe", "step3p7", "switch_transformers"]
STRUCTURAL = [f for f in STRUCTURAL if F.transformers_dir() and __import__("os").path.isdir(
    __import__("os").path.join(F.transformers_dir(), "models", f)) and f not in F.experts_families()]
ALL = sorted(set(F.experts_families()) | set(STRUCTURAL))
ALL = sorted(set(ALL) | set(F.variants_of(ALL)))


def test_families_found():
    assert len(ALL) >= 10 and "mixtral" in ALL and "qwen3_moe" in ALL


@pytest.mark.parametrize("family,found", [("llama4", True), ("longcat_flash", True), ("jetmoe", True),
                                          ("mixtral", True), ("qwen3_moe", True), ("gpt2", False), ("opt", False),
                                          ("wav2vec2_conformer", False), ("bart", False)])
def test_routed_blocks_by_structure(family, found):
    """hf/discover.routed_blocks on the tiny model built on the meta device: MoE blocks by shapes alone (a router
    [E, H] next to experts for it), and none in dense models (whose attention / MLP / conformer feed-forward pairs
    once passed for experts)."""
    model, cfg = F._meta_build(family)
    blocks = F.discover.routed_blocks(model, F._hidden_of(cfg))
    assert bool(blocks) == found, blocks
    if found:
        assert all(E >= 2 for E in blocks.values())


@pytest.mark.families
def test_structural_scan():
    """The whole scan (every modeling file with a top-k / argmax, built tiny on the meta device): the families it
    adds to the decorated ones are the pinned STRUCTURAL ones, plus the structural candidates that run-time checks
    then reject (check_family: "not routed" / not buildable; listed apart in docs/coverage.md)."""
    decorated = set(F.experts_families())
    found = set(F.moe_families()) - decorated
    # (a pinned family this transformers decorates is found through that: LongCat-Flash from 5.25)
    assert set(STRUCTURAL) - decorated <= found, sorted(found)
    rejected = found - set(STRUCTURAL)
    for fam in sorted(rejected):  # not MoE: each is rejected at run time or cannot be built tiny to check
        assert F.check_family(fam).status in ("not routed", "build failed", "import failed"), fam


@pytest.mark.families
@pytest.mark.parametrize("family", ALL)
def test_family(family):
    r = F.check_family(family)
    if r.status in ("build failed", "import failed"):
        assert family not in OUTCOME, f"{family} no longer builds tiny: {r.reason}"
        pytest.skip(f"{family} cannot be built tiny: {r.reason[:200]}")
    assert r.status != "not equal", f"{family}: optimized model differs: {r.reason}"
    if r.rewritten or r.experts_only:
        assert r.calls_ok, f"{family}: moe_forward / moe_experts calls per block are not exactly one"
        assert r.max_rel_err is not None and r.max_rel_err <= F.TOL
    want = OUTCOME.get(family)
    if want is None:  # a family this transformers added: safe, and says why when left alone
        assert r.status in ("equal", "experts only", "partial", "not rewritten", "no MoE block")
        assert r.status == "equal" or r.reason, "a family left alone must say why"
        return
    assert (r.status, want[1] in (r.reason or "")) == (want[0], True), f"{family}: {r.status}: {r.reason} {r.skipped}"


def test_nllb_moe_experts_ignore_the_router():
    """The transformers bug docs/coverage.md names for NLLB-MoE (``coverage_md.CAUSES``), checked to still be there:
    with the router made to choose expert 5 for every token, only experts 0 and 1 compute (the experts one-hot encode
    the router's one-hot mask). When transformers fixes it, this fails: drop the cause and pin the family again."""
    mod = pytest.importorskip("transformers.models.nllb_moe.modeling_nllb_moe")
    cfg = mod.NllbMoeConfig(d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=8, expert_capacity=64,
                            encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                            vocab_size=32)
    mlp = mod.NllbMoeSparseMLP(cfg, 32).eval()
    with torch.no_grad():
        mlp.router.classifier.weight.zero_()
        mlp.router.classifier.weight[5].fill_(1.0)  # x > 0 everywhere below: expert 5 wins, expert 4 (ties) second
    called = set()
    for name, e in mlp.experts.items():
        e.register_forward_hook(lambda m, a, o, name=name: called.add(name))
    x = torch.rand(2, 6, 16) + 0.1
    with torch.no_grad():
        top_1_mask, _, _ = mlp.router(x.view(-1, 16))
        assert top_1_mask.shape == (12, 8) and bool((top_1_mask.argmax(-1) == 5).all()), "router setup"
        mlp(x)
    assert called == {"expert_0", "expert_1"}, called
