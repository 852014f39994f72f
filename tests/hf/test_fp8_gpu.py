"""FP8 block checkpoints on the GPU (H200; skipped without CUDA): a real-format checkpoint written to a tmp dir,
loaded with ``from_pretrained`` on CUDA (transformers builds FP8Experts / FP8Linear), ``moecomp.optimize``d, and run:

* the forward against the same model run with the plain-PyTorch FP8 forwards (the dequantized reference);
* ``model.generate`` (moecomp's engine: static cache, decode steps as CUDA graphs) greedy tokens against the
  dequantized reference's argmax under teacher forcing, position by position: the agreement rate is printed and
  must be at least ``MIN_AGREE``, and every token that differs must have a reference logit within ``TOL_PLAIN`` of
  the largest |logit| of the top one (a token whose top-2 logits are within the FP8 error may go either way; on an
  H100, DeepSeek-V3's tiny model flips 4 of 32).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.formats import fp8 as P  # noqa: E402
from moecomp.testing import fp8_convert as C  # noqa: E402

from .conftest import rel_err  # noqa: E402
from .test_fp8 import TOL_PLAIN, build  # noqa: E402

MIN_AGREE = 0.75  # tiny random models: top-2 logits often within the FP8 error (each such token is bounded below)
pytestmark = pytest.mark.gpu


def _load(tmp_path, family):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model = build(family)
    C.write_fp8_checkpoint(model, str(tmp_path))
    fp8 = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16, device_map="cuda").eval()
    assert any(P.fp8_kind(m) == "experts" for m in fp8.modules()), "transformers did not build FP8Experts"
    return fp8


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_from_pretrained_fp8_optimize(tmp_path, family, capsys):
    model = _load(tmp_path, family)
    ids = torch.randint(3, 128, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad(), P.plain_fp8(model):
        want = model(input_ids=ids, use_cache=False).logits.float()
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.rewritten) == model.config.num_hidden_layers, rep
    assert rep.fp8_linear["bound"] == rep.fp8_linear["modules"]
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits.float()
    err = rel_err(got, want)
    with capsys.disabled():
        print(f"\n{family} on CUDA: vs dequantized reference {err:.1e}")
    assert torch.isfinite(got).all() and err <= TOL_PLAIN


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])  # mixtral: 0/16 at 32 layers (H100, 2f8b014)
def test_generate_fp8_agrees_with_reference(tmp_path, family, capsys):
    model = _load(tmp_path, family)
    prompt = torch.randint(3, 128, (2, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    moecomp.optimize(model)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    new = out[:, prompt.shape[1]:]
    moecomp.unoptimize(model)
    with torch.no_grad(), P.plain_fp8(model):  # teacher forcing: the reference's logits after each true prefix
        logits = model(input_ids=out, use_cache=False).logits[:, prompt.shape[1] - 1:-1].float()  # [B, new, V]
    ref = logits.argmax(-1)
    agree = float((ref == new).float().mean())
    # a greedy token may differ from the reference's argmax only where its reference logit is within the forward's
    # tolerance of the top one (TOL_PLAIN of the largest |logit|: what test_from_pretrained_fp8_optimize allows)
    gap = logits.amax(-1) - logits.gather(-1, new[..., None])[..., 0]  # [B, new]; 0 where they agree
    bound = TOL_PLAIN * float(logits.abs().amax())
    with capsys.disabled():
        print(f"\n{family} generate on CUDA: {agree:.0%} of greedy tokens agree with the dequantized reference; "
              f"the others within {float(gap.max()):.3g} of its top logit (bound {bound:.3g})")
    assert agree >= MIN_AGREE and bool((gap <= bound).all())
