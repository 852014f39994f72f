"""The Gluon FP8 launchers (ops/triton_fp8_gluon.gemm1 / gemm2) called on CPU tensors through this Triton's runtime
(``moecomp.testing.gluon_launch``: a stand-in sm_90 driver, the compile request caught by the runtime's
jit_cache_hook, then compiled for sm_90 here), in a child process without the interpreter. Checks what the launch
path decides and a GPU would receive: the descriptors' signature types (e4m3, the launcher's boxes, its NVMMA shared
layout), the launcher's num_warps, bias / hs / routing-weight pointers that are None as constexprs, and a PTX K loop
with ``wgmma.wait_group 1`` CHUNK - 1 times an iteration (the launcher's chunk). Run on Triton 3.6 (the GPU
machine's) and 3.9 (here)."""

import json

import pytest

from test_sm90_compile import compile_cases  # (tests/kernels is on sys.path)

pytest.importorskip("triton.experimental.gluon")

CHILD = r'''
import json, sys
from moecomp.testing import gluon_launch as gl, gluon_sm90 as g
out = {}
for name, c in json.loads(sys.argv[1]).items():
    which = c.pop("gemm")
    k, req = (gl.launch_gemm1 if which == 1 else gl.launch_gemm2)(**c)
    ptx = k.asm["ptx"]
    names = list(req["signature"])
    consts = {names[key[0]]: v for key, v in req["constants"].items() if len(key) == 1}
    out[name] = dict(
        desc={n: t for n, t in req["signature"].items() if n.endswith("_desc")}, num_warps=req["num_warps"],
        none=sorted(n for n, v in consts.items() if v is None and n.endswith("_ptr")),
        chunk=consts["CHUNK"], loops=[(b.count(g.LOOP_WAIT), b.count("wgmma.mma_async")) for b in g.loop_bodies(ptx)],
        e4m3="e4m3.e4m3" in ptx)
print(json.dumps(out))
'''

CASES = {  # gemm2: I = 768 (6 K steps: chunk 3); gemm1: H = 256 (2 K steps: chunk 2)
    "gemm2-bm64": dict(gemm=2, bm=64),
    "gemm2-bm128-ue8m0-bias": dict(gemm=2, bm=128, ue8m0=True, bias=True),
    "gemm1-bm64-h_quant": dict(gemm=1, bm=64, h_quant=True),
    "gemm1-bm128-bias-w_on_input-gelu": dict(gemm=1, bm=128, bias=True, w_on_input=True, act="gelu"),
}
LAYOUT = "NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2"


def _expected(case: dict) -> dict:
    from moecomp.ops import triton_fp8_gluon as fg

    bm = case["bm"]
    if case["gemm"] == 2:
        bn, nw = fg.tile(bm)
        chunk = fg.chunk(768 // 128)[0]
        none = [] if case.get("bias") else ["b_ptr"]
        boxes = {"h_desc": [bm, 128], "w_desc": [bn, 128]}
    else:
        bn, nw = fg.tile1(bm)[0], 8
        chunk = fg.chunk1(256 // 128, bm)[0]
        none = sorted(n for n, on in (("b_ptr", case.get("bias")), ("hs_ptr", case.get("h_quant")),
                                      ("topk_w_ptr", case.get("w_on_input"))) if not on)
        boxes = {"x_desc": [bm, 128], "w_desc": [bn, 128]}
    return dict(num_warps=nw, chunk=chunk, none=none, boxes=boxes)


def test_gluon_launchers_bind_and_compile_offline():
    res = compile_cases(CHILD, CASES)
    assert sorted(res) == sorted(CASES)
    for name, r in res.items():
        print(name, json.dumps({k: v for k, v in r.items() if k != "desc"}))
        want = _expected(CASES[name])
        assert r["num_warps"] == want["num_warps"] and r["chunk"] == want["chunk"], f"{name}: {r} vs {want}"
        assert r["none"] == want["none"], f"{name}: None pointers {r['none']}, expected {want['none']}"
        assert sorted(r["desc"]) == sorted(want["boxes"]), f"{name}: {r['desc']}"
        for arg, box in want["boxes"].items():
            t = r["desc"][arg].replace(" ", "")
            assert t.startswith(f"tensordesc<fp8e4nv[{box[0]},{box[1]}]") and LAYOUT.replace(" ", "") in t, \
                f"{name}: {arg} typed {r['desc'][arg]}"
        assert r["e4m3"], f"{name}: no e4m3 wgmma"
        loops = [lp for lp in r["loops"] if lp[1] > 0]
        assert len(loops) == 1 and loops[0][0] == r["chunk"] - 1 >= 1, f"{name}: K loop {r['loops']}"
