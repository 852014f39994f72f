"""Warm starts (generate/warm_cache.py): compile artifacts saved by one process, loaded by a fresh one.

The fresh-process tests run tests/generate/warm_child.py with the engine compiling a tiny Qwen3-MoE on CPU with
Inductor (the real artifact path: Inductor's FX graph cache and AOTAutograd's cache). What they prove: the second
process starts with empty FX-graph and AOTAutograd caches, loads the entry, and every graph the first compiled is a
cache hit there (torch's counters), with the same tokens. What they do not: the time a GPU saves (Triton's
compiles, bundled in the artifacts on CUDA; benchmarks/bench_warmup.py measures that on the GPU). To keep them fast
the second process reuses the first one's Inductor directory minus ``fxgraph/`` and ``aotautograd/``: the C++
builds Inductor makes on CPU (not part of the artifacts) are found there instead of being rebuilt. Marked ``slow``:
the fixture's cold process takes 35-50 s on 2 cores, each later one 12-22 s.

The other tests run in this process on fakes of torch's save / load: the file format, the checks on reading, how
saves merge, the entry key and the arguments."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import moecomp
from moecomp.generate import attention, engine as E, warm_cache as W

from .models import build

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_child.py")


def _child(mode: str, inductor_dir: str, cache_dir: str | None = None, device: str = "cpu", **env) -> dict:
    e = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, TRITON_CACHE_DIR=inductor_dir + "-triton",
             MOECOMP_PROGRESS="0", **env)
    r = subprocess.run([sys.executable, CHILD, mode, cache_dir or "-", device], env=e, capture_output=True, text=True,
                       timeout=400)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"rc {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(lines[-1])


def _without_compile_caches(src: str, dst: str) -> str:
    """A copy of an Inductor cache directory without its FX-graph and AOTAutograd caches (see the module docstring)."""
    shutil.copytree(src, dst)
    for sub in ("fxgraph", "aotautograd"):
        shutil.rmtree(os.path.join(dst, sub), ignore_errors=True)
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A fresh process warms up with empty caches and saves its artifacts."""
    root = tmp_path_factory.mktemp("warm")
    a = _child("warmup", str(root / "inductor-a"), str(root / "warm"))
    return root, a


@pytest.mark.slow  # fresh processes compiling with Inductor on CPU (module docstring)
def test_cold_process_saves(saved):
    root, a = saved
    c = a["warmup"]["2"]["cache"]
    assert c["load"] == "miss" and c["save"] == "saved" and c["saved_bytes"] > 0, c
    assert a["layers"] == "compiled" and a["prefill_layers"] == "compiled", a
    compiled = a["counters"]["inductor"].get("fxgraph_cache_miss", 0)
    assert compiled > 0 and not a["counters"]["inductor"].get("fxgraph_cache_hit"), a["counters"]
    files = os.listdir(c["entry"])
    assert sorted(files) == sorted(["key.json", os.path.basename(c["file"])])
    key = json.load(open(os.path.join(c["entry"], "key.json")))
    assert key["versions"]["torch"] == torch.__version__ and key["backend"] == "inductor" and key["bound_blocks"] == 2


@pytest.mark.slow
def test_fresh_process_loads_and_compiles_nothing_new(saved, tmp_path):
    """moecomp.warmup in a fresh process whose FX-graph / AOTAutograd caches are empty: the entry loads ("hit"), every
    graph the first process compiled is a hit, none compiles, the save finds nothing new, and the tokens are the
    first process's."""
    root, a = saved
    b = _child("warmup", _without_compile_caches(str(root / "inductor-a"), str(tmp_path / "inductor-b")),
               str(root / "warm"))
    c = b["warmup"]["2"]["cache"]
    assert c["load"] == "hit" and c["loaded_bytes"] == a["warmup"]["2"]["cache"]["saved_bytes"], c
    assert c["artifacts"].get("inductor", 0) > 0 and c["save"].startswith("unchanged"), c
    ind_a, ind_b = a["counters"]["inductor"], b["counters"]["inductor"]
    assert ind_b.get("fxgraph_cache_hit") == ind_a["fxgraph_cache_miss"] and not ind_b.get("fxgraph_cache_miss"), \
        (ind_a, ind_b)
    aot_a, aot_b = a["counters"]["aot_autograd"], b["counters"]["aot_autograd"]
    assert aot_b.get("autograd_cache_hit") == aot_a["autograd_cache_saved"] > 0, (aot_a, aot_b)
    assert b["tokens"] == a["tokens"] and b["layers"] == "compiled" and b["prefill_layers"] == "compiled"
    assert b["warnings"] == []


