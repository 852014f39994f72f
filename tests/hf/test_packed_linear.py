"""4-bit dense linears (issue 22): ``torch.ops.moecomp.linear_4bit``, ``Packed4Linear``, and the int4 loader keeping
every int4 linear of a GPTQ / AWQ checkpoint 4-bit. GPU: tests/hf/test_packed_linear_gpu.py.

The oracle is written here by hand from the codes (not through ``moecomp.core.quant.dequantize``): int4
``W[n, k] = (code - zero[n, k // g]) * scale[n, k // g]`` (zero 8 when symmetric), mxfp4
``W[n, k] = E2M1[code] * 2 ** (byte[n, k // 32] - 127)``, and ``y = (x.float() @ W.T + bias.float()).to(x.dtype)``.
The packed bytes are written by hand too (input 2j in the low nibble of byte j). Tolerances:

* CPU torch path: **exact** (the same fp32 weights, one fp32 matmul, one rounding to x's dtype);
* Triton kernels under the interpreter (MOECOMP_CPU_BACKEND=triton, outputs NaN-poisoned), relative Frobenius error:
  fp32 ``TOL_FP32`` 1e-5 (fp32 sums in another order; measured <= 3e-7), fp16 ``TOL_FP16`` 2e-3 (one rounding of the
  output to fp16, 2^-11 relative, and fp16 dots in the MMA form; measured <= 3e-7);
* loaded models' logits (max |a - b| / max |b|): ``test_gptq.TOL_FP32`` 1e-5 in fp32 against the same model whose
  quantized weights are ``dequantize(quantize_4bit(W))`` (what the checkpoint holds). For scale, the quantization
  itself moves those logits ~1e-1 (printed).
"""

from __future__ import annotations

import logging

import pytest
import torch

import moecomp
from moecomp.api import load_gptq as L
from moecomp.testing import int4_writer as W
from moecomp.formats.packed import PackedExperts
from moecomp.formats.packed_linear import Packed4Linear
from moecomp.kernels import linear4 as lin4_k
from moecomp.ops import linear4, triton_linear4
from moecomp.core.spec import QuantSpec

from .conftest import rel_err
from .test_gptq import TOL_FP32, build, logits

TOL_FP32_KERNEL = 1e-5
TOL_FP16 = 2e-3
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

QUANTS = {
    "int4_g32_sym": QuantSpec.int4(32),
    "int4_g128_zp_bf16": QuantSpec.int4(128, zero_point=True, scale_dtype="bf16"),
    "int4_g64_zp_fp32": QuantSpec.int4(64, zero_point=True, scale_dtype="fp32"),
    "mxfp4": QuantSpec.mxfp4(),
}


