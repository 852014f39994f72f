"""ParallelSpec: which shard of a MoE block's routed experts this rank holds, and how the ranks exchange work.

A ``MoESpec`` describes the whole block (``num_experts`` = E and ``intermediate_size`` = I are the global sizes);
``MoESpec.parallel`` says which part of the routed experts this rank holds and computes. The router, the shared
experts, the latent projections and the rest of the model stay whole on every rank.

    mode "ep" (expert parallel), W ranks, rank r:   experts [r * E / W, (r + 1) * E / W)  (E % W == 0)
        w13 [E / W, 2I, H], w2 [E / W, H, I], b13 / b2 / scales: the same rows of E
        dispatch "all_reduce"  the group shares one batch: every rank routes every token over the E experts, runs
                               the pairs its experts own (the others skipped), and the partial sums are all-reduced
        dispatch "all_to_all"  each rank its own tokens: pairs go to the rank owning their expert (all_to_all_single:
                               counts first, then the rows with uneven splits; ``capacity``: fixed buffers instead)
    mode "tp" (tensor parallel), W ranks, rank r:  every expert, intermediate columns [r * I / W, (r + 1) * I / W)
        w13 column-parallel (gate and up rows sliced alike), w2 row-parallel (the same I columns); b13 sliced like
        w13; b2 whole (added by rank 0 only); the partial outputs are all-reduced (dispatch "all_reduce" only)
    mode "replicated", W ranks sharing one batch: every rank holds every routed expert whole and computes all of its
        pairs (the routed part is complete on every rank, nothing of it is reduced); only shared experts given as
        this rank's slice of their I (a loader's tensor-parallel plan that splits the shared experts and leaves the
        routed ones whole: transformers 5.25's default TP plans) are summed over the group, their own all-reduce.
        Dispatch "all_reduce" only

    capacity (all_to_all only): None  uneven exchange, the counts read on the host (not capturable in a CUDA graph)
                                0     fixed buffers of T * k rows per destination: no pair is ever dropped, every rank
                                      must call with the same T (the decode steps of a shared batch); capturable
                                C > 0 fixed buffers of C rows per destination: pairs past C are dropped (they add
                                      nothing), ranked per destination slot-major (every token's first choice, in
                                      token order, before any second choice); capturable
    chunks (the uneven all_to_all only): N > 1 splits each rank's tokens into N chunks (sizes differing by at most
                                      one; some empty when T < N) pipelined so that chunk i's experts run while
                                      chunk i + 1's rows are in flight and chunk i - 1's outputs come back (async
                                      collectives; ``parallel/overlap.py``); the result equals the unchunked one.
                                      Every rank of the group must use the same N

The all-reduce points (one per call, mutually exclusive): after the routed part and the shared experts are summed
(the shared experts' partial: their I split like the routed experts' where it divides, else whole on rank 0); with
latent projections (``MoESpec.latent_size``), on the routed part before ``latent_out`` (then the projection and the
shared experts run whole on every rank); "replicated": on the shared experts' slice alone (none where they are
whole). ``group``: the process group's name ("" = the default group);
``moecomp.parallel.group_name`` gives it for a group object.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from .spec_checks import SpecError

PARALLEL_MODES = ("ep", "tp", "replicated")
DISPATCHES = ("all_reduce", "all_to_all")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ParallelSpec:
    """This rank's shard of the routed experts (the module docstring). Invalid values: SpecError (a ValueError)
    naming the field."""

    mode: str  # "ep" | "tp" | "replicated"
    world_size: int  # W: ranks in the group
    rank: int  # this rank, in [0, W)
    num_global_experts: int  # E, the block's experts (MoESpec.num_experts)
    intermediate_size: int = 0  # I, the block's (MoESpec.intermediate_size); required for "tp", 0 or I for "ep"
    dispatch: str = "all_reduce"  # "all_reduce" (the group shares one batch) | "all_to_all" (EP: own tokens)
    capacity: int | None = None  # all_to_all: None uneven exchange | 0 fixed no-drop T*k rows | C fixed, drop past C
    group: str = ""  # the process group's name ("" = default group)
    chunks: int = 1  # uneven all_to_all: token chunks pipelined (communication overlapping the experts); 1 = none

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.mode not in PARALLEL_MODES:
            raise SpecError(f"parallel.mode={self.mode!r} is not one of {PARALLEL_MODES}")
        W, r, E, I = self.world_size, self.rank, self.num_global_experts, self.intermediate_size
        if not _is_int(W) or W < 1:
            raise SpecError(f"parallel.world_size must be an int >= 1, got {W!r}")
        if not _is_int(r) or not 0 <= r < W:
            raise SpecError(f"parallel.rank must be an int in [0, world_size={W}), got {r!r}")
        if not _is_int(E) or E < 1:
            raise SpecError(f"parallel.num_global_experts must be an int >= 1, got {E!r}")
        if not _is_int(I) or I < 0:
            raise SpecError(f"parallel.intermediate_size must be an int >= 0 (the global I; 0: not given), got {I!r}")
        if self.dispatch not in DISPATCHES:
            raise SpecError(f"parallel.dispatch={self.dispatch!r} is not one of {DISPATCHES}")
        if not isinstance(self.group, str):
            raise SpecError(f"parallel.group must be a process group's name (str; '' = the default group), got "
                            f"{type(self.group).__name__}")
        if self.mode == "ep" and E % W:
            raise SpecError(f"parallel.num_global_experts={E} is not divisible by world_size={W}: expert parallelism "
                            f"gives every rank E / W experts (pad the experts or pick a world size dividing {E})")
        if self.mode == "tp":
            if not I:
                raise SpecError("parallel.intermediate_size is required with mode 'tp' (the global I it slices)")
            if I % W:
                raise SpecError(f"parallel.intermediate_size={I} is not divisible by world_size={W}: tensor "
                                f"parallelism gives every rank I / W intermediate columns of every expert")
            if self.dispatch != "all_reduce":
                raise SpecError(f"parallel.dispatch={self.dispatch!r} with mode 'tp': tensor parallelism shares one "
                                f"batch and all-reduces (dispatch 'all_reduce')")
        if self.mode == "replicated" and self.dispatch != "all_reduce":
            raise SpecError(f"parallel.dispatch={self.dispatch!r} with mode 'replicated': every rank runs every routed "
                            f"expert on the batch the group shares (dispatch 'all_reduce')")
        c = self.capacity
        if c is not None:
            if not _is_int(c) or c < 0:
                raise SpecError(f"parallel.capacity must be None or an int >= 0, got {c!r}")
            if self.dispatch != "all_to_all":
                raise SpecError(f"parallel.capacity={c} is for dispatch 'all_to_all' (rows per destination rank), "
                                f"got dispatch {self.dispatch!r}")
        n = self.chunks
        if not _is_int(n) or n < 1:
            raise SpecError(f"parallel.chunks must be an int >= 1 (1: no chunked overlap), got {n!r}")
        if n > 1 and (self.dispatch != "all_to_all" or c is not None):
            raise SpecError(f"parallel.chunks={n} is for dispatch 'all_to_all' without a capacity (the uneven "
                            f"exchange), got dispatch {self.dispatch!r}" + (f" with capacity={c} (fixed buffers are "
                            f"not chunked: each chunk would need the whole capacity)" if c is not None else ""))

    # --------------------------------------------------------------------------------------------- the shard
    @property
    def experts_per_rank(self) -> int:
        """Experts this rank holds: E / W (EP), E (TP, replicated)."""
        return self.num_global_experts // self.world_size if self.mode == "ep" else self.num_global_experts

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds (EP: E / W of them; TP, replicated: all)."""
        n = self.experts_per_rank
        start = self.rank * n if self.mode == "ep" else 0
        return range(start, start + n)

    def owner(self, expert: int) -> int:
        """The rank holding ``expert`` (EP); TP, replicated: every rank holds every expert (-1)."""
        return expert // self.experts_per_rank if self.mode == "ep" else -1

    @property
    def intermediate_per_rank(self) -> int:
        """Intermediate columns of each expert this rank holds: I / W (TP), I (EP, replicated; 0 when I was not
        given)."""
        return self.intermediate_size // self.world_size if self.mode == "tp" else self.intermediate_size

    @property
    def local_intermediate(self) -> slice:
        """The intermediate columns (of gate, of up, of w2's input) this rank holds: I / W of them (TP), all (EP,
        replicated)."""
        n = self.intermediate_per_rank
        start = self.rank * n if self.mode == "tp" else 0
        return slice(start, start + n)

    @property
    def capturable(self) -> bool:
        """No host sync on the path (a CUDA graph can capture it): all_reduce, or all_to_all with fixed buffers."""
        return self.dispatch == "all_reduce" or self.capacity is not None

    def describe(self) -> str:
        s = f"{self.mode} {self.rank}/{self.world_size}"
        if self.mode == "ep":
            r = self.local_experts
            s += f" experts [{r.start}, {r.stop})"
        elif self.mode == "replicated":
            s += " every expert whole"
        else:
            sl = self.local_intermediate
            s += f" I [{sl.start}, {sl.stop})"
        if self.dispatch == "all_to_all":
            s += " a2a" + ("" if self.capacity is None else f" cap {self.capacity or 'T*k'}")
            s += f" chunks {self.chunks}" if self.chunks > 1 else ""
        return s + (f" group {self.group!r}" if self.group else "")

    @functools.cached_property
    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