@pytest.mark.slow
def test_plain_generate_loads_a_matching_entry(saved, tmp_path):
    """No warmup: the first generate() that compiles loads the entry found under $MOECOMP_CACHE_DIR by itself."""
    root, a = saved
    b = _child("plain", _without_compile_caches(str(root / "inductor-a"), str(tmp_path / "inductor-c")),
               MOECOMP_CACHE_DIR=str(root / "warm"), MOECOMP_WARM_CACHE="1")
    assert b["warm"]["load"] == "hit" and b["warm"]["loaded_by"] == "generate", b["warm"]
    ind = b["counters"]["inductor"]
    assert ind.get("fxgraph_cache_hit", 0) > 0 and not ind.get("fxgraph_cache_miss"), ind
    assert b["tokens"] == a["tokens"] and b["prefill_layers"] == "compiled"


@pytest.mark.slow
def test_corrupt_entry_is_reported_and_recompiled(saved, tmp_path):
    """A damaged file: a warning naming it and the exception, the graphs compile from scratch, the same tokens, and
    the warmup's save replaces the damaged file with a readable one."""
    root, a = saved
    warm = str(tmp_path / "warm")
    shutil.copytree(str(root / "warm"), warm)
    entry = os.path.join(warm, "compile", os.path.basename(a["warmup"]["2"]["cache"]["entry"]))
    bad = os.path.join(entry, os.path.basename(a["warmup"]["2"]["cache"]["file"]))
    data = bytearray(open(bad, "rb").read())
    data[-100] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    b = _child("warmup", _without_compile_caches(str(root / "inductor-a"), str(tmp_path / "inductor-d")), warm)
    c = b["warmup"]["2"]["cache"]
    assert c["load"] == "failed" and c["ignored"] == [os.path.basename(bad)], c
    assert len(b["warnings"]) == 1 and bad in b["warnings"][0] and "ValueError: payload checksum mismatch" in \
        b["warnings"][0], b["warnings"]
    assert b["counters"]["inductor"].get("fxgraph_cache_miss") == a["counters"]["inductor"]["fxgraph_cache_miss"]
    assert b["tokens"] == a["tokens"]
    assert c["save"] == "saved" and c["replaced"] == 1 and sorted(os.listdir(entry)) == sorted(
        ["key.json", os.path.basename(c["file"])]), (c, os.listdir(entry))
    payload, keys = W._read_segment(c["file"], os.path.basename(entry))
    assert len(payload) == c["saved_bytes"] and keys


# ------------------------------------------------------------------------------------------- in this process
class _Info:
    def __init__(self, keys):
        self.artifacts = {}
        for k in keys:
            t, _, name = k.partition(":")
            self.artifacts.setdefault(t, []).append(name)


@pytest.fixture
def fake_torch(monkeypatch):
    """torch.compiler's save / load replaced: ``state["have"]`` the artifact keys this process holds; a blob is
    their JSON list; loading one records what it held in ``state["loaded"]``."""
    state = {"have": [], "loaded": []}

    def save():
        return (json.dumps(state["have"]).encode(), _Info(state["have"])) if state["have"] else None

    def load(blob):
        keys = json.loads(blob.decode())
        state["loaded"].append(keys)
        return _Info(keys)

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return state


def _engine():
    eng = E.Engine(build("qwen3_moe"))
    eng.compile_backend = "inductor"
    return eng