def make(quant: QuantSpec, N: int, K: int, seed: int = 0):
    """(q [N, K / 2] uint8, scale, zero or None, W [N, K] fp32): random codes, scales, zeros; W by hand."""
    g = torch.Generator().manual_seed(seed)
    G_ = -(-K // quant.block_k)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4)  # input 2j low nibble, 2j + 1 high nibble
    grp = torch.arange(K) // quant.block_k
    zero = None
    if quant.weight == "mxfp4":
        sb = torch.randint(118, 131, (N, G_), generator=g, dtype=torch.uint8)
        scale = sb.view(torch.float8_e8m0fnu)
        w = torch.tensor(E2M1)[codes.long()] * torch.exp2(sb.float() - 127)[:, grp]
    else:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[quant.scale_dtype]
        scale = (torch.rand(N, G_, generator=g) * 0.05 + 1e-3).to(dt)
        z = torch.full((N, G_), 8, dtype=torch.uint8)
        if quant.zero_point:
            zero = z = torch.randint(0, 16, (N, G_), generator=g, dtype=torch.uint8)
        w = (codes.float() - z.float()[:, grp]) * scale.float()[:, grp]
    return q, scale, zero, w


def oracle(x, w, b):
    y = x.float() @ w.T
    return (y if b is None else y + b.float()).to(x.dtype)


def frob(a, b) -> float:
    """Relative Frobenius error (the kernels' tolerances)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def op(x, q, s, z, b, quant):
    return torch.ops.moecomp.linear_4bit(x, q, s, z, b, quant.key)


# ------------------------------------------------------------------------------------------------ CPU torch path
@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_exact(name, bias, shape, dtype):
    quant = QUANTS[name]
    q, s, z, w = make(quant, 24, 192, seed=len(shape))  # K = 192: group 128's last group is short
    b = torch.randn(24).to(dtype) if bias else None
    x = torch.randn(*shape, 192).to(dtype)
    want = oracle(x.reshape(-1, 192), w, b).reshape(*shape, 24)
    got = op(x, q, s, z, b, quant)
    assert got.shape == (*shape, 24) and got.dtype == dtype
    assert torch.equal(got, want)
    mod = Packed4Linear(quant, q, s, z, b)
    assert torch.equal(mod(x), want)  # the module's eager call (no dispatcher) computes the same
    assert torch.equal(mod.dequantized(), w)


# ------------------------------------------------------------------------------------------------ Triton kernels
class _Count:
    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


@pytest.fixture
def counted(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ("MOECOMP_SKINNY", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM"):
        monkeypatch.delenv(var, raising=False)
    c = {"skinny": _Count(lin4_k.skinny4_kernel), "mma": _Count(lin4_k.linear4_kernel)}
    monkeypatch.setattr(lin4_k, "skinny4_kernel", c["skinny"])
    monkeypatch.setattr(lin4_k, "linear4_kernel", c["mma"])
    return c


@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_interpreter(counted, poison, name, M, dtype):
    """Both kernels (skinny at M <= 4, MMA at 17) through the op, every format: group 32 (mxfp4, int4: several
    groups a skinny step of 64 columns) and 64 / 128 (one group a step; 128: a short last group), bias on, N not a
    multiple of any tile."""
    quant = QUANTS[name]
    q, s, z, w = make(quant, 24, 192, seed=M)
    b = torch.randn(24).to(dtype)
    x = torch.randn(M, 192).to(dtype)
    got = op(x, q, s, z, b, quant)
    assert counted["skinny" if M <= 4 else "mma"].n == 1 and counted["mma" if M <= 4 else "skinny"].n == 0
    err = frob(got, oracle(x, w, b))
    assert torch.isfinite(got).all() and err <= (TOL_FP32_KERNEL if dtype == torch.float32 else TOL_FP16), err


@pytest.mark.parametrize("opts", [dict(w4_form="split"), dict(w4_fold=1), dict(skinny=0)])
def test_triton_mma_options(counted, poison, opts):
    """The MMA form's K-step options (the experts' ``triton_quant4.options``), and the MMA form forced at 2 rows;
    3-D x without bias."""
    quant = QUANTS["int4_g64_zp_fp32"]
    q, s, z, w = make(quant, 40, 128, seed=5)
    x = torch.randn(2, 1 if "skinny" in opts else 9, 128)
    cfg = dict(triton_linear4.linear4_config(18, 40, 128, x.device, 4, "int4"), **opts)
    got = triton_linear4.linear_4bit(x, q, s, z, None, quant, cfg=cfg)
    assert counted["mma"].n == 1 and counted["skinny"].n == 0
    assert frob(got, oracle(x.reshape(-1, 128), w, None).reshape(got.shape)) <= TOL_FP32_KERNEL


# ------------------------------------------------------------------------------------------------ op contract
@pytest.mark.parametrize("name,bias,grad", [("int4_g128_zp_bf16", True, True), ("mxfp4", False, False)])
def test_opcheck(name, bias, grad):
    quant = QUANTS[name]
    q, s, z, _ = make(quant, 16, 128)
    x = torch.randn(3, 128, requires_grad=grad)
    b = torch.randn(16) if bias else None
    tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
             "test_aot_dispatch_dynamic"]
    if s.dtype == torch.float8_e8m0fnu:  # test_schema's allclose has no e8m0 kernel (as tests/ops/test_quant4.py)
        tests.remove("test_schema")
    before = [t.clone() for t in (q, s, z) if t is not None]
    torch.library.opcheck(torch.ops.moecomp.linear_4bit.default, (x, q, s, z, b, quant.key), test_utils=tests)
    assert all(torch.equal(a, t) for a, t in zip(before, [t for t in (q, s, z) if t is not None]))


def test_backward_through_dequantized_weight():
    """x's and the bias's gradients are those of the dense linear on the dequantized weight (the codes get none)."""
    quant = QUANTS["int4_g64_zp_fp32"]
    q, s, z, w = make(quant, 16, 128)
    x = torch.randn(2, 3, 128, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    gy = torch.randn(2, 3, 16)
    op(x, q, s, z, b, quant).backward(gy)
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w, b2).backward(gy)
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-6) and torch.allclose(b.grad, b2.grad)


def test_bad_inputs_name_the_argument():
    quant = QUANTS["int4_g64_zp_fp32"]
    q, s, z, _ = make(quant, 16, 128)
    x = torch.randn(2, 128)
    cases = [
        (dict(x=x[:, :64]), r"x has shape \(2, 64\); its last dim must be the weight's in_features 128"),
        (dict(x=x.long()), r"x has dtype torch.int64; expected float32"),
        (dict(q=q.int()), r"q has shape \(16, 64\) and dtype torch.int32; expected 2-D \[out, in / 2\] torch.uint8"),
        (dict(s=s[:, :1]), r"scale has shape \(16, 1\) and dtype torch.float32; expected \[16, 2\] torch.float32"),
        (dict(s=s.half()), r"scale has shape \(16, 2\) and dtype torch.float16; expected \[16, 2\] torch.float32"),
        (dict(z=None), r"zero is None; quant.zero_point needs \[16, 2\] torch.uint8"),
        (dict(z=z.int()), r"zero is shape \(16, 2\) and dtype torch.int32; quant.zero_point needs"),
        (dict(b=torch.randn(8)), r"bias has shape \(8,\) and dtype torch.float32; expected a float \[16\]"),
        (dict(b=torch.randn(16, device="meta")), r"bias is on meta; expected cpu"),
    ]
    base = dict(x=x, q=q, s=s, z=z, b=None)
    for change, msg in cases:
        a = {**base, **change}
        with pytest.raises(ValueError, match=msg):
            op(a["x"], a["q"], a["s"], a["z"], a["b"], quant)
    sym = QUANTS["int4_g32_sym"]
    with pytest.raises(ValueError, match=r"zero is given \(\(16, 4\)\) but the quant spec has no zero_point"):
        op(x, q, make(sym, 16, 128)[1], torch.zeros(16, 4, dtype=torch.uint8), None, sym)
    with pytest.raises(ValueError, match=r"linear_4bit takes a 4-bit one"):
        torch.ops.moecomp.linear_4bit(x, q, s, z, None, QuantSpec().key)
    with pytest.raises(ValueError, match=r"quant must be a 4-bit QuantSpec"):
        Packed4Linear(QuantSpec(), q, s, z)
    with pytest.raises(ValueError, match=r"scale has shape \(16, 1\)"):
        Packed4Linear(quant, q, s[:, :1], z)
    with pytest.raises(ValueError, match=r"perm has shape \(64,\).*expected an integer \[128\] permutation"):
        Packed4Linear(quant, q, s, z, perm=torch.arange(64))


def test_module_holds_the_codes_frozen():
    """The tensors are held as given (no copy, nothing dequantized kept), frozen; act-order: x gathered by perm."""
    quant = QUANTS["int4_g32_sym"]
    q, s, _, w = make(quant, 16, 128)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    mod = Packed4Linear(quant, q, s, perm=perm)
    assert mod.qweight.data_ptr() == q.data_ptr() and mod.scales.data_ptr() == s.data_ptr()
    assert not any(p.requires_grad for p in mod.parameters()) and not any(p.is_floating_point() and p.dim() == 2
                                                                          and p.shape == (16, 128)
                                                                          for p in mod.parameters())
    x = torch.randn(3, 128)
    want = torch.empty_like(w)
    want[:, perm] = w  # stored column j is input perm[j]
    assert torch.equal(mod.dequantized(), want)
    assert rel_err(mod(x), x @ want.T) <= 1e-6
    assert "int4 g32" in repr(mod) and "act-order" in repr(mod)


# ------------------------------------------------------------------------------------------------ the int4 loader
def _act_order(t: dict, prefix: str, w: torch.Tensor, group: int, seed: int) -> torch.Tensor:
    """Replace ``prefix``'s GPTQ tensors in ``t`` by an act-order quantization of ``w`` [N, K] (groups formed over
    a random input order, as GPTQ's desc_act does); returns the weight the checkpoint then holds."""
    from moecomp.core import quant as q8

    K = w.shape[1]
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    codes_p, zeros, scales = W.quantize_linear(w[:, perm], group, sym=False)  # [K, N] in perm's order
    codes = torch.empty_like(codes_p)
    codes[perm] = codes_p
    qw, qz, sc, _ = W.pack_gptq(codes, zeros, scales, v1=True, group=group)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // group).to(torch.int32)
    t.update({f"{prefix}.qweight": qw, f"{prefix}.qzeros": qz, f"{prefix}.scales": sc, f"{prefix}.g_idx": g_idx})
    spec = QuantSpec.int4(group, zero_point=True)
    wp = q8.dequantize(q8.pack_4bit(codes_p.t()), scales.t(), spec, zero=zeros.t())
    out = torch.empty_like(wp)
    out[:, perm] = wp
    return out


