"""The vLLM peer: vLLM's Triton fused-MoE kernel (a standalone copy, ``--vllm-peer DIR``, or an installed vLLM), with
the block's own HF router module around it and the shared expert in plain torch."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from . import common

VLLM_INSTALLED_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"  # fused_experts(x, w1, w2, tw, ti)


def vllm_tuned_here(configs_dir: str, device: torch.device) -> bool | None:
    """Whether the peer copy ships tuned configs for this GPU (vLLM's file naming: ``device_name=<name>``, the H200
    family read as NVIDIA_H200); None off CUDA. Without them vLLM's kernel runs its default configs: the peer is then
    reported as untuned on this GPU (vLLM itself ships H100 tables that the copy lacks)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).replace(" ", "_")
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"
    files = os.listdir(configs_dir) if os.path.isdir(configs_dir) else []
    return any(f"device_name={name}." in f or f"device_name={name}," in f for f in files)


def load_vllm_peer(peer_dir: str | None, device: torch.device) -> tuple[object | None, dict]:
    """(fused(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k]) -> [T, H], info).

    ``peer_dir``: a directory holding the standalone copy ``vllm_fused_moe.py`` (vLLM's code, Apache-2.0, imported
    and timed, nothing of it copied here); without it, an installed ``vllm``'s ``fused_experts`` when importable (CUDA
    only). On CPU the copy's Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` is set for the rest of
    the process (Triton reads it when a kernel is created and at each launch; moecomp's CPU path is torch, unaffected).
    Returns (None, info with "error") when neither is there."""
    if peer_dir:
        path = os.path.join(os.path.abspath(peer_dir), "vllm_fused_moe.py")
        if not os.path.isfile(path):
            return None, dict(source=peer_dir, error=f"--vllm-peer {peer_dir}: no vllm_fused_moe.py there")
        interpret = device.type != "cuda"
        info = dict(source=os.path.relpath(path, common.REPO) if path.startswith(common.REPO) else path,
                    triton_interpret=interpret)
        name = "_bench_vllm_fused_moe" + ("_interp" if interpret else "")
        if interpret:  # read when the kernels are created and again at every launch: stays set for the process
            os.environ["TRITON_INTERPRET"] = "1"
        mod = sys.modules.get(name)
        if mod is None:
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            except Exception as e:
                sys.modules.pop(name, None)
                return None, dict(info, error=f"importing {path}: {common.root_msg(e)}")
        fused = getattr(mod, "fused_moe", None)
        if fused is None:
            return None, dict(info, error=f"{path} has no fused_moe")
        first = (mod.__doc__ or "").strip().splitlines()
        info["doc"] = first[0] if first else None
        info["tuned_here"] = vllm_tuned_here(os.path.join(os.path.dirname(path), "configs"), device)
        return fused, info
    if importlib.util.find_spec("vllm") is None:
        return None, dict(source=None, error="vLLM is not installed and no --vllm-peer DIR was given")
    if device.type != "cuda":
        return None, dict(source="vllm (installed)", error="the installed vLLM's kernel needs CUDA")
    try:
        import vllm

        mod = importlib.import_module(VLLM_INSTALLED_MODULE)
        fused = mod.fused_experts
    except Exception as e:
        return None, dict(source="vllm (installed)", error=f"importing {VLLM_INSTALLED_MODULE}: {common.root_msg(e)}")

    def fused_installed(x, w13, w2, tw, ti, _f=fused):
        return _f(x, w13, w2, tw, ti)

    return fused_installed, dict(source=f"vllm {getattr(vllm, '__version__', '?')} (installed): "
                                        f"{VLLM_INSTALLED_MODULE}.fused_experts")


def vllm_unsupported(spec, tensors: dict) -> str | None:
    """Why vLLM's kernel cannot run this block (it takes gated SiLU experts, w13 [E, 2I, H] gate rows first, w2
    [E, H, I], no expert biases), or None."""
    why = []
    if not spec.gated or spec.activation != "silu" or spec.activation_clamp:
        why.append(f"activation {'clamped ' if spec.activation_clamp else ''}{spec.activation}"
                   f"{'' if spec.gated else ' (not gated)'}, the kernel does silu(gate) * up")
    if spec.gate_up != "concat":
        why.append(f"gate/up {spec.gate_up}, the kernel wants gate rows then up rows")
    if spec.has_expert_bias or tensors.get("b13") is not None or tensors.get("b2") is not None:
        why.append("expert biases")
    if spec.weight_on_input and spec.top_k != 1:
        why.append("router weights on the expert input at top-k > 1 (vLLM applies them on the input at top-1 only)")
    if not why:
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        w13, w2 = tensors["w13"], tensors["w2"]
        want = ((E, 2 * I, H), (E, H, I)) if spec.w_layout == "out_in" else ((E, H, 2 * I), (E, I, H))
        if (tuple(w13.shape), tuple(w2.shape)) != want:
            why.append(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}, not {want[0]} / {want[1]} ({spec.w_layout})")
        elif spec.w_layout == "out_in" and not (w13.is_contiguous() and w2.is_contiguous()):
            why.append("expert weights not contiguous")
    return "; ".join(why) or None