def test_saves_merge_by_artifact_keys(fake_torch, tmp_path):
    """A save holding nothing new keeps the files; one holding every artifact of the files it read replaces them;
    one holding other artifacts (another process warmed other sizes) is one more file, and a load reads them all."""
    d = str(tmp_path)
    e1 = _engine()
    assert W.load(e1, d)["load"] == "miss"
    assert W.save(e1)["save"].startswith("nothing to save")
    fake_torch["have"] = ["inductor:a", "inductor:b"]
    first = W.save(e1)
    assert first["save"] == "saved" and first["files"] == 1
    fake_torch["have"] = ["inductor:a", "inductor:b", "aot_autograd:c"]
    second = W.save(e1)  # a superset of its own earlier file: that one goes
    assert second["replaced"] == 1 and not os.path.exists(first["file"]) and second["files"] == 1

    e2 = _engine()
    r = W.load(e2, d)
    assert r["load"] == "hit" and r["artifacts"] == {"inductor": 2, "aot_autograd": 1}, r
    fake_torch["have"] = ["inductor:a"]
    assert W.save(e2)["save"].startswith("unchanged")
    fake_torch["have"] = ["inductor:a", "inductor:d"]
    third = W.save(e2)
    assert third["save"] == "saved" and third["replaced"] == 0 and third["files"] == 2

    fake_torch["loaded"] = []
    r3 = W.load(_engine(), d)
    assert r3["load"] == "hit" and sorted(map(sorted, fake_torch["loaded"])) == sorted(
        [["aot_autograd:c", "inductor:a", "inductor:b"], ["inductor:a", "inductor:d"]])
    assert r3["artifacts"] == {"inductor": 3, "aot_autograd": 1}
    assert W.clear(d) == [os.path.join(d, "compile")] and not os.path.exists(os.path.join(d, "compile"))