def test_gptq_shared_experts_and_attention_stay_4bit(tmp_path, caplog):
    """Qwen2-MoE, GPTQ v1 with zero points, attention and shared experts int4, one attention projection act-order:
    every int4 linear loads as a Packed4Linear (no float weight of its own), no warning, the logits those of the
    dequantized model; ``optimize`` rewrites each block by the pair rewrite (router + experts in one op, the 4-bit
    shared expert left as the block's own call: 4-bit shared experts are not in the spec), and ``generate`` gives
    the same greedy tokens."""
    from safetensors.torch import load_file, save_file

    model = build("qwen2_moe")
    path = W.write_int4_checkpoint(model, str(tmp_path), "gptq", 64, False, attention=True, dense=True)
    ref = copy_reference(model)
    f = f"{path}/model.safetensors"
    t = load_file(f)
    k_proj = model.model.layers[1].self_attn.k_proj
    with torch.no_grad():
        ref.model.layers[1].self_attn.k_proj.weight.copy_(_act_order(t, "model.layers.1.self_attn.k_proj",
                                                                     k_proj.weight.float(), 64, 3))
    save_file(t, f, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="moecomp.api.load_gptq"):
        got = L.load_int4(path, dtype=torch.float32)
    assert not caplog.text
    lin = {n: m for n, m in got.named_modules() if isinstance(m, Packed4Linear)}
    layers = model.config.num_hidden_layers
    assert len(lin) == 7 * layers and sum("shared_expert." in n for n in lin) == 3 * layers
    assert lin["model.layers.1.self_attn.k_proj"].perm is not None and lin["model.layers.0.self_attn.k_proj"].perm \
        is None
    assert all(m.quant == QuantSpec.int4(64, zero_point=True) and m.qweight.dtype == torch.uint8 for m in lin.values())
    sd = got.state_dict()
    assert not [n for n in lin if n + ".weight" in sd]  # no float copy of any of them
    assert got.model.layers[0].mlp.shared_expert_gate.weight.dtype == torch.float32  # [1, H]: not quantizable
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    want = logits(got, ids)
    err = rel_err(want, logits(ref, ids))
    print(f"qwen2_moe int4 linears: err {err:.2e}; quantization itself {rel_err(want, logits(model, ids)):.2e}")
    assert err <= TOL_FP32
    prompt = ids[:1, :5]
    tokens = got.generate(prompt, max_new_tokens=5, do_sample=False)
    got, rep = moecomp.optimize(got, report=True)
    assert [b.status for b in rep.blocks] == ["rewritten"] * layers and all(b.method == "pair" for b in rep.blocks)
    assert all(isinstance(m, PackedExperts) for n, m in got.named_modules() if n.endswith("mlp.experts"))
    assert rel_err(logits(got, ids), want) <= TOL_FP32
    assert torch.equal(got.generate(prompt, max_new_tokens=5, do_sample=False), tokens)


