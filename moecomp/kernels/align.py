"""Token-to-expert alignment on the GPU, with static worst-case sizes (no host sync; CUDA-graph capturable).

    topk_ids [P = T*k] --count--> counts [E] --pad to BLOCK_M, cumsum--> starts / ends [E]
                                                             |--> block_expert [MAX_BLOCKS] (E = unused block)
                                                             |--> num_padded [1]
    pair p (expert e) --atomic cursor[e]++--> sorted_ids[slot] = p ; padding slots = P (a sentinel)

Sizes: MAX_BLOCKS = cdiv(P, BLOCK_M) + min(E, P) bounds the number of non-empty BLOCK_M blocks (each expert with
tokens adds at most one partial block), so experts with no tokens get no block and cost nothing.

Pairs whose id is outside [0, E) are left out (in no block, counted nowhere, never written): the zero experts'
pairs (``MoESpec.zero_experts``: ids E .. E + Z - 1, whose output the combine adds itself), so no GEMM reads an
expert past the weights. Every id in range aligns as before.

Two ways, chosen by the launcher:
- ``align_small_kernel``: one program does everything (P <= SMALL_P): counts by one-hot sums, rank of each pair
  inside its expert by a [P, P] comparison; no atomics, deterministic, one launch (the decode path).
- ``count_kernel`` (many programs, atomics into zeroed counts) -> ``offsets_kernel`` (one program) ->
  ``scatter_kernel`` (many programs, atomic cursors): the prefill path.
"""

import triton
import triton.language as tl

from . import pdl


@triton.jit
def _offsets_and_blocks(
    counts,  # [E_PAD] int32 tensor
    offs_e,
    E,
    P,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    MAX_BLOCKS,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Shared tail: padded offsets, per-block expert ids, sentinel padding slots. Returns starts [E_PAD]."""
    e_ok = offs_e < E
    padded = tl.where(e_ok, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    if cursor_ptr is not None:
        tl.store(cursor_ptr + offs_e, starts, mask=e_ok)
    # block b belongs to the expert whose [start, end) holds b * BLOCK_M; unused blocks get E
    for b0 in range(0, MAX_BLOCKS, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        row = offs_b * BLOCK_M
        n_before = tl.sum(((ends[None, :] <= row[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_b, n_before, mask=offs_b < MAX_BLOCKS)
    # padding slots [start + count, end) of every expert hold the sentinel P
    offs_j = tl.arange(0, BLOCK_M)
    pad_slot = (starts + counts)[:, None] + offs_j[None, :]  # [E_PAD, BLOCK_M]
    pad_ok = (offs_j[None, :] < (padded - counts)[:, None]) & e_ok[:, None]
    tl.store(sorted_ptr + pad_slot, tl.zeros([E_PAD, BLOCK_M], tl.int32) + P, mask=pad_ok)
    return starts


@triton.jit
def align_small_kernel(
    ids_ptr,  # [P] int32/int64 expert of each pair
    sorted_ptr,  # [MAX_BLOCKS * BLOCK_M] int32 out
    block_expert_ptr,  # [MAX_BLOCKS] int32 out
    num_padded_ptr,  # [1] int32 out
    P,
    E,
    MAX_BLOCKS,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    offs_p = tl.arange(0, P_PAD)
    p_ok = offs_p < P
    ids = tl.load(ids_ptr + offs_p, mask=p_ok, other=-1).to(tl.int32)  # [P_PAD]
    ids = tl.where((ids >= 0) & (ids < E), ids, -1)  # out of range (zero experts): in no expert
    p_ok = p_ok & (ids >= 0)
    offs_e = tl.arange(0, E_PAD)
    counts = tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)  # [E_PAD]
    starts = _offsets_and_blocks(
        counts, offs_e, E, P, sorted_ptr, block_expert_ptr, num_padded_ptr, None, MAX_BLOCKS,
        BLOCK_M, E_PAD, BLOCK_B,
    )
    # rank of pair i among earlier pairs of the same expert
    offs_q = tl.arange(0, P_PAD)
    same_before = (ids[:, None] == ids[None, :]) & (offs_q[None, :] < offs_p[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)  # [P_PAD]
    start_of = tl.sum(tl.where(ids[:, None] == offs_e[None, :], starts[None, :], 0), axis=1)
    tl.store(sorted_ptr + start_of + rank, offs_p, mask=p_ok)


@triton.jit
def count_kernel(ids_ptr, counts_ptr, P, E, E_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1).to(tl.int32)
    offs_e = tl.arange(0, E_PAD)
    local = tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + offs_e, local, mask=(local > 0) & (offs_e < E))  # counts: [E]


@triton.jit
def offsets_kernel(
    counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    P,
    E,
    MAX_BLOCKS,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    offs_e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    _offsets_and_blocks(
        counts, offs_e, E, P, sorted_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr, MAX_BLOCKS,
        BLOCK_M, E_PAD, BLOCK_B,
    )


@triton.jit
def scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, P, E, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = offs_p < P
    ids = tl.load(ids_ptr + offs_p, mask=ok, other=0).to(tl.int32)
    ok = ok & (ids >= 0) & (ids < E)  # out of range (zero experts): not placed
    slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
    tl.store(sorted_ptr + slot, offs_p, mask=ok)
