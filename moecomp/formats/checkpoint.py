"""Reading a safetensors checkpoint directory into a model built on the meta device (moecomp's own loaders).

transformers' ``from_pretrained`` cannot keep quantized experts packed without the hub's kernels (it dequantizes
MXFP4 experts to bf16 on load; ``docs/QUANT4.md``), so the 4-bit loaders (``formats/mxfp4.py``) build the model here:

    config      transformers ``AutoConfig`` of the directory, ``quantization_config`` removed (the model is built as
                a 16-bit one; the loader swaps the quantized modules in itself)
    skeleton    ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``: no parameter allocated
    tensors     every key read with ``safetensors.safe_open`` straight onto the target device (one tensor at a time;
                shards listed by ``model.safetensors.index.json``), floating tensors cast to the model dtype, and set
                in place of the meta parameter / buffer (``set_tensor``)
    the rest    tied weights tied as transformers ties them (``model.tie_weights()``), buffers the checkpoint does not
                hold (rotary ``inv_freq`` ...) made on the device and initialised by the model's own ``_init_weights``

Missing or unexpected keys are a ``ValueError`` naming them: nothing is initialised at random.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def resolve_dir(path_or_dir: str) -> str:
    """The checkpoint directory of ``path_or_dir`` (a directory, or a file inside one). Hub ids are not fetched."""
    p = os.fspath(path_or_dir)
    if os.path.isfile(p):
        p = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(p):
        raise FileNotFoundError(f"{p!r} is not a local checkpoint directory (moecomp.load reads local files only; "
                                "download the checkpoint first)")
    if not os.path.exists(os.path.join(p, "config.json")):
        raise FileNotFoundError(f"{p!r} has no config.json")
    return p


class Checkpoint:
    """The tensors of a checkpoint directory, by key, each read when asked for (``safetensors.safe_open``)."""

    def __init__(self, directory: str, device="cpu"):
        from safetensors import safe_open

        self.directory = directory
        self.device = torch.device(device)
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
        else:
            files = [SINGLE] if os.path.exists(os.path.join(directory, SINGLE)) else sorted(
                f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{directory!r} holds no .safetensors file")
            where = {}
            for fname in files:
                with safe_open(os.path.join(directory, fname), framework="pt") as f:
                    where.update({k: fname for k in f.keys()})
        self._where: dict[str, str] = dict(where)
        self._open: dict = {}
        self._safe_open = safe_open

    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def _file(self, key: str):
        fname = self._where[key]
        f = self._open.get(fname)
        if f is None:
            dev = "cpu" if self.device.type == "meta" else str(self.device)
            f = self._open[fname] = self._safe_open(os.path.join(self.directory, fname), framework="pt", device=dev)
        return f

    def shape(self, key: str) -> tuple:
        return tuple(self._file(key).get_slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """The safetensors dtype of ``key`` ("U8", "BF16", ...), from the header."""
        return self._file(key).get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key`` on the checkpoint's device, as stored (dtype and shape)."""
        return self._file(key).get_tensor(key)

    def close(self) -> None:
        self._open.clear()


def load_config(directory: str):
    """(transformers config without its ``quantization_config``, that quantization config as a dict or None)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config, qc


def build_on_meta(config, dtype: torch.dtype) -> nn.Module:
    """The causal-LM model of ``config`` with every parameter and buffer on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of parameter / buffer ``name`` (a Parameter keeps its ``requires_grad``)."""
    mod_path, _, leaf = name.rpartition(".")
    m = model.get_submodule(mod_path) if mod_path else model
    if leaf in m._parameters:
        old = m._parameters[leaf]
        m._parameters[leaf] = nn.Parameter(value, requires_grad=bool(old is not None and old.requires_grad
                                                                     and value.is_floating_point()))
    elif leaf in m._buffers:
        m._buffers[leaf] = value
    else:
        raise KeyError(name)


def _tied_targets(model: nn.Module) -> set[str]:
    fn = getattr(model, "get_expanded_tied_weights_keys", None)
    if fn is None:
        return set()
    try:
        return set(fn(all_submodels=True))
    except Exception:  # noqa: BLE001  (a model whose tie mapping cannot be read ties nothing here)
        return set()


def load_tensors(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype, skip: set[str] = frozenset(),
                 taken: set[str] = frozenset()) -> None:
    """Read every parameter and persistent buffer of ``model`` still on the meta device from ``ckpt`` (floating
    tensors cast to ``dtype``), tie tied weights, make and initialise the remaining buffers. ``skip``: module paths
    already filled (their tensors are not looked up); ``taken``: checkpoint keys those modules consumed.
    ``ValueError`` naming missing or unexpected keys."""
    tied = _tied_targets(model)
    want: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(_persistent_buffers(model)):
        if t.device.type == "meta" and not any(name == s or name.startswith(s + ".") for s in skip):
            want[name] = t
    missing = [n for n in want if n not in ckpt and n not in tied]
    unexpected = sorted(ckpt.keys() - set(want) - set(taken))
    if missing or unexpected:
        msg = []
        if missing:
            msg.append(f"missing from the checkpoint: {_few(missing)}")
        if unexpected:
            msg.append(f"not in the model: {_few(unexpected)}")
        raise ValueError(f"{ckpt.directory}: " + "; ".join(msg))
    for name, old in want.items():
        if name not in ckpt:
            continue
        v = ckpt.get(name)
        if tuple(v.shape) != tuple(old.shape):
            raise ValueError(f"{name} has shape {tuple(v.shape)} in the checkpoint; the model needs {tuple(old.shape)}")
        if v.is_floating_point() and v.dtype != dtype and old.is_floating_point():
            v = v.to(dtype)
        set_tensor(model, name, v)
    if tied:
        model.tie_weights()
    _init_buffers(model, ckpt.device)
    left = [n for n, t in model.named_parameters() if t.device.type == "meta"]
    if left:
        raise ValueError(f"{ckpt.directory}: not filled: {_few(left)}")


def _persistent_buffers(model: nn.Module):
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), b


def _init_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers still on the meta device (non-persistent: rotary ``inv_freq`` ...) made on ``device`` and initialised
    as transformers initialises them (``model._init_weights`` of their module, which holds no parameter)."""
    init = getattr(model, "_init_weights", None)
    for mname, m in model.named_modules():
        meta = [n for n, b in m._buffers.items() if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        if any(p.device.type == "meta" for p in m.parameters(recurse=False)) or init is None:
            raise ValueError(f"{mname}: buffers {meta} are not in the checkpoint and cannot be initialised")
        if any(True for _ in m.parameters(recurse=False)):
            raise ValueError(f"{mname}: buffers {meta} are not in the checkpoint (a module with loaded parameters: "
                             "its initialisation would overwrite them)")
        for n in meta:
            b = m._buffers[n]
            m._buffers[n] = torch.empty_like(b, device=device)
        with torch.no_grad():
            init(m)


def _few(names, n: int = 6) -> str:
    names = list(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more
