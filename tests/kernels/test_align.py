"""Alignment invariants, for the single-program (small) and atomic (large) paths: every pair lands exactly once,
in a block of its own expert; padding rows hold the sentinel; experts without tokens get no block; sizes static."""

import pytest
import torch
import triton

from moecomp.ops import triton_moe


@pytest.mark.parametrize("T,k,E,bm", [(1, 2, 8, 16), (7, 3, 5, 16), (50, 4, 60, 16), (300, 2, 8, 32),
                                      (200, 8, 128, 64), (0, 2, 4, 16)])
def test_align_invariants(poison, T, k, E, bm):
    g = torch.Generator().manual_seed(T + E)
    # skewed routing: a few experts get most pairs, some get none
    probs = torch.rand(E, generator=g) ** 4
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(T)]) if T else torch.empty(0, k)
    ids = ids.to(torch.int32)
    P = T * k
    sorted_ids, block_expert, num_padded, max_blocks = triton_moe.align(ids, E, bm)
    assert max_blocks == triton.cdiv(P, bm) + min(E, P)
    assert sorted_ids.numel() == max_blocks * bm and block_expert.numel() == max_blocks
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    padded = (counts + bm - 1) // bm * bm
    n = int(num_padded.item())
    assert n == int(padded.sum())
    used = sorted_ids[:n]
    real = used[used < P].long()
    assert torch.equal(real.sort().values, torch.arange(P)), "each pair exactly once"
    assert int((used == P).sum()) == n - P, "padding rows hold the sentinel"
    flat = ids.reshape(-1).long()
    for b in range(n // bm):
        e = int(block_expert[b])
        rows = sorted_ids[b * bm:(b + 1) * bm].long()
        rows = rows[rows < P]
        assert rows.numel() > 0 and (flat[rows] == e).all()
    touched = set(block_expert[: n // bm].tolist())
    assert touched == {e for e in range(E) if counts[e] > 0}


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("T,k,E,Z,bm", [(1, 3, 4, 4, 16), (9, 3, 5, 3, 16), (150, 4, 8, 8, 32)])
def test_align_skips_zero_experts(poison, monkeypatch, small, T, k, E, Z, bm):
    """Ids in [E, E + Z) (``MoESpec.zero_experts``) are in no block: every pair of a real expert lands exactly once in
    a block of its expert, no other pair appears, the blocks are sized as if the zero experts' pairs did not exist,
    and nothing is written past the static buffers (which keep their worst-case size)."""
    monkeypatch.setenv("MOECOMP_ALIGN_SMALL_P", "256" if small else "0")
    g = torch.Generator().manual_seed(T + Z)
    ids = torch.stack([torch.randperm(E + Z, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[0] = torch.arange(E, E + k) % (E + Z)  # token 0: zero experts where k allows
    P = T * k
    sorted_ids, block_expert, num_padded, max_blocks = triton_moe.align(ids, E, bm)
    assert max_blocks == triton.cdiv(P, bm) + min(E, P) and sorted_ids.numel() == max_blocks * bm
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat[flat < E], minlength=E)
    n = int(num_padded.item())
    assert n == int(((counts + bm - 1) // bm * bm).sum())
    used = sorted_ids[:n]
    real = used[used < P].long()
    assert torch.equal(real.sort().values, torch.nonzero(flat < E).squeeze(1)), "each real pair once, no other"
    assert int((used == P).sum()) == n - real.numel(), "padding rows hold the sentinel"
    for b in range(n // bm):
        rows = sorted_ids[b * bm:(b + 1) * bm].long()
        rows = rows[rows < P]
        assert rows.numel() > 0 and (flat[rows] == int(block_expert[b])).all()
