"""The number and cell formatting both benchmark tables share (``report.py``'s and ``report_fp8.py``'s): stdlib only,
below both, so neither imports the other for it."""

from __future__ import annotations

import math


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def best_ms(cell: dict, path: str):
    p = cell.get("paths", {}).get(path)
    if not p:
        return None
    v = p.get("best_ms")
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def fmt_rate(v) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def fmt_ms(v) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.1f}"
    if v >= 10:
        return f"{v:.2f}"
    return f"{v:.3f}"


def fmt_ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def time_cell(cell: dict, path: str) -> str:
    p = cell.get("paths", {}).get(path)
    if p is None:
        return "-"
    v = best_ms(cell, path)
    if v is None:
        if p.get("skipped"):
            return "n/a: " + short(p["skipped"], 40)
        err = p.get("error") or "no time"
        return "err: " + short(err, 40)
    s = fmt_ms(v)
    if p.get("best_mode") == "graph":
        s += " g"
    if path in ("moecomp", "moecomp_opt", "vllm") and p.get("check_ok") is False:
        s += " **WRONG**"
    return s


def short(s: str, n: int) -> str:
    s = " ".join(str(s).split()).replace("|", "/")
    return s if len(s) <= n else s[: n - 3] + "..."


def check_cell(cell: dict, key: str = "check") -> str:
    chk = cell.get(key) or {}
    if not chk:
        return "-"
    rel = chk.get("rel_err")
    if rel is None:
        return "**FAIL** (" + short(chk.get("error", "no output"), 30) + ")"
    s = f"{rel:.1e}" if math.isfinite(rel) else "nan"
    n_amb, u = chk.get("ambiguous_tokens") or 0, chk.get("rel_err_unambiguous")
    if n_amb and u is not None and (rel > chk.get("tolerance", 0) or not chk.get("ok")):
        s += f" ({u:.1e} w/o {n_amb} tied-routing tok)"
    return s if chk.get("ok") else f"**FAIL {s}**"


def routing_line(result: dict) -> str | None:
    r = result.get("routing") or {}
    mode = r.get("mode", "real")
    if mode == "real":
        return None
    extra = f", exponent {r['zipf_exponent']:g}" if mode == "zipf" else ""
    return (f"Routing: **{mode}**{extra} (synthetic: expert ids drawn per token and planted through the router, "
            "so every path routes to the same ids; the floor counts the experts actually touched). "
            "PEERS.md figures (random routing) are not shown.")
