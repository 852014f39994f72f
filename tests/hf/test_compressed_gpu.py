"""compressed-tensors checkpoints at Qwen3-30B-A3B's layer sizes on the GPU (skipped without CUDA or without the
``compressed-tensors`` package): FP8-dynamic and W4A16 (symmetric and asymmetric) checkpoints written by the package
(``moecomp.testing.ct_writer``: H 2048, I 768, 128 experts, top-8, 2 layers), ``moecomp.load`` straight onto CUDA,
``optimize``d, and every ``moe_forward`` call of a bf16 forward compared with the dequantized reference (the oracle,
``reference.moe_forward``, fp32 math on the op's own tensors and input).

Tolerance: ``TOL`` 2e-2 relative Frobenius (tests/ops/test_fp8_gpu.py's bf16 bound), on the tokens whose routing is
not within a bf16 rounding of a tie (``reference.near_tie_tokens``: the kernel's bf16 router GEMM may pick another
expert there). FP8-dynamic runs weight-only on the Triton path (the kernels quantize activations per 128 columns
only; ``tuning.fp8_mode``), so it is compared with the weight-only reference; its per-token w8a8 reference is
within the format's own error of it (reported). Weights stay quantized and are read in place (data_ptr checks).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install compressed-tensors)")
transformers = pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.api.optimize import TIE_REL  # noqa: E402
from moecomp.core import quant as q8  # noqa: E402
from moecomp.core.args import MOE_ARGS, OP_ARGS  # noqa: E402
from moecomp.oracle import reference  # noqa: E402
from moecomp.testing.ct_writer import write_ct_checkpoint  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.bigmem,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL = 2e-2
LAYERS, E, K, H, I = 2, 128, 8, 2048, 768  # Qwen3-30B-A3B's MoE layer


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def source():
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, intermediate_size=6144, moe_intermediate_size=I,
                                      num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=4,
                                      head_dim=128, num_experts=E, num_experts_per_tok=K, vocab_size=1024)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W4A16", "W4A16_ASYM"])
def test_real_size_checkpoint_on_gpu(source, preset, tmp_path, poison):
    path = write_ct_checkpoint(source, str(tmp_path / "ct"), preset)
    model = moecomp.load(path, dtype=torch.bfloat16, device="cuda")
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.blocks) == len(rep.rewritten) == LAYERS, rep
    fp8 = preset.startswith("FP8")
    if fp8:
        assert all(b.spec.quant.per_token for b in rep.rewritten)
        assert rep.fp8_linear["bound"] == rep.fp8_linear["modules"] == 4 * LAYERS
    sd0 = {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    import moecomp.bind.bind as B

    seen, real = [], B.call_moe_forward

    def spy(x, tensors, spec):
        y = real(x, tensors, spec)
        seen.append((y.clone(), x.clone(), tensors, spec))
        return y

    B.call_moe_forward = spy
    try:
        ids = torch.randint(0, 1024, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        B.call_moe_forward = real
    assert torch.isfinite(logits).all() and len(seen) == LAYERS
    assert {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == sd0
    errs = {}
    for i, (y, x, tensors, spec) in enumerate(seen):
        named = dict(zip(OP_ARGS, tensors))
        assert named["w13"].dtype == (torch.float8_e4m3fn if fp8 else torch.uint8)
        extra = {a: named[a] for a in OP_ARGS[len(MOE_ARGS):] if named[a] is not None}
        run = spec.replace(quant=q8.weight_only(spec.quant)) if fp8 else spec  # what the Triton path runs
        ref = reference.moe_forward(x, *(named[a] for a in MOE_ARGS), run, **extra)
        x2 = x.reshape(-1, H)
        near = reference.near_tie_tokens(x2, named["router_w"], named["router_b"], named["correction_bias"], spec,
                                         TIE_REL[torch.bfloat16])
        keep = ~near
        assert keep.sum() >= x2.shape[0] // 2, "most tokens route away from ties"
        errs[i] = rel(y.reshape(-1, H)[keep], ref.reshape(-1, H)[keep])
        if fp8:  # the per-token w8a8 reference: the format's own error from the weight-only one (reported)
            w8a8 = reference.moe_forward(x, *(named[a] for a in MOE_ARGS), spec, **extra)
            errs[f"{i} w8a8 vs weight-only"] = rel(w8a8, ref)
    assert max(v for k, v in errs.items() if isinstance(k, int)) < TOL, errs
