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
