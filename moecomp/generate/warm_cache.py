"""Warm starts: the generate engine's compile artifacts kept on disk, loaded by the next process (``moecomp.warmup``).

torch keeps what ``torch.compile`` produced (Inductor's compiled graphs with their Triton kernels bundled, AOTAutograd's
graphs, autotuning results) in its own on-disk caches, ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``: a second
run on the same machine finds them, a fresh container or another machine does not. ``torch.compiler.
save_cache_artifacts()`` serializes everything this process compiled (or found in those caches) into one blob, and
``load_cache_artifacts(blob)`` writes it into the local caches of another process, whose compiles then hit them.
This module keeps those blobs per model: a server's ``moecomp.warmup`` pays the compile once per model, stack and GPU::

    <cache dir>/compile/<entry key>/key.json       what the entry is for (versions, device, model structure)
    <cache dir>/compile/<entry key>/<uuid>.bin     a "MOECOMPWARM1" line, one JSON header line (entry key, payload
                                                   bytes, sha256, artifact keys), then save_cache_artifacts()'s blob
    <cache dir>/triton/<Triton's kernel dir>/      moecomp's own Triton kernels (warm_triton.py: not in torch's blob,
                                                   the custom ops that launch them are opaque to Inductor)

**Where.** ``moecomp.warmup(..., cache_dir=PATH)``, else ``$MOECOMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/moecomp``
(``~/.cache/moecomp``). ``MOECOMP_WARM_CACHE=0`` turns the cache off (an explicit ``cache_dir`` still wins);
``cache_dir=False`` turns it off for that call. To clear it: delete the directory (or ``warm_cache.clear()``).

**Entry key** (``key_fields``): torch, Triton, transformers, moecomp and Python versions, the device (GPU name and
compute capability; CPU: the machine), the model's class and config (every field but names, paths and token ids), its
parameter dtypes, attention / experts implementations, the spec keys of the bound MoE blocks and the engine's compile
backend; never the weights' values (the compiled code does not depend on them: the same entry serves every
checkpoint of one architecture). Any change gives a new entry, i.e. a cold compile. The key only picks the file:
torch checks every artifact against its own content keys (graph, shapes, configs, versions), so a stale entry costs
time, never a wrong result.

**When.** ``moecomp.warmup`` loads the entry before its first compile and saves after each batch size (atomic: a temp
file, then a rename). A save that found nothing new keeps the files as they are; a save holding every artifact of
files it read replaces them; otherwise (another process warmed other batch sizes) it is added as one more file, and
the next load reads them all. The plain first ``generate()`` that compiles (no warmup) **loads** the matching entry too,
because a user who shipped a warmed cache directory expects the next process to use it, and a load is a file read
(``MOECOMP_WARM_CACHE=0`` turns that off). It does not **save**: serializing every artifact of the process would add
seconds to a call the user is timing and write to the home directory unasked; ``moecomp.warmup`` is the explicit
"prepare this model" step that writes. A file that cannot be read (corrupt, truncated, another key, another torch) is
reported with a warning naming it and the exception, ignored (that phase compiles from scratch), and replaced by the
next save; nothing here ever makes ``generate`` fail. moecomp's Triton kernels are restored earlier, by
``moecomp.optimize`` on a CUDA model (its checks run them) from the default directory (``$MOECOMP_CACHE_DIR`` or
``~/.cache/moecomp``: set the variable when the cache lives elsewhere), and again by each load; each save packs those
this process ran.

What it does not skip: Dynamo still traces each compiled function and checks its guards, and CUDA graphs are captured
again in the new process; the artifacts spare Inductor's code generation and Triton's compiles, moecomp's kernels
included (on CPU, Inductor's C++ builds are not in the artifacts: they are rebuilt from the cached source).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import time
import uuid
import warnings

import torch

from . import attention, warm_triton

ENV_DIR = "MOECOMP_CACHE_DIR"
ENV_SWITCH = "MOECOMP_WARM_CACHE"
MAGIC = b"MOECOMPWARM1\n"
SUBDIR = "compile"
# config fields that name or label a checkpoint, or steer generate() outside the compiled layers
_CONFIG_SKIP = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures",
                          "id2label", "label2id", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
                          "decoder_start_token_id", "task_specific_params", "finetuning_task", "tokenizer_class",
                          "prefix", "problem_type", "return_dict", "output_attentions", "output_hidden_states",
                          "use_cache", "dtype", "torch_dtype"})


_UNSWAPPED = {attention.NAME: "sdpa", attention.NAME_EAGER: "eager"}


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moecomp")


def _supported() -> str | None:
    """Why torch offers no artifact cache here (None: it does). By feature, not by version."""
    tc = torch.compiler
    if not (hasattr(tc, "save_cache_artifacts") and hasattr(tc, "load_cache_artifacts")):
        return f"torch {torch.__version__} has no torch.compiler.save_cache_artifacts / load_cache_artifacts"
    if getattr(getattr(tc, "config", None), "force_disable_caches", False):
        return "torch's compile caches are disabled (torch.compiler.config.force_disable_caches)"
    return None


def resolve(cache_dir=None) -> tuple[str | None, str | None]:
    """(the cache directory, None), or (None, why the cache is off). ``cache_dir``: None (``$MOECOMP_CACHE_DIR`` or
    the default, unless ``MOECOMP_WARM_CACHE=0``), False (off), or a directory path. ``ValueError`` otherwise."""
    if cache_dir is False:
        return None, "off (cache_dir=False)"
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)) or cache_dir == "":
        raise ValueError(f"cache_dir: expected a directory path, None (the default: ${ENV_DIR} or {default_dir()}) "
                         f"or False (off), got {cache_dir!r}")
    if cache_dir is not None:
        path = os.path.abspath(os.fspath(cache_dir))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"cache_dir: expected a directory, {path!r} is a file")
    else:
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return None, f"off ({ENV_SWITCH}=0)"
        path = os.path.abspath(os.environ.get(ENV_DIR) or default_dir())
    why = _supported()
    return (None, f"off ({why})") if why else (path, None)


def _versions() -> dict:
    top = sys.modules.get(__name__.split(".")[0])  # the package (imported before any of its modules)
    out = dict(torch=torch.__version__, moecomp=str(getattr(top, "__version__", "?")),
               python="%d.%d" % sys.version_info[:2])
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # (a CPU build without Triton: recorded as such)
            out[name] = f"unavailable ({type(e).__name__})"
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return f"{device.type} {platform.machine()}"


def _config_digest(config) -> tuple[str, str]:
    """(config class, sha256 of its fields that shape the compiled layers)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    d = {k: v for k, v in d.items() if k not in _CONFIG_SKIP}
    for k in ("_attn_implementation", "_experts_implementation"):  # (private: to_dict may leave them out)
        d[k] = str(getattr(config, k, None))
    # the decode step runs under attention.Swapped (moecomp's kernel registered under its own names): the same key
    # whether the first compile is the decode step's (swapped) or warmup's / the prefill's
    d["_attn_implementation"] = _UNSWAPPED.get(d["_attn_implementation"], d["_attn_implementation"])
    text = json.dumps(d, sort_keys=True, default=str)
    return type(config).__name__, hashlib.sha256(text.encode()).hexdigest()


