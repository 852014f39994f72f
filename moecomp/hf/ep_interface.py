"""``DistributedConfig(ep_implementation="moecomp")``: transformers' expert-parallel dispatch run by moecomp.

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(
        tp_size=2, ep_size=2, ep_implementation="moecomp"))     # under torchrun, after ``import moecomp``

transformers (5.2x, ``transformers.distributed.expert_parallel``) shards each experts module of its EP plan by
experts and calls an ``EPImplementation`` with the block's routing: ``(hidden_states [T, H], top_k_index [T, k]
global ids, top_k_weights [T, k])`` -> the weighted experts' sum of this rank's tokens, its parameters the local
shards while it runs. ``"moecomp"`` is registered in its ``EPImplementationInterface`` (only that name; the others
are left alone) as ``MoecompEP``, which runs ``moecomp.parallel.experts`` on those shards:

    spec       the experts module's own (``hf/experts_interface.experts_spec``: layout, activation, biases, FP8
               scales), checked once per top-k on the local experts against the module's eager forward, then
               widened to the E = E_local * W global experts with ParallelSpec("ep", W, rank, E, group = the EP
               mesh's group); dispatch "all_reduce" where the EP group shares one batch (transformers'
               ``shares_batch``), else "all_to_all" (each rank its own tokens)
    call       parallel.experts(x, ids, weights, local shards, spec): this rank's pairs on moecomp's grouped GEMMs,
               one all-reduce (or the exchange), the same sum on every rank
    fallback   transformers' own "auto" implementation, with one warning, where the op cannot serve: gradients
               needed (it has no backward), an experts module the spec cannot describe

Registered when ``transformers.distributed.expert_parallel`` is imported (``import moecomp`` arms an import hook and
imports nothing of transformers; registered at once if it is already loaded). transformers without that module
(5.17): nothing is registered, ``available()`` says why. ``moecomp.optimize`` on such a model replaces the whole
block anyway (``hf_distributed.py``): routing and dispatch both moecomp's.
"""

from __future__ import annotations

import sys
import warnings

import torch

from .import_hooks import RegisterOnImport, uninstall

NAME = "moecomp"
TARGET = "transformers.distributed.expert_parallel"
REGISTERED = False
_warned: set = set()


def available() -> str:
    """"" when transformers has the EP implementation registry moecomp registers in, else why not."""
    try:
        import importlib

        mod = importlib.import_module(TARGET)
    except Exception as e:  # noqa: BLE001  (transformers missing, or one without transformers.distributed)
        return (f"transformers has no {TARGET} ({type(e).__name__}: {e}): its distributed loading with EP plans "
                f"needs a newer transformers (5.24 has it)")
    if not callable(getattr(getattr(mod, "EPImplementationInterface", None), "register", None)) or not hasattr(
            mod, "EPImplementation"):
        return f"{TARGET} has no EPImplementationInterface.register / EPImplementation to register moecomp with"
    return ""


def _warn(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"moecomp EP implementation: transformers' own dispatch runs ({why})", stacklevel=4)


def _make_class(mod):
    """``MoecompEP``, a subclass of transformers' ``EPImplementation`` (module docstring)."""
    from . import experts_interface as ei
    from ..parallel.comm import group_name
    from ..parallel.op import experts as parallel_experts
    from ..core.spec_parallel import ParallelSpec

    class MoecompEP(mod.EPImplementation):
        """This experts module's EP dispatch on moecomp's parallel experts path (``moecomp.hf.ep_interface``)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts
            self.world_size, self.rank = ep_mesh.size(), ep_mesh.get_local_rank()
            self.group = group_name(ep_mesh.get_group())
            self.dispatch = "all_reduce" if self.shares_batch else "all_to_all"
            # the fallback, built now: transformers replaces experts.forward after this, and its implementations
            # call the forward they see when built (the experts' own)
            self.auto = mod.AutoEP(experts, ep_mesh, tp_mesh)

        def spec(self, k: int):
            """The whole block's experts spec with this rank's ParallelSpec (``Unsupported`` when the module has
            none)."""
            local = ei._spec_cached(self.experts, k)  # (on the local experts: the parameters are the shards now)
            E = local.num_experts * self.world_size
            p = ParallelSpec("ep", self.world_size, self.rank, E, dispatch=self.dispatch, group=self.group)
            return local.replace(num_experts=E, top_k=k, parallel=p)

        def transformers_path(self, hidden_states, top_k_index, top_k_weights, why: str):
            _warn(why)
            return self.auto(hidden_states, top_k_index, top_k_weights)

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            m = self.experts
            if torch.is_grad_enabled() and ei.experts_grad_needed(m, hidden_states, top_k_weights):
                return self.transformers_path(hidden_states, top_k_index, top_k_weights, "gradients needed: the "
                                              "op has no backward; use torch.no_grad() for inference")
            try:
                spec = self.spec(int(top_k_index.shape[-1]))
            except ei.Unsupported as e:
                return self.transformers_path(hidden_states, top_k_index, top_k_weights, str(e))
            w13, b13, w2, b2 = ei._weights(m)
            args = {"w13": w13, "b13": b13, "w2": w2, "b2": b2, **(ei.scales(m) if spec.quant is not None else {})}
            return parallel_experts(hidden_states, top_k_index, top_k_weights, args, spec)

    MoecompEP.__qualname__ = MoecompEP.__name__
    return MoecompEP


def register() -> bool:
    """Register ``"moecomp"`` in transformers' ``EPImplementationInterface`` (False where it has none)."""
    global REGISTERED
    mod = sys.modules.get(TARGET)
    iface = getattr(mod, "EPImplementationInterface", None)
    if iface is None or not callable(getattr(iface, "register", None)) or not hasattr(mod, "EPImplementation"):
        return False
    try:  # (runs inside transformers' import: never make it fail)
        iface.register(NAME, _make_class(mod))
    except Exception:  # noqa: BLE001
        return False
    REGISTERED = True
    return True


_finder = RegisterOnImport(TARGET, register)


def install() -> bool:
    """Register now if ``transformers.distributed.expert_parallel`` is loaded (True when registered), else arm the
    import hook that registers right after it is imported."""
    if TARGET in sys.modules:
        uninstall(_finder)
        return REGISTERED or register()
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return False


install()
