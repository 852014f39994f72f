"""moecomp: fast Mixture-of-Experts layers for any HuggingFace / PyTorch model, in one line.

    import moecomp
    model = moecomp.optimize(model)   # every MoE block -> one torch.ops.moecomp.moe_forward call
    print(moecomp.scan(model))        # what was found, with which spec, and why anything was skipped
"""

from . import ops  # noqa: F401  (registers torch.ops.moecomp.*)
from .spec import MoESpec, SharedExpertSpec, SpecError
from .optimize import Report, optimize, scan, unoptimize
from .hf import experts_interface as _experts_interface  # noqa: F401  (registers "moecomp" experts in transformers)
from . import backend  # noqa: F401  (registers the "moecomp" torch.compile backend)

__version__ = "0.1.0"

__all__ = ["MoESpec", "SharedExpertSpec", "SpecError", "ops", "optimize", "scan", "unoptimize", "Report",
           "__version__"]
