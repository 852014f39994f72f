"""The run's environment (versions, GPU, commit), what the peers dispatch to, and saving the JSON."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess

import torch

from . import common


def git_commit() -> str:
    """MOECOMP_COMMIT when set (a snapshot run from inside another checkout would otherwise report that checkout's
    HEAD), else the repository's HEAD (+ "-dirty")."""
    if os.environ.get("MOECOMP_COMMIT"):
        return os.environ["MOECOMP_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.REPO, capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            sha = r.stdout.strip()
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=common.REPO,
                               capture_output=True, text=True, timeout=20)
            return sha + ("-dirty" if d.returncode == 0 and d.stdout.strip() else "")
    except Exception:
        pass
    return os.environ.get("MOECOMP_COMMIT", "unknown") or "unknown"


def environment(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_v = triton.__version__
    except Exception:
        triton_v = None
    env = dict(torch=torch.__version__, triton=triton_v, transformers=transformers.__version__,
               python=platform.python_version(), cuda=torch.version.cuda, device=device.type)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), capability=".".join(map(str, (props.major, props.minor))),
                   sm_count=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / 2**30, 1))
    else:
        env.update(gpu=f"cpu ({platform.processor() or platform.machine()})")
    return env


def peer_hygiene() -> dict:
    """What the HF / compile peers actually dispatch to once moecomp is imported (kept in the JSON)."""
    h = {}
    try:
        from transformers.integrations import moe as hf_moe

        fns = hf_moe.ALL_EXPERTS_FUNCTIONS
        for name in ("eager", "grouped_mm"):
            f = fns.get(name, None) if hasattr(fns, "get") else None
            h[f"experts_{name}"] = None if f is None else f"{getattr(f, '__module__', '?')}.{f.__qualname__}"
    except Exception as e:
        h["experts"] = common.root_msg(e)
    try:
        import torch._inductor.config as iconfig

        h["inductor_post_grad_custom_post_pass"] = repr(iconfig.post_grad_custom_post_pass)
        h["inductor_post_grad_custom_pre_pass"] = repr(iconfig.post_grad_custom_pre_pass)
    except Exception as e:
        h["inductor"] = common.root_msg(e)
    return h


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


def save(result: dict, path: str | None):
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)
    out_dir = os.environ.get("OUT")
    if out_dir and os.path.isdir(out_dir) and os.path.abspath(os.path.dirname(path)) != os.path.abspath(out_dir):
        with open(os.path.join(out_dir, os.path.basename(path)), "w") as f:
            json.dump(result, f, indent=1, default=str)
