"""The Gluon FP8 gemm1 (kernels/gluon_fp8_gemm1.py) compiled for sm_90 on this CPU machine (a child process without
the interpreter), at the tiles the launcher (ops/triton_fp8_gluon.tile1 / chunk1) picks: its K loop must keep one
wgmma (N 128 a warp group, gate and up rows together) in flight while the previous step's product is promoted. PTX:
one K loop with fp8 wgmmas and ``wgmma.wait_group.sync.aligned 1`` (CHUNK - 1 of them an iteration); shared memory
within the 227 KiB an sm_90 block may have. SASS, where Triton's bundled ptxas reads the PTX:
``WARPGROUP.DEPBAR.LE gsb0, 0x1`` survives, no C7514 / C7512 serialization, no spill, registers printed."""

import json

import pytest

from test_sm90_compile import compile_cases  # (tests/kernels is on sys.path)

pytest.importorskip("triton.experimental.gluon")

CHILD = r'''
import json, re, sys
from moecomp.testing import gluon_sm90 as g
from moecomp.ops.triton_fp8_gluon import chunk1, tile1
out = {}
for name, c in json.loads(sys.argv[1]).items():
    bm, nk = c.pop("bm"), c.pop("nk")
    bn, wn, stages = tile1(bm)
    ch, tail = chunk1(nk, bm)
    ptx, shared = g.compile_gemm1(bm=bm, bn=bn, warps_n=wn, stages=stages, chunk=ch, tail=tail, **c)
    loops = g.loop_bodies(ptx)
    s = g.sass_check(ptx)
    if s is not None:
        regs = re.search(r"Used (\d+) registers", s["info"])
        s["regs"] = int(regs.group(1)) if regs else None
    out[name] = dict(chunk=ch, tail=tail, shared=shared, wgmma=ptx.count("wgmma.mma_async.sync.aligned"),
                     n128="m64n128k32.f32.e4m3.e4m3" in ptx,
                     loops=[(b.count(g.LOOP_WAIT), b.count("wgmma.mma_async")) for b in loops], sass=s)
print(json.dumps(out))
'''

CASES = {  # nk: K steps (H / 128): Qwen3-30B-A3B / Qwen1.5-MoE 16, DeepSeek-V3 56, a multiple of 3: 24
    "qwen3-bm64-q_out": dict(bm=64, nk=16, q_out=2),
    "qwen3-bm128": dict(bm=128, nk=16),
    "deepseek-bm64-ue8m0-q_out": dict(bm=64, nk=56, ue8m0=True, q_out=2),
    "bm128-chunk3-bias-gelu": dict(bm=128, nk=24, bias=True, act=1),
    "bm64-tail-w_on_input-relu2": dict(bm=64, nk=17, w_on_input=True, act=5),
}


def test_gluon_gemm1_keeps_one_wgmma_in_flight():
    res = compile_cases(CHILD, CASES)
    assert sorted(res) == sorted(CASES)
    for name, r in res.items():
        s = r["sass"]
        print(name, json.dumps({k: v for k, v in r.items() if k != "sass"}),
              s and dict(ptxas=s["ptxas"], depbar=s["depbar"], regs=s["regs"], spill=s["spill"]))
        assert r["n128"] and r["wgmma"] > 0, f"{name}: fp8 m64n128k32 wgmmas expected"
        assert r["shared"] <= 227 * 1024, f"{name}: {r['shared']} bytes of shared memory"
        loops = [lp for lp in r["loops"] if lp[1] > 0]
        assert len(loops) == 1, f"{name}: one K loop with wgmmas expected, {r['loops']}"
        assert loops[0][0] == r["chunk"] - 1 >= 1, f"{name}: wait_group 1 a step inside the loop, {r}"
        if s is None:
            continue  # no bundled ptxas reads this PTX: the PTX checks stand alone
        assert "C7514" not in s["info"] and "C7512" not in s["info"], f"{name}: ptxas serialized: {s['info']}"
        assert s["spill"] == 0, f"{name}: {s['spill']} bytes spilled"
        assert s["depbar"].get("1", 0) >= r["chunk"] - 1, f"{name}: SASS waits {s['depbar']}"
