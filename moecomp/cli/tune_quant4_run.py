"""``python -m moecomp tune --quant4 mxfp4|int4|both``: the 4-bit experts' kernel table (``tune_args.py`` parses the
command line, ``tune.py`` hands the run here; ``tune_quant4.py`` and ``tune_quant4_decode.py`` measure).

Shapes: ``--presets`` of ``tune_quant4.QUANT4_PRESETS`` (default: every preset whose checkpoints ship in an asked
format; a preset is tuned in the asked format of its kind, so ``--quant4 int4_g32`` retunes the int4 presets with
groups of 32), or ``--shape E,I,H,k`` (SiLU, gate / up concatenated, no biases) in every asked format. Buckets:
``--tokens`` (default 1, 16, 128, 1024, 8192); buckets below 64 tokens also weigh the decode path.

Everything else is the 16-bit tuner's: one table per GPU (``moecomp/kernels/configs/<gpu>.json``, the entries under
``tuning.shape_key(E, I, H, tuning.quant4_key(quant))``, each with its "top_k" for ``ops/tuning_nearest.py``), the
measurements in the ``.meta.json`` sidecar, every finished entry saved at once (atomic, merged with the file as it is
on disk), a rerun skipping the entries there unless ``--restart``, ``--budget-s`` starting no new entry after that
many seconds (exit status 3: rerun to resume), ``--copy-to DIR`` copying both files after every entry, ``-v`` every
form, BLOCK_M, decode candidate and rejected or failing candidate, Ctrl-C exit status 130 with the file valid.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time

import torch

from ..core.spec import MoESpec
from ..ops import tuning
from .tune_io import Progress, is_done, meta_path, read_json, save_entry, source_commit
from .tune_quant4 import (INTERPRET_TILES, Q4_TILES, QUANT4_PRESETS, Run, TuneError, interpret_spec, packed_layer,
                          tile_str, tune_aligned)
from .tune_quant4_decode import INTERPRET_DECODE_TILES, Q4_DECODE_TILES, decode_probes, tune_decode

EXIT_BUDGET, EXIT_INTERRUPTED = 3, 130  # (cli/tune.py's exit statuses)
# variables that would override what the tuner measures (the forms, the decode kernels, their tiles)
IGNORED_ENV = ("MOECOMP_W4_FORM", "MOECOMP_W4_FOLD", "MOECOMP_W4_DECODE", "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM",
               "MOECOMP_DECODE_MAX_T")



def _shapes(a, formats) -> list[tuple[str, MoESpec]]:
    """(label, 4-bit spec) of every requested shape in every requested format of its kind."""
    names = [n for item in (a.presets or []) for n in item.split(",") if n]
    kinds = {q.weight for q in formats}
    if names == ["all"] or (not names and not a.shape and not a.interpret):
        names = [n for n, s in QUANT4_PRESETS.items() if s.quant.weight in kinds]
    out = []
    for n in names:
        if n not in QUANT4_PRESETS:
            raise SystemExit(f"unknown 4-bit preset {n!r}; known: {', '.join(QUANT4_PRESETS)}")
        spec = QUANT4_PRESETS[n]
        asked = [q for q in formats if q.weight == spec.quant.weight]
        if not asked:
            raise SystemExit(f"preset {n!r} is {spec.quant.weight}; --quant4 asks for "
                             f"{', '.join(tuning.quant4_key(q) for q in formats)}")
        out += [(n, spec.replace(quant=q)) for q in asked]
    shapes = list(a.shape or [])
    if a.interpret and not names and not shapes:
        out += [("interpret", interpret_spec(q)) for q in formats]
    for s in shapes:
        try:
            E, I, H, k = (int(v) for v in s.split(","))
            specs = [MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, quant=q) for q in formats]
        except Exception as e:
            raise SystemExit(f"--shape {s!r}: expected E,I,H,k (experts, intermediate, hidden, top-k): {e}") from None
        out += [(f"E={E},I={I},H={H},k={k}", sp) for sp in specs]
    return out


def quant4_jobs(a, tokens: list[int]) -> list[tuple]:
    """(table key, label, spec, T) for every requested bucket, once per key (presets of equal E, I, H and format
    share an entry)."""
    if a.fp8:
        raise SystemExit("--quant4 and --fp8: one kind of experts per run")
    jobs, seen = [], {}
    for label, spec in _shapes(a, a.quant4):
        key = tuning.shape_key(spec.num_experts, spec.intermediate_size, spec.hidden_size,
                               tuning.quant4_key(spec.quant))
        if key in seen:
            print(f"[tune] {label}: same table as {seen[key]} ({key}), tuned once", file=sys.stderr)
            continue
        seen[key] = label
        jobs += [(key, label, spec, T) for T in dict.fromkeys(tokens)]
    return jobs


def tune_one(spec: MoESpec, T: int, tokens: list[int], dtype: torch.dtype, device: torch.device, rep_ms: float,
             prog: Progress) -> tuple[dict, dict]:
    """(table entry, measurements) of one (shape, bucket): the aligned path, then below 64 tokens the decode path
    (a decode path without a working candidate: noted, max_t 0)."""
    interp = device.type != "cuda"
    probes = decode_probes(T, tokens)
    x_all, named = packed_layer(spec, max([T] + probes), dtype, device, seed=T)
    run = Run(device, rep_ms, prog.status, prog.note)
    r = tune_aligned(spec, x_all[:T], named, run, INTERPRET_TILES if interp else Q4_TILES)
    config, rec = r.pop("config"), r
    if probes:
        try:
            d = tune_decode(spec, probes, x_all, named, config, run, INTERPRET_DECODE_TILES if interp
                            else Q4_DECODE_TILES)
            config["decode"], rec["decode_ms"], rec["decode_tiles_ms"] = d["decode"], d["ms"], d["tiles_ms"]
        except TuneError as e:
            prog.note(f"T={T}: decode path not used: {e}", always=True)
            config["decode"] = dict(max_t=0)
    else:  # no decode path from this bucket on (as the 16-bit tuner's entries there)
        config["decode"] = dict(max_t=0)
    config["top_k"] = spec.top_k  # what ops/tuning_nearest.py weighs rows per expert with
    del x_all, named
    return config, dict(rec, rejected=run.rejected, failed=run.failed)


def _summary(c: dict, rec: dict) -> str:
    form = c["w4_form"] + ("+fold" if c.get("w4_fold") else "")
    dec = c.get("decode", {})
    text = f"{rec['ms'] * 1e3:.1f} us {form} BM={c['BLOCK_M']} g1 {tile_str(c['g1'])} g2 {tile_str(c['g2'])}"
    if dec.get("max_t"):
        text += f"; decode {dec['mode']} up to T={dec['max_t']}"
    elif "decode_ms" in rec:
        text += "; decode path not faster"
    if rec.get("decode_ms"):
        text += " (" + ", ".join(f"T={t}: " + "/".join(f"{n} {v * 1e3:.1f}" for n, v in m.items())
                                 for t, m in rec["decode_ms"].items()) + " us)"
    return text


def _copy(path: str, copy_to: str | None) -> None:
    if not copy_to:
        return
    os.makedirs(copy_to, exist_ok=True)
    for p in (path, meta_path(path)):
        dst = os.path.join(copy_to, os.path.basename(p))
        if not (os.path.exists(dst) and os.path.samefile(p, dst)):
            shutil.copyfile(p, dst)


def run_quant4(a, device: torch.device, dtype: torch.dtype, tokens: list[int], path: str) -> int:
    """The ``--quant4`` run of ``tune.main`` (its device, x's dtype, buckets and table path): module docstring."""
    for var in IGNORED_ENV:
        if os.environ.pop(var, None) is not None:
            print(f"[tune] {var} ignored while tuning (the tuner measures what it sets)", file=sys.stderr)
    jobs = quant4_jobs(a, tokens)
    table = read_json(path)
    todo = [j for j in jobs if a.restart or not is_done(table, j[0], j[3])]
    if len(jobs) > len(todo):
        what = "all entries skipped" if not todo else f"skipping {len(jobs) - len(todo)}/{len(jobs)} entries"
        print(f"[tune] {what}: already in {path} (--restart measures them again)", file=sys.stderr)
    if not todo:
        return 0
    import triton

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    commit, dirty = source_commit()
    stamp = dict(commit=commit, dirty=dirty, torch=torch.__version__, triton=triton.__version__, device=dev_name,
                 dtype=str(dtype).replace("torch.", ""), rep_ms=a.rep, interpret=a.interpret)
    prog = Progress(len(todo), verbose=a.verbose)
    print(f"[tune] {len(todo)} 4-bit entries ({len({j[0] for j in todo})} shapes) on {dev_name} -> {path}",
          file=sys.stderr)
    t_start, left, status, saved = time.time(), 0, 0, 0
    try:
        for i, (key, label, spec, T) in enumerate(todo):
            if i and a.budget_s is not None and time.time() - t_start > a.budget_s:  # one entry per run at least
                left = len(todo) - i
                break
            short = key.replace(",dtype=", " ")
            prog.start(f"{short} T={T}")
            t0 = time.time()
            try:
                config, rec = tune_one(spec, T, tokens, dtype, device, a.rep, prog)
            except TuneError as e:
                prog.finished(f"{short} T={T}: FAILED, nothing saved: {e}", None)
                status = 1
                continue
            meta = dict(stamp, **rec, preset=label, quant4=tuning.quant4_key(spec.quant),
                        seconds=round(time.time() - t0, 2),
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
            save_entry(path, key, T, config, meta)
            _copy(path, a.copy_to)
            saved += 1
            extra = "".join(f", {rec[n]} {n}" for n in ("rejected", "failed") if rec[n])
            prog.finished(f"{short} T={T}: {_summary(config, rec)} ({time.time() - t0:.0f} s{extra})",
                          time.time() - t0)
            if device.type == "cuda" and (i + 1 == len(todo) or todo[i + 1][0] != key):
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        prog.close()
        print(f"\n[tune] interrupted: {saved}/{len(todo)} entries saved in {path}; rerun the same command to "
              f"resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    prog.close()
    if left:
        print(f"[tune] budget of {a.budget_s:g} s spent: {left} entries left; rerun the same command to resume "
              f"({path})", file=sys.stderr)
        return EXIT_BUDGET
    print(f"[tune] wrote {path} ({saved} entries, {time.time() - t_start:.0f} s)", file=sys.stderr)
    return status
