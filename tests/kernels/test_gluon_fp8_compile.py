"""The Gluon FP8 gemm2 (kernels/gluon_fp8.py) compiled for sm_90 on this CPU machine (a child process without the
interpreter): its K loop must keep one wgmma in flight while the previous step's product is promoted. PTX: the
loop body holds fp8 wgmmas and ``wgmma.wait_group.sync.aligned 1`` (CHUNK - 1 of them an iteration). SASS, where
Triton's bundled ptxas reads the PTX: ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` survives, ptxas reports no serialization
(C7514 / C7512) and no spill. Either fails if the compiler serializes the steps (as a one-step loop that carries the
in-flight product did: C7514). Tiles as the launcher (ops/triton_fp8_gluon.py) picks them."""

import json
import sys

import pytest

from test_sm90_compile import compile_cases  # (tests/kernels is on sys.path)

pytest.importorskip("triton.experimental.gluon")

CHILD = r'''
import json, sys
from moecomp.testing import gluon_sm90 as g
from moecomp.ops.triton_fp8_gluon import chunk
out = {}
for name, c in json.loads(sys.argv[1]).items():
    ch, tail = chunk(c.pop("nk"))
    ptx = g.compile_gemm2(chunk=ch, tail=tail, **c)
    loops = g.loop_bodies(ptx)
    out[name] = dict(chunk=ch, tail=tail, wgmma=ptx.count("wgmma.mma_async.sync.aligned"),
                     e4m3="e4m3.e4m3" in ptx, loops=[(b.count(g.LOOP_WAIT), b.count("wgmma.mma_async")) for b in loops],
                     sass=g.sass_check(ptx))
print(json.dumps(out))
'''

CASES = {  # nk: K steps (I / 128): Qwen3-30B-A3B 6, DeepSeek-V3 16, Qwen1.5-MoE 11
    "qwen3-bm64": dict(bm=64, nk=6),
    "deepseek-bm128-ue8m0": dict(bm=128, nk=16, ue8m0=True),
    "qwen15-bm64-bias-unweighted-tail": dict(bm=64, nk=11, bias=True, weighted=False),
}


def test_gluon_gemm2_keeps_one_wgmma_in_flight():
    res = compile_cases(CHILD, CASES)
    assert sorted(res) == sorted(CASES)
    for name, r in res.items():
        s = r["sass"]
        print(name, json.dumps({k: v for k, v in r.items() if k != "sass"}), s and (s["ptxas"], s["depbar"]))
        assert r["e4m3"] and r["wgmma"] > 0, name
        loops = [lp for lp in r["loops"] if lp[1] > 0]
        assert len(loops) == 1, f"{name}: one K loop with wgmmas expected, {r['loops']}"
        assert loops[0][0] == r["chunk"] - 1 >= 1, f"{name}: wait_group 1 a step inside the loop, {r}"
        if s is None:
            continue  # no bundled ptxas reads this PTX: the PTX checks stand alone
        assert "C7514" not in s["info"] and "C7512" not in s["info"], f"{name}: ptxas serialized: {s['info']}"
        assert s["spill"] == 0, f"{name}: {s['spill']} bytes spilled"
        assert s["depbar"].get("1", 0) >= r["chunk"] - 1, f"{name}: SASS waits {s['depbar']}"