def _spec_keys(model: torch.nn.Module) -> list[str]:
    """The spec key of every bound MoE block and experts-only module (sorted: which layer holds which does not
    change the compiled code of one layer)."""
    keys = []
    for m in model.modules():
        for attr in ("_moecomp", "_moecomp_experts"):
            st = m.__dict__.get(attr)
            if st is None:
                continue
            key = getattr(st, "spec_key", None) or getattr(getattr(st, "spec", None), "key", None)
            keys.append(f"{attr}:{key if key is not None else type(st).__name__}")
    return sorted(keys)


def key_fields(model: torch.nn.Module, backend, device: torch.device) -> dict:
    """What makes the engine's compiled artifacts valid (the module docstring's "Entry key"): JSON-serializable."""
    cfg_class, cfg_hash = _config_digest(model.config)
    specs = _spec_keys(model)
    return dict(versions=_versions(), device=_device_name(device), model=f"{type(model).__module__}."
                f"{type(model).__qualname__}", config_class=cfg_class, config_sha256=cfg_hash,
                dtypes=sorted({str(p.dtype) for p in model.parameters()}), bound_blocks=len(specs),
                spec_keys_sha256=hashlib.sha256("\n".join(specs).encode()).hexdigest(),
                backend=getattr(backend, "__name__", str(backend)))


def entry_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


@dataclasses.dataclass
class Entry:
    """One engine's entry: where it lives, what was loaded from it, what this process saved into it."""

    root: str | None  # the cache directory (None: off)
    path: str | None = None  # <root>/compile/<key>
    key: str | None = None
    fields: dict | None = None
    segments: dict = dataclasses.field(default_factory=dict)  # file name -> frozenset of artifact keys (known files)
    broken: list = dataclasses.field(default_factory=list)  # file names that could not be read (replaced on save)
    report: dict = dataclasses.field(default_factory=dict)  # the load's report (also in moecomp.warmup's result)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _artifact_keys(info) -> frozenset | None:
    """{"type:key"} from a torch ``CacheInfo`` (None where this torch's CacheInfo lists none)."""
    arts = getattr(info, "artifacts", None)
    if not isinstance(arts, dict):
        return None
    return frozenset(f"{t}:{k}" for t, keys in arts.items() for k in keys)


