"""moecomp: fast Mixture-of-Experts layers for any HuggingFace / PyTorch model, in one line.

    import moecomp
    model = moecomp.optimize(model)   # every MoE block -> one torch.ops.moecomp.moe_forward call
    print(moecomp.scan(model))        # what was found, with which spec, and why anything was skipped
"""

from . import ops  # noqa: F401  (registers torch.ops.moecomp.*)
from .spec import MoESpec, SharedExpertSpec, SpecError

__version__ = "0.1.0"

__all__ = ["MoESpec", "SharedExpertSpec", "SpecError", "ops", "__version__"]
