"""moecomp: fast Mixture-of-Experts layers for any HuggingFace / PyTorch model, in one line.

    import moecomp
    model = moecomp.optimize(model)   # every MoE block -> one torch.ops.moecomp.moe_forward call
    print(moecomp.scan(model))        # what was found, with which spec, and why anything was skipped
    moecomp.shard_experts(model, group, mode="ep")   # under torchrun: this rank keeps its experts only

``import moecomp`` is cheap and leaves other libraries alone: it registers the custom ops ``torch.ops.moecomp.*``
(torch only: Triton and the kernels are imported by the first call that runs them) and imports neither
transformers nor ``torch._dynamo`` nor Triton.

* transformers' experts interface gets ``"moecomp"`` (``experts_implementation="moecomp"``) when
  ``transformers.integrations.moe`` is imported (at once if it already is; ``hf/experts_interface.py``). Only that
  name is registered; transformers' own entries (``"eager"``, ...) are left as they are.
* transformers' EP implementations get ``"moecomp"`` (``DistributedConfig(ep_implementation="moecomp")``) when
  ``transformers.distributed.expert_parallel`` is imported (``hf/ep_interface.py``; transformers versions without it:
  nothing registered).
* The ``"moecomp"`` torch.compile backend is found by torch through the ``torch_dynamo_backends`` entry point
  (``pyproject.toml``), which loads ``moecomp.api.backend`` on the first ``torch.compile(..., backend="moecomp")``;
  from a source tree without that entry point, ``import moecomp`` adds the same entry to torch's table when Dynamo
  loads (``api/dynamo_name.py``); importing ``moecomp.api.backend`` (or reading ``moecomp.backend``) registers it as
  well.
* Heavy submodules (``backend``, ``capture``, ``passes``, ``kernels``, ``generate``, ``testing``, ``demo``, ...) are
  imported on first attribute access (``moecomp.backend``) or by an explicit import.
"""

from __future__ import annotations

import importlib

from .core import counters  # noqa: F401  (moecomp.counters: a module that indexes like a dict; torch only)
from . import ops  # noqa: F401  (registers torch.ops.moecomp.*; torch only)
from .core.spec import MoESpec, SharedExpertSpec, SpecError
from .api.optimize import OptimizeError, Report, optimize, scan, unoptimize
from .api.routing import record_routing, replay_routing  # routing replay on transformers' path (RL)
from .api.load import load  # (torch only: the loaders import transformers / safetensors when called)
from .api.shard import shard_experts  # expert / tensor parallelism (moecomp.parallel; torch only)
from .hf import ep_interface as _hf_ep  # noqa: F401  (ep_implementation="moecomp", once transformers' EP loads)
from .hf import experts_interface as _experts_interface  # noqa: F401  ("moecomp" experts, once transformers loads)
from .api import dynamo_name as _dynamo_name

_dynamo_name.install()  # backend="moecomp" for torch.compile, also from a source tree (no entry point installed)

__version__ = "0.1.0"

# submodules imported on first attribute access (PEP 562): they import torch._dynamo, Triton or transformers.
# moecomp.<name> -> the module it names (short names kept from before the layers became packages)
_LAZY_SUBMODULES = {
    "backend": "api.backend", "capture": "recognise.capture", "cli": "cli", "demo": "cli.demo", "generate": "generate",
    "hf": "hf", "kernels": "kernels", "passes": "recognise.fx", "reference": "oracle.reference", "testing": "testing",
}


def warmup(model, batch_sizes=(1,), max_length: int = 1024, prompt_length: int = 8, prompt_lengths=None,
           cache_dir=None) -> dict:
    """Compile and capture ``model.generate`` ahead of time for these batch sizes and cache length (after
    ``optimize``), on CUDA the prefill of each prompt-length bucket of ``prompt_lengths`` (None: every bucket up to
    ``max_length``), loading / saving the compile artifacts under ``cache_dir`` (warm starts):
    ``moecomp.generate.warmup``'s docstring."""
    from .generate.warmup import warmup as _warmup

    return _warmup(model, batch_sizes=batch_sizes, max_length=max_length, prompt_length=prompt_length,
                   prompt_lengths=prompt_lengths, cache_dir=cache_dir)


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"{__name__}.{_LAZY_SUBMODULES[name]}")
        globals()[name] = module  # later reads skip __getattr__
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = ["MoESpec", "SharedExpertSpec", "SpecError", "ops", "optimize", "scan", "unoptimize", "Report",
           "OptimizeError", "counters", "warmup", "load", "shard_experts", "replay_routing", "record_routing",
           "__version__"]
