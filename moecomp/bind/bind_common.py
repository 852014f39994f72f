"""What the binder of whole blocks (``bind.py``) and of experts modules (``bind_experts.py``) share: the bind error,
the once-per-process gradient warning, putting a forward back, and marking the experts' config "moecomp"
(``impl_switch``) in a binding's state."""

from __future__ import annotations

import warnings

from torch import nn

from ..core.reject import Refused, RejectCode
from .impl_switch import claim as _claim_config, experts_config


class BindError(Refused):
    """The block's forward cannot be bound (its outputs or arguments): code ``BIND_FAILED``."""

    default_code = RejectCode.BIND_FAILED


_grad_warned = False


def warn_grad(what: str) -> None:
    global _grad_warned
    if _grad_warned:
        return
    _grad_warned = True
    warnings.warn(
        f"moecomp: gradients are needed ({what} requires grad with grad mode on): MoE modules rewritten by "
        f"moecomp.optimize run their original forward, which gives exact gradients. Run inference under "
        f"torch.no_grad() or torch.inference_mode() to use moecomp's op. (Warned once per process.)",
        UserWarning, stacklevel=4)


def claim(st, modules) -> None:
    """Mark the experts' config "moecomp" (``impl_switch``), remembering the name it had; again on a re-optimize."""
    if st.impl_config is None:
        st.impl_config, fp8 = experts_config(modules)
    else:
        fp8 = experts_config(modules)[1]
    prev = _claim_config(st.impl_config, fp8)
    if prev is not None:
        st.impl_prev = prev


def restore_forward(module: nn.Module, original) -> None:
    """Undo our instance-level ``forward``: put back the instance forward we replaced, or fall back to the class's."""
    if original is not None:
        module.forward = original
    else:
        module.__dict__.pop("forward", None)
