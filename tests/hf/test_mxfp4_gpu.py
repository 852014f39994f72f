"""gpt-oss MXFP4 on the GPU (H200; skipped without CUDA): ``moecomp.load`` straight onto CUDA, the peak memory of
loading and of ``random_packed_model`` at gpt-oss-20b / 120b size, and the optimized tiny model's greedy tokens.

Peak memory (``torch.cuda.max_memory_allocated`` over the call) may exceed what the model holds by
``PEAK_SLACK`` (the largest transient: one checkpoint tensor read before its view, or one layer's random bytes);
bf16 experts would add 3x the packed size.

Comparisons across devices or implementations are made where they are decidable: the tensors a CUDA load holds are
bit-identical to a CPU load's, and logits / greedy tokens are compared in fp32 (``TOL_DEVICE_FP32``; measured
8.8e-7 on an H200). In bf16 a random tiny gpt-oss sits near routing ties (its bf16 router logits round differently
in CPU and CUDA GEMMs and may pick another expert: one draw of ids gave 0.71 rel. logits difference, another 3.9e-3,
2026-12-03), so bf16 runs are checked by teacher forcing against the reference's own logits instead
(``tests/generate/test_generate_gpu.py``'s rule: each token within ``BF16_TOL`` of the reference's argmax, except at
positions whose routing sits within a bf16 rounding of a tie).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.testing import mxfp4_write as W  # noqa: E402
from moecomp.formats.packed import PackedExperts  # noqa: E402
from moecomp.testing import routing_near_ties  # noqa: E402

from .conftest import rel_err  # noqa: E402
from .test_mxfp4 import LAYERS, TOL_REF_BF16, logits, source_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.gpu
PEAK_SLACK = 1.10
TOL_DEVICE_FP32 = 1e-4
BF16_TOL = 2e-2  # tests/generate/test_generate_gpu.py's bf16 token tolerance (units of max |logit|)


def _held(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.state_dict().values()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


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
    cpu = moecomp.load(str(tmp_path), device="cpu")
    got = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # non-persistent buffers too
    want = {**dict(cpu.named_parameters()), **dict(cpu.named_buffers())}
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(_bits(got[k]), _bits(t)), k
    ids = torch.randint(3, 128, (2, 8))
    want32 = logits(moecomp.load(str(tmp_path), device="cpu", dtype=torch.float32), ids)
    got32 = logits(moecomp.load(str(tmp_path), device="cuda", dtype=torch.float32), ids.cuda()).cpu()
    assert rel_err(got32, want32) <= TOL_DEVICE_FP32


@pytest.mark.bigmem  # 13 GiB (20b) / 61 GiB (120b) at the peak, on an H100 at c199aad
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
    """The tiny loaded model optimized on CUDA (one block a layer bound to the 4-bit kernels): fp32 greedy tokens equal
    to the unoptimized model's; bf16 tokens each within ``BF16_TOL`` of the unoptimized model's argmax on the same
    sequence (teacher forcing) except at routing near-ties (module docstring)."""
    W.write_mxfp4_checkpoint(source_model(), str(tmp_path))
    ids = torch.randint(3, 128, (2, 8), device="cuda")
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    for dtype in (torch.float32, torch.bfloat16):
        model = moecomp.load(str(tmp_path), device="cuda", dtype=dtype)
        ref = moecomp.load(str(tmp_path), device="cuda", dtype=dtype)
        _, rep = moecomp.optimize(model, report=True)
        assert len(rep.rewritten) == len(rep.blocks) == LAYERS, rep
        with torch.no_grad():
            out = model.generate(ids, **gen)
            if dtype == torch.float32:
                assert torch.equal(out, ref.generate(ids, **gen))
                continue
            lg = ref(out).logits[:, ids.shape[1] - 1:-1].float()  # [B, n, V]: the logits that chose each token
        chosen = lg.gather(-1, out[:, ids.shape[1]:, None]).squeeze(-1)
        short = (lg.max(-1).values - chosen) / lg.abs().amax()
        near = routing_near_ties(model, out)[:, ids.shape[1] - 1:-1]
        assert not bool(((short > BF16_TOL) & ~near).any()), (short, near)
