"""Kernels and GPU busy time per decode step of ``bench_generate.py``'s paths (its ``--profile``; also
``bench_generate_fp8.py``'s): split from ``bench_generate.py`` by concern; the calls it profiles are ``gen_run.py``'s.

Launches per decoder layer (issue 41 item 1, target <= 6 at batch 1), two figures of the replayed step:

    kernels_per_layer           kernels per step / decoder layers (the step's own kernels, embedding, final norm,
                                lm_head and sampling, spread over the layers: an upper bound)
    kernels_per_layer_repeated  only the kernels whose name runs at least once per layer each step, / layers (what
                                the layers launch, where the step's own kernels run fewer times than there are layers)
"""

from __future__ import annotations

import time

import torch

import gen_run


def _kernels(prof) -> tuple[int, float, dict]:
    """(kernel count, kernel time in ms, {name: [count, us]}) of a profile: device activities except copies / memsets."""
    n, us, by = 0, 0.0, {}
    try:
        evs = [(e.name(), e.duration_ns() / 1e3) for e in prof.profiler.kineto_results.events()
               if "cuda" in str(e.device_type()).lower()]
    except Exception:
        evs = [(e.name, getattr(e, "device_time_total", 0.0)) for e in prof.events()
               if "cuda" in str(getattr(e, "device_type", "")).lower()]
    for name, d in evs:
        if "Memcpy" in name or "Memset" in name:
            continue
        n += 1
        us += d
        b = by.setdefault(name[:90], [0, 0.0])
        b[0] += 1
        b[1] += d
    return n, us / 1e3, by


def decoder_layers(model) -> int | None:
    """The model's decoder layers: the length of its base model's ``layers`` list (what the engine compiles), else
    the text config's ``num_hidden_layers``; None when neither says."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return len(layers)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    n = getattr(cfg, "num_hidden_layers", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def per_layer(kernels_per_step: float, counts_per_step: dict, layers: int | None) -> dict:
    """The per-layer launch figures (module docstring) from the kernels per step and {name: launches per step}."""
    if not layers:
        return dict(decoder_layers=layers, kernels_per_layer=None, kernels_per_layer_repeated=None)
    repeated = sum(c for c in counts_per_step.values() if c >= layers - 1e-9)
    return dict(decoder_layers=layers, kernels_per_layer=kernels_per_step / layers,
                kernels_per_layer_repeated=repeated / layers)


def profile_steps(model, path: str, ids, cuda: bool, steps: int = 8) -> dict:
    """Kernels and GPU busy time per decode step: two profiled calls (1 and 1 + steps new tokens), differenced, so
    the prefill drops out. Idle = 1 - kernel time / wall time of the decode steps."""
    from torch.profiler import ProfilerActivity, profile

    kw = dict(moecomp_fast=False) if path == "optimize_hf" else {}

    def call(new):
        if path.startswith("one_liner"):
            return gen_run.run_one_liner(model, ids, new, cuda)[:3]
        return gen_run.run_hf_loop(model, ids, new, cuda, **kw)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    call(1 + steps)  # warm-up (captures), both lengths: a first 1-token call captured inside the profile made
    call(1)  # the wall-time difference negative (H100, s18a)
    got = []
    for new in (1, 1 + steps):
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            _, pre, dec = call(new)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        got.append((*_kernels(prof), wall * 1e3))
    (k1, b1, by1, w1), (k2, b2, by2, w2) = got
    per_k, per_busy, per_wall = (k2 - k1) / steps, (b2 - b1) / steps, (w2 - w1) / steps
    top, counts = [], {}
    for name, (c, t) in by2.items():
        c0, t0 = by1.get(name, (0, 0.0))
        counts[name] = (c - c0) / steps
        top.append((round((t - t0) / steps, 2), round(counts[name], 2), name))
    top.sort(reverse=True)
    # the first call (one new token) is the prefill with one sampling: its kernels against its wall time show
    # whether the time to first token is the device's or the host's
    pre_top = sorted(((round(t, 1), c, name) for name, (c, t) in by1.items()), reverse=True)
    return dict(path=path, kernels_per_step=per_k, **per_layer(per_k, counts, decoder_layers(model)),
                gpu_busy_ms_per_step=per_busy, wall_ms_per_step=per_wall,
                gpu_idle_frac=max(0.0, 1 - per_busy / per_wall) if per_wall > 0 else None,
                decode_ms_per_step_unprofiled=dec * 1e3, top_kernels_us_per_step=top[:25],
                prefill=dict(kernels=k1, gpu_busy_ms=b1, wall_ms=w1, top_kernels_us=pre_top[:20]))


def profile_table(profiles: list) -> list:
    """The ``--profile`` rows as a table: kernels per decode step and per decoder layer (``gen_profile.per_layer``)."""
    if not profiles:
        return []

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["", "| model | weights | B | path | kernels / step | decoder layers | kernels / layer | "
             "repeated / layer | GPU busy ms/step | wall ms/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        lines.append(f"| {p.get('model', '-')} | {p.get('dtype', '-')} | {p['batch']} | {p.get('path', '-')} | "
                     f"{p['kernels_per_step']:.1f} | {num(p.get('decoder_layers'), 'd')} | "
                     f"{num(p.get('kernels_per_layer'), '.2f')} | {num(p.get('kernels_per_layer_repeated'), '.2f')} | "
                     f"{p['gpu_busy_ms_per_step']:.3f} | "
                     f"{p['wall_ms_per_step']:.3f} |")
    return lines
