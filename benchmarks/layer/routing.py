"""Synthetic routing (``--routing uniform|zipf|one-hot``): expert ids drawn per token and planted through the
router, so every path runs the whole block and routes to the same ids; and the routing statistics of a cell."""

from __future__ import annotations

import math

import torch

ROUTING_MODES = ("real", "uniform", "zipf", "one-hot")
ZIPF_EXPONENT = 1.2  # zipf: expert of popularity rank r (1 = most popular) is drawn with probability ~ r^-1.2
PLANT_CHOSEN = (4.0, 6.0)  # synthetic routing: planted router logits of the drawn experts, uniform in this range,
PLANT_OTHER_STD = 0.3  # ... and of the others N(0, 0.3): the k-th and (k+1)-th logits are >= ~2 apart

ROUTING_METHOD = (
    "real: the router's random weights route (N(0, 0.02) rows; inputs randn). uniform / zipf / one-hot: expert ids "
    "are drawn per token (k distinct experts, weighted sampling without replacement; grouped routers: at most "
    "topk_group groups per token), then planted: the router rows are set to orthonormal vectors and each token's input "
    f"x = (randn projected off the router rows) + the part that makes its router logits U{PLANT_CHOSEN} for the drawn "
    f"experts and N(0, {PLANT_OTHER_STD}) for the others. Every path runs the whole block and routes through the same "
    "router, so all see the same ids; the ids the router actually picks are checked against the drawn ones per cell "
    "(routing.planned_match) and the floor counts those.")


class RoutingPlan:
    """Synthetic expert ids for one family: ``ids(T)`` -> [T, k] int64 on the CPU.

    uniform: every expert equally likely; zipf: the expert of popularity rank r drawn with probability ~ r^-s
    (``ZIPF_EXPONENT``; which expert has which rank is a random permutation, fixed per family); one-hot: the same k
    experts (drawn once per family, uniformly) for every token. Each token gets k distinct experts (Gumbel-top-k:
    sequential sampling without replacement in proportion to the probabilities); for grouped routers
    (``n_group > 1``) the draw keeps to at most ``topk_group`` groups per token, as the router itself would."""

    def __init__(self, mode: str, spec, seed: int):
        if mode not in ROUTING_MODES or mode == "real":
            raise ValueError(f"no synthetic routing for {mode!r}")
        self.mode, self.spec = mode, spec
        E, k = spec.num_experts, spec.top_k
        self.gen = torch.Generator().manual_seed(seed)
        if mode == "zipf":
            rank = torch.randperm(E, generator=self.gen)  # rank[e] = popularity rank of expert e (0 = most popular)
            logp = -ZIPF_EXPONENT * torch.log((rank + 1).double())
        else:
            logp = torch.zeros(E, dtype=torch.float64)
        self.probs = torch.softmax(logp, -1)  # per-draw probabilities (before "without replacement")
        self.grouped = spec.n_group > 1 and spec.score_order != "topk_then_score"
        if self.grouped and spec.topk_group * (E // spec.n_group) < k:
            raise ValueError(f"topk_group {spec.topk_group} x {E // spec.n_group} experts per group < top-k {k}")
        self.fixed = self._draw(1) if mode == "one-hot" else None

    def _draw(self, n: int) -> torch.Tensor:
        spec = self.spec
        E, k = spec.num_experts, spec.top_k
        u = torch.rand(n, E, generator=self.gen, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        keys = torch.log(self.probs)[None, :] - torch.log(-torch.log(u))  # + Gumbel noise
        ids = torch.empty(n, k, dtype=torch.long)
        taken = torch.zeros(n, E, dtype=torch.bool)
        rows = torch.arange(n)
        if self.grouped:
            G, per = spec.n_group, E // spec.n_group
            used = torch.zeros(n, G, dtype=torch.bool)
        for j in range(k):
            allowed = ~taken
            if self.grouped:
                full = used.sum(-1, keepdim=True) >= spec.topk_group
                allowed &= ~full | used.repeat_interleave(per, dim=1)
            e = keys.masked_fill(~allowed, -math.inf).argmax(-1)
            ids[:, j] = e
            taken[rows, e] = True
            if self.grouped:
                used[rows, e // per] = True
        return ids

    def ids(self, T: int) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed.expand(T, -1).clone()
        return self._draw(T)

    def describe(self) -> dict:
        d = dict(mode=self.mode, group_limit=self.grouped)
        if self.fixed is not None:
            d["one_hot_experts"] = [int(i) for i in self.fixed[0]]
        if self.mode == "zipf":
            top = torch.topk(self.probs, min(4, self.probs.numel()))
            d.update(zipf_exponent=ZIPF_EXPONENT, most_popular_experts=[int(i) for i in top.indices],
                     their_draw_probs=[round(float(v), 4) for v in top.values])
        return d


def router_rows(tensors: dict, spec) -> torch.Tensor:
    """The router weight rows [E, H] (a view of the block's own parameter)."""
    rw = tensors["router_w"]
    return rw[: spec.num_experts] if spec.fused_shared_gate else rw


def plant_router(tensors: dict, spec, seed: int) -> None:
    """Set the router rows (in place, the block's own parameter) to orthonormal vectors, so that any wanted logits
    can be planted through the input. Needs E <= H (true of every family here)."""
    w = router_rows(tensors, spec)
    E, H = w.shape
    if E > H:
        raise ValueError(f"cannot plant routing: {E} experts > hidden size {H}")
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(H, E, generator=g, dtype=torch.float64))
    with torch.no_grad():
        w.copy_(q.T.to(device=w.device, dtype=w.dtype))


def planted_input(ids: torch.Tensor, tensors: dict, spec, gen: torch.Generator, device, dtype) -> torch.Tensor:
    """x [1, T, H] whose router logits are U(PLANT_CHOSEN) on ``ids`` [T, k] and N(0, PLANT_OTHER_STD) elsewhere
    (exactly, before x is rounded to ``dtype``); the rest of x is randn projected off the router rows."""
    T, k = ids.shape
    A = router_rows(tensors, spec).float()  # [E, H], as stored (after rounding)
    E, H = A.shape
    logits = torch.randn(T, E, device=device, generator=gen) * PLANT_OTHER_STD
    lo, hi = PLANT_CHOSEN
    logits.scatter_(1, ids.to(device), lo + (hi - lo) * torch.rand(T, k, device=device, generator=gen))
    if tensors.get("router_b") is not None:
        logits -= tensors["router_b"].float()[: E]
    base = torch.randn(T, H, device=device, generator=gen)
    corr = torch.linalg.solve(A @ A.T, (logits - base @ A.T).T).T  # [T, E]: A (base + corr A)^T = logits
    return (base + corr @ A).to(dtype).view(1, T, H)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] bool: row t of ``a`` and ``b`` ([T, k] ids) name the same experts."""
    return (a.long().sort(-1).values == b.long().sort(-1).values.to(a.device)).all(-1)


def routing_stats(ids: torch.Tensor, E: int) -> dict:
    """Distinct experts touched, the share of tokens the busiest expert serves, and its load over the mean load."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    T, k = ids.shape
    return dict(distinct_experts=int((counts > 0).sum()), busiest_expert_token_frac=round(float(counts.max()) / T, 4),
                busiest_over_mean_load=round(float(counts.max()) * E / (T * k), 3))
