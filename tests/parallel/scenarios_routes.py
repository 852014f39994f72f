"""Routing record and replay on the parallel path (issue 43), checks for the runners of ``scenarios.py`` (threads:
``test_parallel_emulated.py``; gloo processes: ``test_parallel_gloo.py``). Rows (name, rank, error, tolerance).

- ``check_routes_op``: the parallel forward (EP all-reduce, EP all-to-all, TP) recording into ``routes_out`` /
  ``route_weights_out`` gives the one-GPU op's record (ids exactly: the error is the count of differing ids, tolerance
  0.5; weights within ``TOL``), replaying those ids gives the recorded call's output, and replaying other, given
  global ids equals the oracle's replay of them (``TOL``, fp32). On a real group (``comm`` None) also through the
  custom ops ``moe_parallel_routes`` / ``moe_parallel(..., routes_in)``.
- ``check_routes_model``: tiny HF models (Qwen3-MoE on EP, DeepSeek-V3 on TP) optimized, then sharded: record on the
  sharded model equals record on the whole one (ids exactly), replay of the recorded routes gives the whole model's
  logits, and replay of other routes gives the whole model's replay of them (``MODEL_TOL``, fp32); and
  ``generate(return_routed_experts=True)`` on the engine's path (CPU steps) returns the whole model's routes and
  tokens exactly.
"""

from __future__ import annotations

import torch

from moecomp import parallel as par
from moecomp.core.args import OP_ARGS
from moecomp.ops.moe_op import call_moe_forward
from moecomp.testing import rel_err
from scenarios import SPECS, TOL, block, oracle, parallel_spec

MODEL_TOL = 1e-4  # fp32 logits through 2 layers: relative Frobenius error (the all-reduce's summation order only)


def other_routes(lead: tuple, E: int, k: int, seed: int = 7) -> torch.Tensor:
    """Distinct random global ids [*lead, k] (int64), the same on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(lead).prod()) if lead else 1
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    return ids.reshape(*lead, k)


def _bufs(T: int, k: int):
    return torch.full((T, k), -7, dtype=torch.int32), torch.full((T, k), float("nan"))


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.long() != b.long()).sum()) if a.shape == b.shape else float("inf")


def check_routes_op(rank: int, W: int, comm=None) -> list:
    rows = []
    for name in ("mixtral", "deepseek_v3", "latent"):
        spec = SPECS[name]
        x, t = block(name, 6)
        T, k = x.shape[0], spec.top_k
        want_ids, want_w = _bufs(T, k)
        call_moe_forward(x, [t.get(n) for n in OP_ARGS], spec, routes_out=want_ids, route_weights_out=want_w)
        given = other_routes((T,), spec.num_experts, k)
        ref_given = oracle(x, {**t, "routes_in": given}, spec)
        assert rel_err(ref_given, oracle(x, t, spec)) > 1e-2  # the given routes change the block's output
        for mode in ("ep", "ep_a2a", "tp"):
            ps = parallel_spec(name, mode, W, rank)
            args = {**t, **par.shard_tensors(t, ps)}
            ids, w = _bufs(T, k)
            y = par.forward(x, {**args, "routes_out": ids, "route_weights_out": w}, ps, comm)
            tag = f"routes {name}/{mode}"
            rows += [(f"{tag} record ids", rank, _mismatch(ids, want_ids), 0.5),
                     (f"{tag} record weights", rank, rel_err(w, want_w), TOL),
                     (f"{tag} record output", rank, rel_err(y, oracle(x, t, spec)), TOL)]
            again = par.forward(x, {**args, "routes_in": ids}, ps, comm)
            rows.append((f"{tag} replay recorded", rank, rel_err(again, y), TOL))
            ids2, _ = _bufs(T, k)
            got = par.forward(x, {**args, "routes_in": given, "routes_out": ids2}, ps, comm)
            rows += [(f"{tag} replay given", rank, rel_err(got, ref_given), TOL),
                     (f"{tag} replay given recorded", rank, _mismatch(ids2, given), 0.5)]
            if comm is None:  # a real process group: the custom ops (what compiled / traced callers reach)
                rows += _through_ops(x, args, ps, given, (oracle(x, t, spec), ref_given), want_ids, tag, rank)
    return rows


def _through_ops(x, args, ps, given, refs, want_ids, tag: str, rank: int) -> list:
    """``refs``: the oracle's output (whole block) without and with the given routes."""
    tensors = [args.get(n) for n in OP_ARGS]
    ids, w = _bufs(*want_ids.shape)
    y = torch.ops.moecomp.moe_parallel_routes(ids, w, x, tensors, ps.key)
    got = torch.ops.moecomp.moe_parallel(x, tensors, ps.key, given)
    return [(f"{tag} op record ids", rank, _mismatch(ids, want_ids), 0.5),
            (f"{tag} op record output", rank, rel_err(y, refs[0]), TOL),
            (f"{tag} op replay given", rank, rel_err(got, refs[1]), TOL)]


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def check_routes_model(rank: int, W: int, comm=None) -> list:
    import os
    import sys

    import moecomp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: generate.models
    from generate.models import build, prompts

    rows = []
    for family, mode in (("qwen3_moe", "ep"), ("deepseek_v3", "tp")):
        model = build(family, layers=2, seed=0)
        ids, mask = prompts(96, 2, 5, seed=1)
        moecomp.optimize(model, use_capture=False)
        with moecomp.record_routing(model) as rec:
            want = _logits(model, ids, mask)
        routes = rec.routes
        k = routes.shape[-1]
        E = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
        other = other_routes(tuple(routes.shape[:-1]), E, k)
        with moecomp.replay_routing(other, model):
            want_other = _logits(model, ids, mask)
        assert rel_err(want_other, want) > 1e-2  # the other routes change the logits
        model.generate.cpu = True  # the engine's steps (as on the GPU, without the graphs)
        gen_want = _generate_routes(model, ids, mask)
        report = moecomp.shard_experts(model, None, mode)
        assert len(report) == 2 and all(mode in v for v in report.values()), report
        with moecomp.record_routing(model) as rec:
            got = _logits(model, ids, mask)
        tag = f"routes hf {family}/{mode}"
        rows += [(f"{tag} record ids", rank, _mismatch(rec.routes, routes), 0.5),
                 (f"{tag} record logits", rank, rel_err(got, want), MODEL_TOL)]
        with moecomp.replay_routing(routes, model):
            got = _logits(model, ids, mask)
        rows.append((f"{tag} replay recorded", rank, rel_err(got, want), MODEL_TOL))
        with moecomp.replay_routing(other, model):
            got = _logits(model, ids, mask)
        rows.append((f"{tag} replay other", rank, rel_err(got, want_other), MODEL_TOL))
        gen = _generate_routes(model, ids, mask)
        in_engine = model.generate.last.get("routes") == "recorded in the engine's steps"
        rows += [(f"{tag} generate routes", rank, _mismatch(gen.routed_experts, gen_want.routed_experts), 0.5),
                 (f"{tag} generate tokens", rank, _mismatch(gen.sequences, gen_want.sequences), 0.5),
                 (f"{tag} generate in engine", rank, 0.0 if in_engine else 1.0, 0.5)]
    return rows


def _generate_routes(model, ids, mask):
    """generate(return_routed_experts=True) on the engine's path: the global ids every block's op recorded."""
    return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                          return_routed_experts=True)
