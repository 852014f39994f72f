"""Warm starts, part two: moecomp's own Triton kernels (the MoE op's, the decode attention's, the skinny linear's).

``torch.compiler.save_cache_artifacts`` carries what Inductor compiled, its own Triton kernels included, but not
the kernels moecomp's custom ops launch: Inductor sees those ops as opaque calls, and Triton JIT-compiles their
kernels on first use in each process, caching the binaries in its own directory (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), one subdirectory per compiled kernel. A fresh container has none, so ``optimize``'s checks and
the first ``generate`` would compile them all again. This module copies them::

    save     every kernel that a JIT function of a ``moecomp.*`` module compiled in this process (its
             ``device_caches``): the files of its Triton cache group -> <cache dir>/triton/<its directory name>/,
             with a manifest (file names, sha256, the group's metadata file); a directory already there is kept
    restore  each packed kernel whose files verify -> Triton's cache directory, files first, then the group file
             that names them (written with this machine's paths); a kernel already there is left alone

Validity is Triton's own: the directory name is the hash of the kernel's source, signature, constants, options,
target GPU and Triton version, so a kernel of another GPU or Triton simply never matches. A packed kernel that fails
its checksums is warned of (naming it and the error) and skipped: Triton compiles that one. With
``TRITON_INTERPRET=1`` (CPU) nothing is compiled and nothing is packed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
import warnings

SUBDIR = "triton"
MANIFEST = "moecomp-kernel.json"


def triton_root() -> tuple[str | None, str | None]:
    """(Triton's cache directory, None), or (None, why kernels cannot be restored / packed here)."""
    try:
        import triton
    except Exception as e:
        return None, f"no Triton ({type(e).__name__})"
    cache = getattr(getattr(triton, "knobs", None), "cache", None)
    if cache is not None:
        if getattr(cache, "manager_class", None) is not None:
            return None, "Triton uses a custom cache manager"
        d = getattr(cache, "dir", None)
        if d:
            return str(d), None
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache"), None


def _jit_functions(prefix: str):
    """The Triton JIT functions held by module globals of the loaded ``prefix*`` modules (wrappers unwrapped)."""
    seen = set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(prefix):
            continue
        for obj in list(vars(mod).values()):
            fn, depth = obj, 0
            while not hasattr(fn, "device_caches") and hasattr(fn, "fn") and depth < 4:  # autotune / heuristics
                fn, depth = fn.fn, depth + 1
            caches = getattr(fn, "device_caches", None)
            if isinstance(caches, dict) and id(fn) not in seen:
                seen.add(id(fn))
                yield fn


def compiled_kernels(prefix: str = "moecomp.") -> list:
    """Every kernel compiled in this process by a JIT function of a ``prefix*`` module, once per hash."""
    out = {}
    for fn in _jit_functions(prefix):
        for entry in list(fn.device_caches.values()):
            cache = entry[0] if isinstance(entry, tuple) and entry and isinstance(entry[0], dict) else None
            for k in list((cache or {}).values()):
                if getattr(k, "hash", None) and isinstance(getattr(k, "metadata_group", None), dict):
                    out.setdefault(k.hash, k)
    return list(out.values())


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _group(kernel) -> tuple[str, str, dict] | None:
    """(Triton's directory name of the kernel, its metadata file name, {file name: path}); None when not on disk."""
    files = dict(kernel.metadata_group)
    meta = next((c for c in files if c.endswith(".json")), None)
    if meta is None or not all(os.path.isfile(p) for p in files.values()):
        return None
    return os.path.basename(os.path.dirname(files[meta])), meta, files


def pack(root: str, prefix: str = "moecomp.") -> dict:
    """Copy this process's compiled kernels into ``<root>/triton`` (the module docstring); returns
    {"kernels": compiled in this process, "packed": new in the pack, "packed_bytes"}."""
    kernels = compiled_kernels(prefix)
    base = os.path.join(root, SUBDIR)
    packed = nbytes = 0
    for k in kernels:
        g = _group(k)
        if g is None:
            continue
        name, meta, files = g
        dst = os.path.join(base, name)
        if os.path.isfile(os.path.join(dst, MANIFEST)):
            continue
        tmp = os.path.join(base, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            for c, p in files.items():
                shutil.copyfile(p, os.path.join(tmp, c))
                nbytes += os.path.getsize(p)
            manifest = dict(meta=meta, kernel=getattr(k, "name", "?"), files={c: _sha(p) for c, p in files.items()})
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            try:
                os.rename(tmp, dst)
                packed += 1
            except OSError:  # another process packed it meanwhile
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dict(kernels=len(kernels), packed=packed, packed_bytes=nbytes)


def _restore_one(src: str, dst: str) -> bool:
    """One packed kernel into Triton's directory ``dst``; False when it is there already. ``ValueError`` for a
    packed kernel that does not verify."""
    with open(os.path.join(src, MANIFEST)) as f:
        manifest = json.load(f)
    files, meta = manifest["files"], manifest["meta"]
    if meta not in files:
        raise ValueError(f"the manifest's metadata file {meta!r} is not among its files")
    group = os.path.join(dst, f"__grp__{meta}")
    if os.path.isfile(group) and all(os.path.isfile(os.path.join(dst, c)) for c in files):
        return False
    for c, digest in files.items():
        if os.path.basename(c) != c:
            raise ValueError(f"file name {c!r} is not a plain name")
        if _sha(os.path.join(src, c)) != digest:
            raise ValueError(f"{c}: checksum mismatch")
    os.makedirs(dst, exist_ok=True)
    for c in files:  # the files first, the group that names them last (Triton reads a kernel through its group)
        tmp = os.path.join(dst, f".{c}.tmp-{os.getpid()}")
        shutil.copyfile(os.path.join(src, c), tmp)
        os.replace(tmp, os.path.join(dst, c))
    tmp = group + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"child_paths": {c: os.path.join(dst, c) for c in files}}, f)
    os.replace(tmp, group)
    return True


def restore(root: str) -> dict:
    """Every packed kernel under ``<root>/triton`` into Triton's cache directory (the module docstring); returns
    {"kernels": packed, "restored", "present", "ignored": [names], "restored_dirs": [names], "seconds"} or
    {"triton": "off (why)"}. Never raises; a kernel that does not verify is warned of and skipped."""
    t0 = time.perf_counter()
    troot, why = triton_root()
    if troot is None:
        return dict(triton=f"off ({why})")
    base = os.path.join(root, SUBDIR)
    try:
        names = sorted(n for n in os.listdir(base) if not n.startswith("."))
    except FileNotFoundError:
        names = []
    restored, present, ignored = [], 0, []
    for n in names:
        src = os.path.join(base, n)
        try:
            if _restore_one(src, os.path.join(troot, n)):
                restored.append(n)
            else:
                present += 1
        except Exception as e:
            ignored.append(n)
            warnings.warn(f"moecomp warm cache: ignored the packed Triton kernel {src}: {type(e).__name__}: {e} "
                          f"(Triton compiles it again)", UserWarning, stacklevel=3)
    return dict(kernels=len(names), restored=len(restored), present=present, ignored=ignored, restored_dirs=restored,
                seconds=time.perf_counter() - t0)
