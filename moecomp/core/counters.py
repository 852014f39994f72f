"""Counters of what the compile passes and optimize's strategies did: ``moecomp.counters["detect_moe"]["matched"]``.

``moecomp.counters`` is this module, and it is subscriptable like ``collections.defaultdict(Counter)``:

    import moecomp
    moecomp.counters.clear()
    torch.compile(model, backend="moecomp")(x)
    moecomp.counters["detect_moe"]["matched"]      # MoE blocks recognised
    moecomp.counters["detect_moe"]["rejected"]     # candidates left alone (reasons: moecomp.api.backend.last_results)
    moecomp.counters["rewrite_moe"]["replaced"]    # blocks replaced by torch.ops.moecomp.moe_forward
    moecomp.counters["fse"]["fused"]               # router + shared-gate GEMMs fused (see recognise/fx/fse.py)
    moecomp.counters["backend"]["graphs"]          # graphs the backend compiled

``optimize`` / ``scan`` count what their strategies did, one key per registered strategy (its ``name``):

    moecomp.counters["recognise"]["fx"]                # blocks the FX pass matched (recognise/recognise.RECOGNISERS)
    moecomp.counters["recognise"]["fx_real_values"]    # ... the FX pass matched tracing with real values
    moecomp.counters["recognise"]["dispatch_reader"]   # ... the dispatch reader matched (expert modules observed)
    moecomp.counters["recognise"]["attribute_reader"]  # ... the attribute reader matched (meta tensors included)
    moecomp.counters["rewrite"]["sharded"]             # blocks bound to the parallel op on transformers' shards
    moecomp.counters["rewrite"]["whole"]               # ... rewritten whole (api/rewrites.REWRITES)
    moecomp.counters["rewrite"]["pair"]                # ... as a router / experts pair inside their parent
    moecomp.counters["rewrite"]["experts_only"]        # ... experts only (routing left to the block)

A "recognise" key counts each Match the pipeline returned (one per block and per try: a block recognised again on
a smaller probe after running out of memory counts again); a "rewrite" key counts blocks a strategy rewrote
(status "rewritten" / "experts only"; ``scan`` rewrites nothing). A strategy registered by a user counts under its
own name.

Keys read before they were counted are 0. ``clear()`` resets everything; ``snapshot()`` is a plain-dict copy.
"""

from __future__ import annotations

import sys
import types
from collections import Counter, defaultdict

counters: defaultdict[str, Counter] = defaultdict(Counter)


def clear() -> None:
    counters.clear()


def snapshot() -> dict[str, dict[str, int]]:
    return {k: dict(v) for k, v in counters.items()}


class _CountersModule(types.ModuleType):
    """Lets ``moecomp.counters[...]`` index the counters while ``moecomp.counters`` stays the module."""

    def __getitem__(self, key: str) -> Counter:
        return counters[key]

    def __contains__(self, key: str) -> bool:
        return key in counters

    def __iter__(self):
        return iter(counters)

    def __len__(self) -> int:
        return len(counters)

    def items(self):
        return counters.items()

    def keys(self):
        return counters.keys()

    def values(self):
        return counters.values()

    def get(self, key, default=None):
        return counters.get(key, default)


sys.modules[__name__].__class__ = _CountersModule