def test_unreadable_files_are_warned_of_and_ignored(fake_torch, tmp_path, monkeypatch):
    """Every way a file can be wrong gives a warning naming it and the exception, and the load goes on."""
    d = str(tmp_path)
    e = _engine()
    W.load(e, d)
    fake_torch["have"] = ["inductor:a"]
    good = W.save(e)["file"]
    entry = os.path.dirname(good)
    key = os.path.basename(entry)
    blob = open(good, "rb").read()
    cases = {"bad-magic.bin": (b"not ours" + blob, "bad magic line"),
             "truncated.bin": (W.MAGIC + b'{"key": ', "truncated header"),
             "other-key.bin": (blob.replace(key.encode(), b"0" * len(key), 1), "made for entry"),
             "short.bin": (blob[:-3], "the header says")}
    for name, (data, _) in cases.items():
        open(os.path.join(entry, name), "wb").write(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = W.load(_engine(), d)
    msgs = [str(w.message) for w in caught if "moecomp warm cache" in str(w.message)]
    assert r["load"] == "hit" and sorted(r["ignored"]) == sorted(cases), r
    for name, (_, why) in cases.items():
        assert any(os.path.join(entry, name) in m and why in m for m in msgs), (name, msgs)

    # a file that passes moecomp's checks but torch cannot read (load_cache_artifacts gives None)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: None)
    for name in cases:
        os.unlink(os.path.join(entry, name))
    with pytest.warns(UserWarning, match="torch could not read the artifacts"):
        r = W.load(_engine(), d)
    assert r["load"] == "failed" and r["ignored"] == [os.path.basename(good)]


def test_entry_key_ignores_weights_and_names_not_structure():
    """The key: the same for other weights or another checkpoint name, and inside the decode step's attention swap;
    another for another dtype, config field, compile backend, or once blocks are bound."""
    dev = torch.device("cpu")
    base = W.entry_key(W.key_fields(build("qwen3_moe", seed=0), "inductor", dev))
    other = build("qwen3_moe", seed=1)
    other.config._name_or_path = "somewhere/else"
    assert W.entry_key(W.key_fields(other, "inductor", dev)) == base
    assert W.entry_key(W.key_fields(build("qwen3_moe", dtype=torch.bfloat16), "inductor", dev)) != base
    assert W.entry_key(W.key_fields(build("qwen3_moe", num_experts=6), "inductor", dev)) != base
    assert W.entry_key(W.key_fields(build("qwen3_moe"), "aot_eager", dev)) != base
    m = build("qwen3_moe")
    moecomp.optimize(m)
    f = W.key_fields(m, "inductor", dev)
    assert f["bound_blocks"] == 2 and W.entry_key(f) != base
    eng = E.Engine(m)
    eng._probe()  # inside the decode step (the first compile of a plain generate()) the same key
    assert eng.attn_pairs
    with attention.Swapped(eng.attn_pairs, None):
        assert m.config._attn_implementation != "sdpa" and W.key_fields(m, "inductor", dev) == f


def test_switches_and_bad_arguments(tmp_path, monkeypatch):
    """MOECOMP_WARM_CACHE=0 turns the default off (generate's lookup too), an explicit directory still wins;
    MOECOMP_CACHE_DIR moves the default; bad cache_dir values are ValueErrors naming the argument."""
    monkeypatch.setenv("MOECOMP_WARM_CACHE", "0")
    assert W.resolve(None) == (None, "off (MOECOMP_WARM_CACHE=0)")
    assert W.resolve(str(tmp_path)) == (str(tmp_path), None)
    e = _engine()
    W.before_compile(e)
    assert e.warm.root is None and e.warm.report["load"] == "off (MOECOMP_WARM_CACHE=0)"
    monkeypatch.setenv("MOECOMP_WARM_CACHE", "1")
    monkeypatch.setenv("MOECOMP_CACHE_DIR", str(tmp_path / "here"))
    assert W.resolve(None) == (str(tmp_path / "here"), None)
    assert W.resolve(False) == (None, "off (cache_dir=False)")
    ref = build("qwen3_moe")
    moecomp.optimize(ref)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for bad in (123, "", True, str(a_file)):
        with pytest.raises(ValueError, match="cache_dir"):
            moecomp.warmup(ref, batch_sizes=[1], max_length=32, prompt_length=4, cache_dir=bad)


def test_bench_warmup_children_share_what_each_row_says():
    """benchmarks/bench_warmup.py's three children: warm reuses cold's Inductor / Triton caches with the artifact cache
    off; artifacts gets new empty ones and cold's artifact cache; only cold saves."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                        "bench_warmup.py")
    spec = importlib.util.spec_from_file_location("bench_warmup_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kids = {state: (env, extra) for state, env, extra in bench.children()}
    assert list(kids) == ["cold", "warm", "artifacts"]
    (cold, cx), (warm, wx), (art, ax) = kids["cold"], kids["warm"], kids["artifacts"]
    assert cx == ["--save"] and wx == ax == []
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert warm[k] == cold[k] and art[k] != cold[k] and not os.path.exists(art[k])
    assert cold["MOECOMP_CACHE_DIR"] == warm["MOECOMP_CACHE_DIR"] == art["MOECOMP_CACHE_DIR"]
    assert (cold["MOECOMP_WARM_CACHE"], warm["MOECOMP_WARM_CACHE"], art["MOECOMP_WARM_CACHE"]) == ("1", "0", "1")
    for env in (cold, art):
        shutil.rmtree(os.path.dirname(env["TORCHINDUCTOR_CACHE_DIR"]), ignore_errors=True)


# ------------------------------------------------------------------------------------------- Triton kernels
class _Kernel:
    def __init__(self, hash_, name, files):
        self.hash, self.name, self.metadata_group = hash_, name, files


class _Jit:
    def __init__(self, kernels):
        self.device_caches = {0: ({f"key{i}": k for i, k in enumerate(kernels)}, None, None, None, None)}


class _Wrapped:  # what triton.autotune / triton.heuristics return: the JIT function under .fn
    def __init__(self, fn):
        self.fn = fn


def _triton_kernel_on_disk(root: str, dirname: str, name: str) -> _Kernel:
    """A kernel as Triton's file cache holds it: <root>/<dirname>/{name}.json, {name}.cubin and the group file."""
    d = os.path.join(root, dirname)
    os.makedirs(d)
    files = {f"{name}.json": os.path.join(d, f"{name}.json"), f"{name}.cubin": os.path.join(d, f"{name}.cubin")}
    open(files[f"{name}.json"], "w").write(json.dumps({"name": name}))
    open(files[f"{name}.cubin"], "wb").write(os.urandom(64))
    open(os.path.join(d, f"__grp__{name}.json"), "w").write(json.dumps({"child_paths": files}))
    return _Kernel(dirname.lower(), name, files)


def test_triton_kernels_packed_and_restored(tmp_path, monkeypatch):
    """moecomp's compiled Triton kernels (JIT functions of moecomp.* modules, wrappers unwrapped) are packed with their
    files; restored into another Triton cache directory, Triton's own FileCacheManager finds each group there with
    this directory's paths (what its compile() takes for a cache hit); a second restore finds them present; a packed
    file that does not verify is warned of and skipped."""
    from triton.runtime.cache import FileCacheManager

    from moecomp.generate import warm_triton as T

    src = str(tmp_path / "triton-a")
    k1 = _triton_kernel_on_disk(src, "AAAA", "moe_kernel")
    k2 = _triton_kernel_on_disk(src, "BBBB", "attn_kernel")
    gone = _Kernel("cccc", "gone", {"gone.json": str(tmp_path / "nowhere.json")})  # files not on disk: not packed
    fake = type(sys)("moecomp._warm_test_kernels")
    fake.k1, fake.k2 = _Jit([k1, gone]), _Wrapped(_Jit([k2]))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    assert {k.hash for k in T.compiled_kernels()} >= {"aaaa", "bbbb", "cccc"}
    root = str(tmp_path / "warm")
    p = T.pack(root)
    assert p["packed"] == 2 and p["packed_bytes"] > 0, p
    assert T.pack(root)["packed"] == 0  # already there
    assert sorted(os.listdir(os.path.join(root, "triton"))) == ["AAAA", "BBBB"]

    dst = str(tmp_path / "triton-b")
    monkeypatch.setenv("TRITON_CACHE_DIR", dst)
    r = T.restore(root)
    assert r["restored"] == 2 and r["ignored"] == [] and sorted(r["restored_dirs"]) == ["AAAA", "BBBB"], r
    for d, k in (("AAAA", k1), ("BBBB", k2)):
        grp = FileCacheManager(d).get_group(f"{k.name}.json")
        assert grp is not None and all(p.startswith(os.path.join(dst, d)) for p in grp.values()), grp
        for c, path in grp.items():
            assert open(path, "rb").read() == open(k.metadata_group[c], "rb").read()
    assert T.restore(root)["present"] == 2

    cubin = os.path.join(root, "triton", "AAAA", "moe_kernel.cubin")
    open(cubin, "wb").write(b"damaged")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-c"))
    with pytest.warns(UserWarning, match="AAAA: .*moe_kernel.cubin: checksum mismatch"):
        r = T.restore(root)
    assert r["restored"] == 1 and r["ignored"] == ["AAAA"], r
    assert not os.path.exists(str(tmp_path / "triton-c" / "AAAA"))
    assert W.clear(root) == [os.path.join(root, "triton")] and not os.path.exists(os.path.join(root, "triton"))


def test_a_model_without_a_key_is_reported_not_fatal(tmp_path, monkeypatch):
    """A model whose entry key cannot be computed (a config that does not serialize): warmup's load says "failed"
    with the exception and warns, and nothing is saved; the engine goes on."""
    e = _engine()

    def broken():
        raise TypeError("config does not serialize")

    monkeypatch.setattr(e.model.config, "to_dict", broken)
    with pytest.warns(UserWarning, match="no entry key for this model: TypeError: config does not serialize"):
        r = W.load(e, str(tmp_path))
    assert r["load"] == "failed (TypeError: config does not serialize)" and W.save(e)["save"] == "off"
    assert not os.listdir(tmp_path)
