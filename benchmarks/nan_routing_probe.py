#!/usr/bin/env python3
"""Run the whole op on router rows of NaN / +inf, for ``compute-sanitizer --tool memcheck`` to watch.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 benchmarks/nan_routing_probe.py [--routing OTHER_routing.py]

Every tensor is then its own allocation (no caching allocator), so an expert id past the last expert, which makes the
expert GEMMs read past the end of the weights, is an out-of-bounds access memcheck reports. ``--routing`` runs the op
with another version of ``moecomp/kernels/routing.py`` (e.g. the one before the NaN-aware selection), to show that
the probe can fail. Prints, per case, the largest expert id routing chose and whether the ids were distinct.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec
from moecomp.testing import random_moe_args

CASES = {
    "sqrtsoftplus_bias_384": MoESpec(num_experts=384, top_k=6, hidden_size=256, intermediate_size=128,
                                     scoring="sqrtsoftplus", has_correction_bias=True),
    "softmax_8": MoESpec(num_experts=8, top_k=4, hidden_size=256, intermediate_size=128),
    "sigmoid_grouped_256": MoESpec(num_experts=256, top_k=8, hidden_size=256, intermediate_size=128,
                                   scoring="sigmoid", has_correction_bias=True, n_group=8, topk_group=4),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routing", default=None, help="another routing.py to run the op with")
    ap.add_argument("--tokens", default="1,3,40")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("nan_routing_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.routing:
        sys.path.insert(0, "benchmarks")
        from diag_kernels import _load_routing

        triton_moe.routing_k = _load_routing(a.routing)
    bad_cases = 0
    with torch.no_grad():
        for name, spec in CASES.items():
            for T in [int(t) for t in a.tokens.split(",")]:
                args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T)
                x = args[0].clone()
                x[0] = float("nan")
                if T > 1:
                    x[-1] = float("inf")
                named = dict(zip(MOE_ARGS, args[1:]))
                logits, _ = triton_moe.router_logits(x, named, spec)
                ids, w = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
                out = triton_moe.moe_forward(x, named, spec)
                torch.cuda.synchronize()
                hi = int(ids.max())
                distinct = bool((ids.long().sort(1).values.diff(dim=1) > 0).all())
                finite_w = bool(torch.isfinite(w).all())
                ok = hi < spec.num_experts and distinct and finite_w
                bad_cases += not ok
                print(f"[probe] {name:22s} T={T:3d} max id {hi:4d} (E={spec.num_experts}) distinct {distinct} "
                      f"finite weights {finite_w} | clean rows finite {bool(torch.isfinite(out[1:-1]).all())}"
                      + ("" if ok else "  CONTRACT BROKEN"), flush=True)
    print(f"[probe] {bad_cases} case(s) broke the routing contract")
    return 1 if bad_cases else 0


if __name__ == "__main__":
    sys.exit(main())