def copy_reference(model):
    from .test_gptq import reference

    ref = reference(model, 64, False)  # experts and attention dequantize(quantize_4bit(W))
    q = W.int4_spec(64, False)
    from moecomp.core import quant as q8

    with torch.no_grad():
        for name, p in ref.named_parameters():
            if W.DENSE_KEY.search(name) and p.shape[0] % 8 == 0 and p.shape[1] % 64 == 0:
                wq, s, z = q8.quantize_4bit(p.float(), q)
                p.copy_(q8.dequantize(wq, s, q, zero=z))
    return ref


def test_deepseek_4bit_shared_experts_refused_with_reason(tmp_path):
    """DeepSeek-V3's blocks with 4-bit shared experts: the FX pass refuses them (SPEC_INVALID: 4-bit shared experts
    are not in the spec; the reason names the linear_4bit nodes) and the pair rewrite cannot read its group-limited
    routing: the blocks are left as they are (same logits), each with the reason."""
    from moecomp.recognise.capture import DetectError, detect_block
    from moecomp.core.reject import RejectCode

    model = build("deepseek_v3")
    path = W.write_int4_checkpoint(model, str(tmp_path), "gptq", 64, False, attention=True, dense=True)
    got = L.load_int4(path, dtype=torch.float32)
    assert any(n.endswith("shared_experts.down_proj") for n, m in got.named_modules() if isinstance(m, Packed4Linear))
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    want = logits(got, ids)
    got, rep = moecomp.optimize(got, report=True, fast_generate=False)
    assert rep.blocks and all(b.status == "skipped" for b in rep.blocks)
    assert all("4-bit shared experts are not supported" in b.reason for b in rep.blocks)
    assert torch.equal(logits(got, ids), want)
    block = got.model.layers[0].mlp
    with pytest.raises(DetectError) as e:
        detect_block(block, torch.randn(1, 4, block.config.hidden_size))
    assert any(r.code == RejectCode.SPEC_INVALID and "linear_4bit" in r.message for _, r in e.value.rejected)