def check_parallel(spec) -> None:
    """The rules a MoESpec with a ``parallel`` part follows (``MoESpec.validate``): SpecError naming the field."""
    p = spec.parallel
    if not isinstance(p, ParallelSpec):
        raise SpecError(f"parallel must be a ParallelSpec or None, got {type(p).__name__}")
    if p.num_global_experts != spec.num_experts:
        raise SpecError(f"parallel.num_global_experts={p.num_global_experts} differs from num_experts="
                        f"{spec.num_experts}: the spec describes the whole block, its parallel part this rank's shard")
    if p.intermediate_size and p.intermediate_size != spec.intermediate_size:
        raise SpecError(f"parallel.intermediate_size={p.intermediate_size} differs from intermediate_size="
                        f"{spec.intermediate_size} (both are the global I)")
    if spec.expert_norm != "none":
        raise SpecError(f"parallel experts with expert_norm={spec.expert_norm!r} are not supported (each pair's "
                        f"output is normalised whole; no sharded block is known to have it)")
    if p.mode == "tp" and spec.quant is not None:
        _check_tp_quant(spec, p)


def _check_tp_quant(spec, p: ParallelSpec) -> None:
    """An I slice of quantized experts must cut whole scale blocks: w13's rows (block_n) and w2's columns (block_k,
    and whole bytes of two 4-bit codes)."""
    q, n = spec.quant, p.intermediate_per_rank
    need = []
    if q.scale == "block":
        need += [("w13 rows: quant.block_n", q.block_n), ("w2 columns: quant.block_k", q.block_k)]
    elif q.scale == "group":
        need += [("w2 columns: quant.block_k (the group)", q.block_k)]
    if q.packed:
        need += [("w2 columns: two 4-bit codes a byte", 2)]
    for what, m in need:
        if n % m:
            raise SpecError(f"parallel tp: each rank's intermediate slice ({n} = {spec.intermediate_size} / "
                            f"{p.world_size}) must be a multiple of {m} ({what}) so that its scales are whole blocks")


def parallel_from_dict(d: dict, key: str, fields_from_key) -> ParallelSpec:
    """The ``parallel`` object of a spec key (``MoESpec.from_key``), its fields checked by ``fields_from_key``."""
    return ParallelSpec(**fields_from_key(d, ParallelSpec, key, "'parallel'"))