def hf_router(block, bindings: dict, spec, device) -> tuple[object | None, str]:
    """The block's own router module (the module that owns the recognised router weight, e.g. ``gate``) when it
    returns (logits, weights [T, k], ids [T, k]) as transformers' routers do; else (None, why)."""
    name = (bindings or {}).get("router_w")
    if not name or "." not in name:
        return None, f"router weight bound as {name!r}, no router module to call"
    owner = name.rsplit(".", 1)[0]
    try:
        mod = block.get_submodule(owner)
        probe = torch.randn(3, spec.hidden_size, device=device, dtype=common.DTYPE)
        with torch.no_grad():
            out = mod(probe)
    except Exception as e:
        return None, f"calling {owner!r}: {common.root_msg(e)}"
    k = spec.top_k
    if (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
            and tuple(out[1].shape) == (3, k) and tuple(out[2].shape) == (3, k) and not out[2].is_floating_point()):
        return mod, owner
    return None, f"{owner!r} does not return (logits, weights [T, k], ids [T, k])"


def torch_shared_expert(spec, tensors: dict):
    """The shared expert in plain torch (F.linear, the activation, the sigmoid gate where the family has one), in the
    model dtype, on the block's own weights; None when the family has none."""
    sh = spec.shared
    if sh is None:
        return None
    import torch.nn.functional as F

    from moecomp.oracle import reference
    from moecomp.ops.common import split_fused_gate

    t = split_fused_gate(tensors, spec)
    w1, w3, w2, gw = t["shared_w1"], t["shared_w3"], t["shared_w2"], t["shared_gate_w"]

    def shared(x2):
        if sh.gated:
            g, u = F.linear(x2, w1).chunk(2, dim=-1) if sh.layout == "concat" else (F.linear(x2, w1), F.linear(x2, w3))
            h = reference.gated_activation(g, u, sh.activation, sh.activation_alpha, sh.activation_limit,
                                           sh.activation_clamp)
        else:
            h = reference.activation(F.linear(x2, w3), sh.activation)
        y = F.linear(h, w2)
        if sh.gate == "sigmoid":
            y = y * torch.sigmoid(F.linear(x2, gw))
        return y * sh.scale if sh.scale != 1.0 else y

    return shared


def routing_fn(spec, tensors: dict, router):
    """x2 [T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k]), both contiguous: the block's own router module,
    else ``moecomp.oracle.reference.route`` on the recognised spec (the routing every peer path puts around its kernel)."""
    from moecomp.oracle import reference
    from moecomp.ops.common import split_fused_gate

    rt = split_fused_gate(tensors, spec)

    def route(x2):
        if router is not None:
            _, tw, ti = router(x2)
        else:
            logits = reference.router_logits(x2, rt["router_w"], rt["router_b"], spec)
            tw, ti = reference.route(logits, rt["correction_bias"], spec)
            if spec.round_weights:
                tw = tw.to(x2.dtype)
        if tw.dtype != torch.float32:
            tw = tw.float()
        return tw.contiguous(), ti.contiguous()  # (no-ops for HF's routers; reference.route returns slices)

    return route


def make_vllm_fn(fused, spec, tensors: dict, router, compute_dtype: torch.dtype):
    """x [1, T, H] -> [1, T, H]: the router (the block's own module, else moecomp.oracle.reference.route on the recognised
    spec), vLLM's fused experts, plus the shared expert in torch. ``compute_dtype`` != the weights' dtype (fp32 on the
    CPU interpreter) runs the kernel on copies of x / w13 / w2 in that dtype and casts its output back."""
    H = spec.hidden_size
    w13, w2 = tensors["w13"], tensors["w2"]
    if spec.w_layout == "in_out":  # vLLM's layout, made once (as its checkpoint loader does): [E, 2I, H] / [E, H, I]
        w13, w2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    if w13.dtype != compute_dtype:
        w13, w2 = w13.to(compute_dtype).contiguous(), w2.to(compute_dtype).contiguous()
    route = routing_fn(spec, tensors, router)
    shared = torch_shared_expert(spec, tensors)
    if spec.weight_on_input:  # Llama 4: vLLM's own flag for it, on the implementation its fused_moe calls
        impl = getattr(sys.modules.get(getattr(fused, "__module__", "")), "fused_experts_impl", None)
        if impl is None:
            raise RuntimeError("the vLLM peer has no fused_experts_impl (needed for apply_router_weight_on_input)")
        return vllm_block_fn(lambda xin, tw, ti: impl(xin, w13, w2, tw, ti, activation="silu",
                                                      apply_router_weight_on_input=True), H, route, shared,
                             compute_dtype)

    return vllm_block_fn(lambda xin, tw, ti: fused(xin, w13, w2, tw, ti), H, route, shared, compute_dtype)


def vllm_block_fn(experts, H: int, route, shared, compute_dtype: torch.dtype):
    """x [1, T, H] -> [1, T, H] around a vLLM experts call ``experts(x [T, H] in compute_dtype, topk weights, topk
    ids)``: the router first, the output cast back to x's dtype, plus the shared expert in torch (bf16 and fp8
    peers alike)."""

    def vllm_fn(x):
        x2 = x.reshape(-1, H)
        tw, ti = route(x2)
        xin = x2 if x2.dtype == compute_dtype else x2.to(compute_dtype)
        out = experts(xin.contiguous(), tw, ti)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if shared is not None:
            out = out + shared(x2)
        return out.view(x.shape)

    return vllm_fn
