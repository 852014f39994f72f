"""The routing session active in this context (issue 43): how a bound block's forward (``bind/``) learns, without
importing ``api/``, that ``moecomp.replay_routing`` / ``moecomp.record_routing`` is active and what to do.

A session (set by ``api/routing.py`` for the duration of its ``with``) answers ``session.get(block)``: None where
the block is not part of it, else a per-block handle with

    ids(x)                        the replayed ids [T, k] (int64, on x's device) for this call, padding rows
                                  already filled with the block's own choice; None: this call records instead
    store(ids, x)                 the ids [T, k] the op used for the block's input x (recording; an int32 buffer
                                  the op wrote)
    fallback(x, rest, kwargs, call_original)
                                  the block's result where the op cannot run (autograd while training, hooks, ...):
                                  the replay's own differentiable forward with the ids, or call_original() with the
                                  ids recorded beside it

Read through :func:`session` only; a ContextVar so that threads and asyncio tasks each see their own.
"""

from __future__ import annotations

from contextvars import ContextVar

_ACTIVE: ContextVar = ContextVar("moecomp_routing_session", default=None)


def session():
    """The routing session active in this context, or None."""
    return _ACTIVE.get()


def activate(s):
    """Make ``s`` the active session; returns the token :func:`deactivate` takes."""
    return _ACTIVE.set(s)


def deactivate(token) -> None:
    """Restore the session that was active before the matching :func:`activate`."""
    _ACTIVE.reset(token)
