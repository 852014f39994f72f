"""The log: one line per cell as it is measured, and the notes printed before the table."""

from __future__ import annotations

import report  # benchmarks/report.py

from . import common


def cell_line(name: str, cell: dict) -> str:
    parts = [f"[{name} T={cell['T']}]", f"floor {report._fmt_ms(cell.get('floor_ms'))}"]
    for p, r in cell["paths"].items():
        v = r.get("best_ms")
        if v is None and r.get("skipped"):
            parts.append(f"{p} skipped")
        elif v is None:
            parts.append(f"{p} ERR({report._short(r.get('error', r.get('graph_note', '?')), 60)})")
        else:
            parts.append(f"{p} {report._fmt_ms(v)}{' g' if r.get('best_mode') == 'graph' else ''}")
    ach = (cell.get("achieved") or {}).get("moecomp")
    if ach:
        parts.append(f"moecomp {ach['tb_per_s']:.3g} TB/s {ach['tflop_per_s']:.3g} TFLOP/s")
    for key, who in (("check", "check"), ("check_vllm", "vllm check")):
        chk = cell.get(key)
        if chk:
            parts.append(f"{who} {chk.get('rel_err') if chk.get('rel_err') is None else format(chk['rel_err'], '.1e')}"
                         f"{'' if chk.get('ok') else ' FAIL'}")
    for pname, chk in (cell.get("check_fp8") or {}).items():  # --dtype fp8: against the dequantized references
        rel = chk.get("rel_err")
        parts.append(f"{pname} check {'-' if rel is None else format(rel, '.1e')}"
                     f"{' (' + chk['ran'] + ')' if chk.get('ran') else ''}{'' if chk.get('ok') else ' FAIL'}")
    if (cell.get("quant_error") or {}).get("rel_err") is not None:
        parts.append(f"quant err {cell['quant_error']['rel_err']:.1e}")
    r = cell.get("fp8_ratios") or {}
    for key, what in (("fp8_over_bf16", "fp8/bf16"), ("fp8_over_vllm_fp8", "fp8/vLLM fp8")):
        if r.get(key) is not None:
            parts.append(f"{what} {r[key]:.2f}x")
    parts.append(f"({cell.get('wall_s', '?')} s)")
    return " | ".join(parts)


def print_notes(result: dict):
    """Graph-capture notes and errors, before the table (the table is printed last)."""
    notes = {}
    for fam in result["families"]:
        for e in fam.get("errors", []):
            common.log(f"[bench] error {fam['name']}: {e}")
        for cell in fam["cells"]:
            for p, r in cell["paths"].items():
                n = r.get("graph_note")
                if n and n != "ok" and not n.startswith(("n/a (T >", "n/a (cpu)", "n/a (--no-graph)")):
                    notes.setdefault((p, n), []).append(f"{fam['name']}:{cell['T']}")
                if r.get("error"):
                    notes.setdefault((p, "error: " + r["error"]), []).append(f"{fam['name']}:{cell['T']}")
                if r.get("skipped"):
                    notes.setdefault((p, "skipped: " + r["skipped"]), []).append(f"{fam['name']}:{cell['T']}")
    for (p, n), where in notes.items():
        common.log(f"[bench] {p}: {n} [{', '.join(where[:6])}{' ...' if len(where) > 6 else ''}]")
    if result.get("fatal"):
        common.log(f"[bench] FATAL: {result['fatal']}")