# ------------------------------------------------------------------------------------------------ sm90 compile
SM90_CHILD = r'''
import inspect, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import linear4 as lk

DIV16 = ("x_ptr", "w_ptr", "ws_ptr", "zp_ptr", "y_ptr", "stride_xm", "stride_wn", "stride_ym", "K", "N")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {}
for case in json.loads(sys.argv[1]):
    kind, w4, g, nw, tiles = case
    ptr = dict(x_ptr="*bf16", w_ptr="*u8", ws_ptr="*u8" if w4 == 1 else "*fp16", zp_ptr="*u8", b_ptr="*bf16",
               y_ptr="*bf16")
    c = dict(HAS_BIAS=True, W4=w4, Q_BLOCK_K=g, UE8M0=w4 == 1, **tiles)
    if w4 != 3:
        c["zp_ptr"] = None
    if kind == "skinny":
        fn = lk.skinny4_kernel
    else:
        fn = lk.linear4_kernel
        c.update(UPCAST=False, DOT_PRECISION="tf32", GROUP_M=8, FOLD=0, FORM=0)
    params = list(inspect.signature(fn.fn).parameters)
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(params):
        if p in c:
            sig[p], const[(i,)] = "constexpr", c[p]
        else:
            sig[p] = ptr.get(p, "i32")
            if p in DIV16:  # as Triton specializes aligned pointers / strides at run time
                attrs[(i,)] = [["tt.divisibility", 16]]
    key = json.dumps(case)
    try:
        k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=nw, num_stages=3))
        res = "ok" if f".entry {fn.fn.__name__}" in k.asm["ptx"] else "no entry in the PTX"
        if res == "ok" and "cubin" in k.asm and os.path.exists(CUOBJDUMP):
            f = tempfile.mktemp(suffix=".cubin")
            with open(f, "wb") as fh:
                fh.write(k.asm["cubin"])
            usage = subprocess.run([CUOBJDUMP, "-res-usage", f], capture_output=True, text=True).stdout
            if "STACK:0 " not in usage:
                res = "spills: " + " ".join(l.strip() for l in usage.splitlines() if "REG" in l)
        out[key] = res
    except Exception as e:
        out[key] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

SM90_CASES = [  # (kernel, W4, group, warps, tiles): the launcher's shapes (ops/triton_linear4.py)
    ("skinny", 3, 128, 4, dict(ROWS=4, BLOCK_N=4, BLOCK_K=1024, REDUCE_END=1)),
    ("mma", 3, 32, 8, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32)),
    ("mma", 1, 32, 8, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)),
]


def test_kernels_compile_for_sm90_without_spills():
    """Both kernels compile for Hopper on this CPU machine (what the interpreter lets through, e.g. a None pointer
    in arithmetic, fails here), and their SASS uses no stack (cuobjdump -res-usage; measured 62-210 registers)."""
    import json
    import os
    import subprocess
    import sys

    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("this Triton has no NVIDIA backend")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SM90_CHILD, json.dumps(SM90_CASES)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == len(SM90_CASES) and all(v == "ok" for v in res.values()), json.dumps(res, indent=1)


def test_int4_lm_head_tied_to_embeddings_refused(tmp_path):
    """An int4 lm_head in a checkpoint whose config ties it to the (16-bit) embeddings is contradictory: refused."""
    from safetensors.torch import load_file, save_file

    from .test_gptq import SIZES
    from moecomp.coverage import families as F

    model, _ = F.build_tiny("qwen3_moe", sizes={**SIZES["qwen3_moe"], "tie_word_embeddings": True})
    path = W.write_int4_checkpoint(model.float().eval(), str(tmp_path), "gptq", 64, True)
    f = f"{path}/model.safetensors"
    t = load_file(f)
    t.update(W._convert_key("lm_head.weight", model.lm_head.weight.detach().float(), "gptq", 64, True, True))
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.*tie_word_embeddings"):
        L.load_int4(path, dtype=torch.float32)