def _counts(keys) -> dict:
    out: dict = {}
    for k in keys or ():
        t = k.split(":", 1)[0]
        out[t] = out.get(t, 0) + 1
    return out


def _read_segment(path: str, key: str) -> tuple[bytes, frozenset]:
    """(torch's payload, its artifact keys); ``ValueError`` saying what is wrong with the file."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise ValueError("not a moecomp warm-cache file (bad magic line)")
    nl = data.find(b"\n", len(MAGIC))
    if nl < 0:
        raise ValueError("truncated header")
    header = json.loads(data[len(MAGIC):nl].decode())
    payload = data[nl + 1:]
    if header.get("key") != key:
        raise ValueError(f"made for entry {header.get('key')!r}, not {key!r}")
    if header.get("bytes") != len(payload):
        raise ValueError(f"payload of {len(payload)} bytes, the header says {header.get('bytes')}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("payload checksum mismatch")
    return payload, frozenset(header.get("artifacts") or ())


def _warn_ignored(path: str, e: BaseException) -> None:
    warnings.warn(f"moecomp warm cache: ignored {path}: {type(e).__name__}: {e} (what it held compiles from scratch; "
                  f"the next moecomp.warmup replaces it)", UserWarning, stacklevel=4)


def _segments(path: str) -> list[str]:
    try:
        names = [n for n in os.listdir(path) if n.endswith(".bin")]
    except FileNotFoundError:
        return []
    return sorted(names, key=lambda n: os.path.getmtime(os.path.join(path, n)))


def load(engine, cache_dir=None, who: str = "moecomp.warmup") -> dict:
    """Load the engine's entry under ``cache_dir`` (``resolve``) into torch's local caches, once per engine and
    directory; sets ``engine.warm`` and returns its report: {"dir", "entry", "load": "hit" | "miss" | "failed" |
    "off (why)", "loaded_by", "load_s", "loaded_bytes", "artifacts": {type: count}, "ignored": [files], "triton_load":
    warm_triton.restore's report}."""
    root, why = resolve(cache_dir)
    old = getattr(engine, "warm", None)
    if old is not None and old.root == root and old.report:
        return old.report
    if root is None:
        engine.warm = Entry(None, report=dict(dir=None, entry=None, load=why, loaded_by=who))
        return engine.warm.report
    t0 = time.perf_counter()
    model = engine.model
    try:
        fields = key_fields(model, engine.compile_backend, next(model.parameters()).device)
    except Exception as e:  # (a model whose config does not serialize: compiles from scratch, said so)
        warnings.warn(f"moecomp warm cache: no entry key for this model: {type(e).__name__}: {e} (compiles from "
                      f"scratch)", UserWarning, stacklevel=3)
        engine.warm = Entry(None, report=dict(dir=root, entry=None, load=f"failed ({type(e).__name__}: {e})",
                                              loaded_by=who))
        return engine.warm.report
    key = entry_key(fields)
    ent = Entry(root, os.path.join(root, SUBDIR, key), key, fields)
    loaded, nbytes, keys = 0, 0, set()
    for name in _segments(ent.path):
        fpath = os.path.join(ent.path, name)
        try:
            payload, seg_keys = _read_segment(fpath, key)
            info = torch.compiler.load_cache_artifacts(payload)
            if info is None and payload:
                raise ValueError("torch could not read the artifacts (its log says why)")
        except Exception as e:
            ent.broken.append(name)
            _warn_ignored(fpath, e)
            continue
        got = _artifact_keys(info)
        ent.segments[name] = got if got is not None else seg_keys
        keys |= ent.segments[name]
        loaded, nbytes = loaded + 1, nbytes + len(payload)
    status = "hit" if loaded else ("failed" if ent.broken else "miss")
    kernels = _restore_kernels(root)
    ent.report = dict(dir=root, entry=ent.path, load=status, loaded_by=who, load_s=time.perf_counter() - t0,
                      loaded_bytes=nbytes, artifacts=_counts(keys), ignored=list(ent.broken), triton_load=kernels)
    engine.warm = ent
    return ent.report


def save(engine) -> dict:
    """Save what this process compiled into the engine's entry (after ``load``): {"save": "saved" | "unchanged" |
    "nothing to save (...)" | "off" | "failed (...)", "saved_bytes", "save_s", "file", "triton_save": warm_triton.pack's
    report}. Never raises."""
    ent = getattr(engine, "warm", None)
    if ent is None or ent.root is None:
        return dict(save="off", saved_bytes=0, save_s=0.0, file=None)
    t0 = time.perf_counter()
    try:
        out = _save(ent)
    except Exception as e:
        warnings.warn(f"moecomp warm cache: could not save into {ent.path}: {type(e).__name__}: {e}", UserWarning,
                      stacklevel=3)
        out = dict(save=f"failed ({type(e).__name__}: {e})", saved_bytes=0, file=None)
    try:
        out["triton_save"] = warm_triton.pack(ent.root)
    except Exception as e:
        warnings.warn(f"moecomp warm cache: could not pack Triton kernels into {ent.root}: {type(e).__name__}: {e}",
                      UserWarning, stacklevel=3)
        out["triton_save"] = f"failed ({type(e).__name__}: {e})"
    out["save_s"] = time.perf_counter() - t0
    return out


def _save(ent: Entry) -> dict:
    res = torch.compiler.save_cache_artifacts()
    if res is None:
        return dict(save="nothing to save (no compile artifacts in this process: no Inductor compile ran)",
                    saved_bytes=0, file=None)
    payload, info = res
    keys = _artifact_keys(info)
    known = frozenset().union(*ent.segments.values()) if ent.segments else frozenset()
    if keys is not None and keys <= known and not ent.broken:
        return dict(save="unchanged (every artifact is in the entry's files)", saved_bytes=0, file=None)
    os.makedirs(ent.path, exist_ok=True)
    key_json = os.path.join(ent.path, "key.json")
    if not os.path.exists(key_json):
        _atomic_write(key_json, json.dumps(dict(key=ent.key, **ent.fields), indent=1, sort_keys=True).encode())
    header = dict(key=ent.key, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest(),
                  artifacts=sorted(keys) if keys is not None else None, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  torch=torch.__version__)
    name = f"{uuid.uuid4().hex}.bin"
    _atomic_write(os.path.join(ent.path, name), MAGIC + json.dumps(header).encode() + b"\n" + payload)
    # files this one covers (every artifact they held is in it) and unreadable ones go
    gone = [n for n, k in ent.segments.items() if keys is not None and k <= keys] + ent.broken
    for n in gone:
        try:
            os.unlink(os.path.join(ent.path, n))
        except FileNotFoundError:
            pass
        ent.segments.pop(n, None)
    ent.broken = []
    ent.segments[name] = keys if keys is not None else frozenset()
    return dict(save="saved", saved_bytes=len(payload), file=os.path.join(ent.path, name),
                replaced=len(gone), files=len(ent.segments))


_restored: dict = {}  # cache directory -> warm_triton.restore's report (once per process and directory)


def _restore_kernels(root: str) -> dict:
    """moecomp's packed Triton kernels into Triton's cache, once per process and directory (``warm_triton.py``)."""
    if root not in _restored:
        _restored[root] = warm_triton.restore(root)
    return _restored[root]


def before_optimize(model: torch.nn.Module) -> None:
    """``moecomp.optimize``'s hook, before its checks run the op: a CUDA model's packed Triton kernels restored from
    the default cache directory (``resolve(None)``), so neither the checks nor generate() compile them again. Never
    raises."""
    try:
        if not any(p.is_cuda for p in model.parameters()):
            return
        root, _ = resolve(None)
        if root is not None:
            _restore_kernels(root)
    except Exception as e:
        warnings.warn(f"moecomp warm cache: could not restore Triton kernels: {type(e).__name__}: {e}", UserWarning,
                      stacklevel=3)


def before_compile(engine) -> None:
    """The engine's hook before its first compile in this process: load the matching entry (the module docstring's
    "When"), unless this engine has looked already (``moecomp.warmup`` loads first). Never raises: a failure is
    warned of and the engine compiles from scratch."""
    if getattr(engine, "warm", None) is not None:
        return
    try:
        load(engine, None, who="generate")
    except Exception as e:
        engine.warm = Entry(None, report=dict(load=f"failed ({type(e).__name__}: {e})", loaded_by="generate"))
        warnings.warn(f"moecomp warm cache: could not look up compile artifacts: {type(e).__name__}: {e} "
                      f"(compiles from scratch; {ENV_SWITCH}=0 skips the lookup)", UserWarning, stacklevel=3)


def clear(cache_dir=None) -> list[str]:
    """Remove every entry and packed kernel under the cache directory (``resolve``'s rules); returns the
    directories removed."""
    root, _ = resolve(cache_dir)
    gone = []
    for sub in (SUBDIR, warm_triton.SUBDIR) if root else ():
        path = os.path.join(root, sub)
        if os.path.isdir(path):
            shutil.rmtree(path)
            gone.append(path)
    _restored.pop(root, None)
    return gone
