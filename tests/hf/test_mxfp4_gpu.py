"""gpt-oss MXFP4 on the GPU (H200; skipped without CUDA): ``moecomp.load`` straight onto CUDA, the peak memory of
loading and of ``random_packed_model`` at gpt-oss-20b / 120b size, and the optimized tiny model's greedy tokens.

Peak memory (``torch.cuda.max_memory_allocated`` over the call) may exceed what the model holds by
``PEAK_SLACK`` (the largest transient: one checkpoint tensor read before its view, or one layer's random bytes);
bf16 experts would add 3x the packed size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.hf import mxfp4_write as W  # noqa: E402
from moecomp.hf.packed import PackedExperts  # noqa: E402

from .conftest import rel_err  # noqa: E402
from .test_mxfp4 import LAYERS, TOL_REF_BF16, logits, source_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.gpu
PEAK_SLACK = 1.10


def _held(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.state_dict().values()))


def test_load_to_cuda(tmp_path):
    cfg = tiny_config(hidden_size=512, intermediate_size=512, num_local_experts=32, num_hidden_layers=4,
                      head_dim=64, num_attention_heads=8)
    W.write_random_mxfp4_checkpoint(cfg, str(tmp_path))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = moecomp.load(str(tmp_path), device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    held = _held(model)
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert peak <= PEAK_SLACK * held, (peak, held)
    ids = torch.randint(3, 128, (2, 8))
    want = logits(moecomp.load(str(tmp_path), device="cpu"), ids)
    assert rel_err(logits(model, ids.cuda()).cpu(), want) <= TOL_REF_BF16


@pytest.mark.parametrize("size", ["20b", "120b"])
def test_random_packed_model_full_size(size, capsys):
    cfg = W.gpt_oss_config(size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = W.random_packed_model(cfg, "cuda")
    peak = torch.cuda.max_memory_allocated() - base
    held = _held(model)
    experts = sum(_held(m) for m in model.modules() if isinstance(m, PackedExperts))
    E, H, I, L = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    packed = L * E * (3 * H * I // 2 + 3 * H * I // 32 + (2 * I + H) * 2)  # codes, e8m0 scales, bf16 biases
    with capsys.disabled():
        print(f"\ngpt-oss-{size}: experts {experts / 2**30:.1f} GiB packed (bf16 would be "
              f"{L * E * 3 * H * I * 2 / 2**30:.0f} GiB), model {held / 2**30:.1f} GiB, peak {peak / 2**30:.1f} GiB")
    assert experts == packed
    assert peak <= PEAK_SLACK * held, (peak, held)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 1000, (1, 4), device="cuda")).logits
    assert torch.isfinite(out).all()
    del model
    torch.cuda.empty_cache()


def test_optimize_generate_cuda(tmp_path):
    """Needs the 4-bit Triton kernels (issue 22's other half): the tiny loaded model optimized on CUDA, one block a
    layer bound, greedy tokens equal to the unoptimized model's."""
    W.write_mxfp4_checkpoint(source_model(), str(tmp_path))
    model = moecomp.load(str(tmp_path), device="cuda")
    ref = moecomp.load(str(tmp_path), device="cuda")
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.rewritten) == len(rep.blocks) == LAYERS, rep
    ids = torch.randint(3, 128, (2, 8), device="cuda")
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))
