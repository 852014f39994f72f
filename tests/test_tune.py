"""``python -m moecomp tune``: a tiny tune under the Triton interpreter writes a table the run-time lookup reads;
reruns resume (no timing) and ``--restart`` redoes; other shapes' entries stay; an interrupted run leaves a valid
file; without CUDA (and without ``--interpret``) it refuses. One GPU test tunes a small shape for real."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moecomp import cli
from moecomp.cli import tune, tune_io
from moecomp.ops import tuning

E, I, H, K = tune.INTERPRET_SHAPE
KEY = tuning.shape_key(E, I, H, torch.float32)
ARGS = ["--interpret", "--shape", f"{E},{I},{H},{K}", "--tokens", "1,16"]
interpreted = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="--interpret tests run where the kernels are interpreted (no CUDA)")


@pytest.fixture
def lookup_dir(tmp_path, monkeypatch):
    """The run-time lookup reads its tables from tmp_path while the test runs."""
    monkeypatch.delenv("MOECOMP_CONFIG", raising=False)
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning._table.cache_clear()
    yield tmp_path
    tuning._table.cache_clear()


_RUNS: dict = {}  # the interpreted candidate runs of the fake-timer tests, shared by them (see bench_calls)


def _run_key(fn, label):
    """What a candidate run computes: its label (bucket, BLOCK_M, GEMM, tiles), the code and defaults of its closure
    (the config), the shape and dtype of every tensor it reads. The tunes draw the same seeded inputs for a bucket
    every time, so equal keys compute equal outputs."""
    def part(v):
        if torch.is_tensor(v):  # (not its values: padding rows are never written)
            return ("t", tuple(v.shape), str(v.dtype))
        if isinstance(v, dict):  # (timings, floats, change with the fake timer: not what a run computes)
            return tuple(sorted((k, part(x)) for k, x in v.items() if not isinstance(x, float)))
        if isinstance(v, (list, tuple)):
            return tuple(part(x) for x in v)
        return repr(v)
    cells = tuple(part(c.cell_contents) for c in (fn.__closure__ or ()))
    return label, fn.__code__.co_firstlineno, part(fn.__defaults__ or ()), cells


@pytest.fixture
def bench_calls(monkeypatch):
    """Count the timing calls (and time nothing). The candidates still run, for the correctness check, but each
    distinct run once for all the fake-timer tests (``_RUNS``): the runs under the interpreter are what these tests
    would otherwise spend their time on, and the flow they check (resume, restart, budget, kept entries) is the
    same."""
    calls = []
    real = tune._run_checked

    def fake(fn, rep_ms, device):
        calls.append(fn)
        return 1.0 + 0.01 * len(calls)

    def run_once(fn, ref_out, label, note, device, rows=None, norm=None):
        key = (_run_key(fn, label), rows is None, norm is None)
        if key not in _RUNS:
            _RUNS[key] = real(fn, ref_out, label, note, device, rows, norm)
        return _RUNS[key]

    from moecomp.ops import triton_moe

    real_routed = triton_moe.routed

    def routed_once(x, ids, weights, named, spec, out, cfg=None):  # the decode-vs-aligned check at each probe
        key = ("routed", tuple(x.shape), spec.key, repr(cfg))
        if key not in _RUNS:
            _RUNS[key] = real_routed(x, ids, weights, named, spec, out, cfg=cfg).clone()
        return _RUNS[key]

    monkeypatch.setattr(tune_io, "bench", fake)
    monkeypatch.setattr(tune, "_run_checked", run_once)
    monkeypatch.setattr(triton_moe, "routed", routed_once)
    return calls


def _load(path):
    with open(path) as f:
        return json.load(f)


@interpreted
def test_tiny_tune_table_is_looked_up(lookup_dir, capsys):
    out = lookup_dir / "cpu.json"
    assert cli.main(["tune", *ARGS, "--out", str(out)]) == 0  # the real (wall-clock) timer
    table = _load(out)
    assert set(table) == {KEY} and set(table[KEY]) == {"1", "16"}
    tiles = {w: {(bn, bk, nw, ns) for bn, bk, nw, ns in tune.INTERPRET_TILES[w]} for w in ("g1", "g2")}
    for T, bucket in ((1, "1"), (5, "1"), (16, "16"), (1000, "16")):
        cfg = tuning.get_config(E, I, H, T, K, torch.float32, torch.device("cpu"))
        assert cfg == table[KEY][bucket]
        assert cfg["BLOCK_M"] in tune.block_ms(int(bucket), K, E)
        for w in ("g1", "g2"):
            c = cfg[w]
            assert (c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]) in tiles[w]
    meta = _load(lookup_dir / "cpu.meta.json")[KEY]
    dec_tiles = {w: {t[:4] for t in tune.INTERPRET_DECODE_TILES[w]} for w in ("g1", "g2")}
    for bucket, probes in (("1", [1, 2, 4, 8]), ("16", [16, 32, 64])):  # T, 2T, 4T, 8T below the next bucket / 64
        dec = table[KEY][bucket]["decode"]
        measured = [int(t) for t in meta[bucket]["decode_ms"]]
        assert measured == probes[:len(measured)] and measured, "probes in order, stopping at the first loss"
        assert dec["max_t"] in [0] + measured
        for w in ("g1", "g2"):
            c, c0 = dec[w], table[KEY][bucket][w]  # a decode candidate, or the aligned winner (as DIRECT)
            own = (c0["BLOCK_N"], c0["BLOCK_K"], c0["num_warps"], c0["num_stages"])
            assert (c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]) in dec_tiles[w] | {own}
        T = max(int(bucket), dec["max_t"])  # the bucket's largest decode size, or its first size
        want = dec if T <= dec["max_t"] else None
        assert tuning.decode_config(tuning.get_config(E, I, H, T, K, torch.float32, torch.device("cpu")), T,
                                    torch.device("cpu")) == want
    for bucket in ("1", "16"):
        m = meta[bucket]
        assert m["ms"] > 0 and m["ms"] == pytest.approx(m["align_ms"] + m["g1_ms"] + m["g2_ms"])
        assert m["torch"] == torch.__version__ and m["interpret"] is True and m["date"] and "triton" in m
    err = capsys.readouterr().err
    assert "[tune] 2/2" in err and "wrote" in err


@interpreted
def test_resume_skips_and_restart_redoes(tmp_path, bench_calls, capsys):
    out = str(tmp_path / "cpu.json")
    assert tune.main([*ARGS, "--out", out]) == 0
    first = len(bench_calls)
    assert first > 0
    before = _load(out)
    assert tune.main([*ARGS, "--out", out]) == 0  # same arguments: nothing left to measure
    assert len(bench_calls) == first
    assert "all entries skipped" in capsys.readouterr().err
    assert _load(out) == before
    assert tune.main([*ARGS, "--out", out, "--restart"]) == 0
    assert len(bench_calls) == 2 * first
    assert tune.main([*ARGS, "--tokens", "1,16,64", "--out", out]) == 0  # only the new bucket is measured
    per_bm = 5  # align, 2 gemm1 candidates, 2 gemm2 candidates
    # decode (buckets 1 and 16): 2 + 2 tile candidates (the aligned winners, the first tiles under the fake timer,
    # are among them), then decode and aligned at each probe (1, 2, 4, 8 and 16,
    # 32, 64; the fake timer ranks the decode path, timed first, ahead at every one)
    decode = (4 + 2 * 4) + (4 + 2 * 3)
    assert first == per_bm * (len(tune.block_ms(1, K, E)) + len(tune.block_ms(16, K, E))) + decode
    assert len(bench_calls) - 2 * first == per_bm * len(tune.block_ms(64, K, E))  # 64: no decode path measured
    assert set(_load(out)[KEY]) == {"1", "16", "64"}


@interpreted
def test_other_entries_are_kept(tmp_path, bench_calls):
    out = tmp_path / "cpu.json"
    other = {"E=8,N=64,K=64,dtype=float32": {"1": {"BLOCK_M": 16, "g1": {"BLOCK_N": 32}, "g2": {"BLOCK_N": 64}}},
             KEY: {"4096": {"BLOCK_M": 64, "g1": {"BLOCK_N": 64}, "g2": {"BLOCK_N": 128}}}}
    out.write_text(json.dumps(other))
    (tmp_path / "cpu.meta.json").write_text(json.dumps({"E=8,N=64,K=64,dtype=float32": {"1": {"ms": 0.5}}}))
    assert tune.main([*ARGS, "--out", str(out)]) == 0
    table = _load(out)
    assert table["E=8,N=64,K=64,dtype=float32"] == other["E=8,N=64,K=64,dtype=float32"]
    assert set(table[KEY]) == {"1", "16", "4096"} and table[KEY]["4096"] == other[KEY]["4096"]
    assert _load(tmp_path / "cpu.meta.json")["E=8,N=64,K=64,dtype=float32"] == {"1": {"ms": 0.5}}


@interpreted
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_run_leaves_a_valid_file(tmp_path, monkeypatch, exc, capsys):
    out = tmp_path / "cpu.json"
    saves, real_save = [], tune.save_entry

    def save(*a, **kw):
        real_save(*a, **kw)
        saves.append(a)

    def bench(fn, rep_ms, device):
        if saves:  # the first bucket is saved: stop in the middle of the second
            raise exc("stop")
        return 1.0

    monkeypatch.setattr(tune, "save_entry", save)
    monkeypatch.setattr(tune_io, "bench", bench)
    if exc is KeyboardInterrupt:  # Ctrl-C: a message and exit status 130
        assert tune.main([*ARGS, "--out", str(out)]) == tune.EXIT_INTERRUPTED
        assert "rerun the same command to resume" in capsys.readouterr().err
    else:
        with pytest.raises(RuntimeError):
            tune.main([*ARGS, "--out", str(out)])
    assert set(_load(out)[KEY]) == {"1"} and set(_load(tmp_path / "cpu.meta.json")[KEY]) == {"1"}
    assert sorted(os.listdir(tmp_path)) == ["cpu.json", "cpu.meta.json"]  # no temporary file left


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    tune.write_json_atomic(str(path), {"a": {"1": {"BLOCK_M": 16}}})

    def broken_dump(obj, f, **kw):
        f.write('{"a": {"1": ')  # half a table, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(KeyboardInterrupt):
        tune.write_json_atomic(str(path), {"b": {}})
    monkeypatch.undo()
    assert _load(path) == {"a": {"1": {"BLOCK_M": 16}}}
    assert os.listdir(tmp_path) == ["t.json"]


def test_refuses_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--out", str(tmp_path / "x.json")]) == tune.EXIT_REFUSED
    assert "--interpret" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@interpreted
def test_interpret_needs_out():
    with pytest.raises(SystemExit, match="--out"):  # never the package's configs/cpu.json, which CPU runs read
        tune.main(["--interpret"])


def test_help_mentions_tests_only(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--interpret" in text and "TESTS ONLY" in text and "--restart" in text and "--budget-s" in text


@interpreted
def test_budget_stops_between_entries(tmp_path, bench_calls, capsys):
    out = str(tmp_path / "cpu.json")
    assert tune.main([*ARGS, "--out", out, "--budget-s", "0"]) == tune.EXIT_BUDGET  # the first entry, then stop
    assert set(_load(out)[KEY]) == {"1"} and "1 entries left" in capsys.readouterr().err
    assert tune.main([*ARGS, "--out", out, "--budget-s", "0"]) == 0  # the rerun finishes it
    assert set(_load(out)[KEY]) == {"1", "16"}


def test_progress_line_on_a_terminal():
    import io

    s = io.StringIO()
    p = tune.Progress(4, stream=s, tty=True)
    p.start("E=4,N=32,K=32 float32 T=1")
    p.status("BM=16 g1 1/2")
    p.finished("E=4,N=32,K=32 float32 T=1: 1.0 us", 2.0)
    p.start("E=4,N=32,K=32 float32 T=16")
    p.status("BM=16 g2 2/2")
    p.close()
    text = s.getvalue()
    assert "\r[tune] 0/4 shapes x buckets  ETA ?" in text and "\r[tune] 1/4 shapes x buckets  ETA " in text
    assert "[tune] 1/4 E=4,N=32,K=32 float32 T=1: 1.0 us\n" in text
    q = io.StringIO()
    p = tune.Progress(4, stream=q, tty=False)
    p.start("x")
    p.status("BM=16 g1 1/2")
    p.finished("x: 1.0 us", 1.0)
    assert q.getvalue() == "[tune] 1/4 x: 1.0 us\n"  # not a terminal: one line per finished bucket


@pytest.mark.gpu
def test_gpu_tune_small_shape(lookup_dir):
    out = lookup_dir / f"{tuning.device_key(torch.device('cuda'))}.json"
    assert tune.main(["--shape", "8,128,256,2", "--tokens", "1,64", "--out", str(out), "--rep", "5"]) == 0
    cfg = tuning.get_config(8, 128, 256, 100, 2, torch.bfloat16, torch.device("cuda"))
    assert cfg == _load(out)[tuning.shape_key(8, 128, 256, torch.bfloat16)]["64"]


def test_decode_probes():
    assert tune.decode_probes(1, [1, 16, 128]) == [1, 2, 4, 8]
    assert tune.decode_probes(16, [1, 16, 128]) == [16, 32, 64]  # below the next bucket and up to 64
    assert tune.decode_probes(4, [1, 4, 8]) == [4]
    assert tune.decode_probes(64, [1, 64]) == [] and tune.decode_probes(128, [128]) == []


def test_fp16_reads_the_bf16_table_and_decode_limits(lookup_dir, monkeypatch):
    """fp16 has bf16's element size and tensor-core rate: without an fp16 entry it takes the bf16 tiles (an fp32 or
    another shape does not). A decode entry decides the decode path up to its max_t, MOECOMP_DECODE_MAX_T overrides."""
    dev = torch.device("cpu")
    entry = {"BLOCK_M": 32, "g1": {"BLOCK_N": 64}, "g2": {"BLOCK_N": 128},
             "decode": {"max_t": 3, "g1": {"BLOCK_N": 16}, "g2": {"BLOCK_N": 32, "mode": "pairs"}}}
    (lookup_dir / "cpu.json").write_text(json.dumps({tuning.shape_key(8, 64, 32, torch.bfloat16): {"1": entry}}))
    tuning._table.cache_clear()
    assert tuning.get_config(8, 64, 32, 2, 2, torch.float16, dev) == entry
    assert tuning.get_config(8, 64, 32, 2, 2, torch.float32, dev) != entry
    assert tuning.get_config(8, 64, 64, 2, 2, torch.float16, dev) != entry
    assert tuning.decode_config(entry, 3, dev) == entry["decode"] and tuning.decode_config(entry, 4, dev) is None
    assert tuning.decode_config({"BLOCK_M": 16, "decode": {"max_t": 0}}, 1, dev) is None  # tuned: never
    monkeypatch.setenv("MOECOMP_DECODE_MAX_T", "0")
    assert tuning.decode_config(entry, 1, dev) is None


def test_forced_decode_on_an_entry_without_tiles(monkeypatch):
    """MOECOMP_DECODE_MAX_T forces the decode path on where the tuner said never ({"max_t": 0}, no tiles): the
    heuristic's tiles are used, not a KeyError."""
    monkeypatch.setenv("MOECOMP_DECODE_MAX_T", "4")
    dec = tuning.decode_config({"BLOCK_M": 16, "decode": {"max_t": 0}}, 3, torch.device("cpu"))
    assert dec is not None and {"g1", "g2"} <= set(dec) and dec["g2"]["mode"] in ("fused", "pairs")


@pytest.mark.parametrize("which", ["g1", "g2"])
def test_tma_tiles_only_where_they_apply(which):
    """TMA tiles are candidates from BLOCK_M 64 in 16-bit dtypes, and become ``"tma": 1`` configs; gemm1's "tma_a"
    tiles also set ``"tma_a": 1`` (x gathered and read by TMA). gemm2 has no "tma_a" form."""
    tma = [t for t in tune.TILES[which] if len(t) == 5]
    kinds = {"g1": {"tma", "tma_a"}, "g2": {"tma"}}[which]
    assert tma and {t[4] for t in tma} == kinds
    assert set(tma) <= set(tune._tiles_for(tune.TILES[which], 64, torch.bfloat16))
    assert set(tma) <= set(tune._tiles_for(tune.TILES[which], 128, torch.float16))
    assert not set(tma) & set(tune._tiles_for(tune.TILES[which], 32, torch.bfloat16))
    assert not set(tma) & set(tune._tiles_for(tune.TILES[which], 128, torch.float32))
    for t in tma:
        c = tune._config(t, 128)
        assert c["tma"] == 1 and tune._tile(c).endswith("/" + t[4])
        assert c.get("tma_a", 0) == (t[4] == "tma_a")
    assert "tma" not in tune._config(tune.TILES[which][0], 128)
    fp8_tma = [t for t in tune.FP8_TILES[which] if len(t) == 5 and t[4] != "gluon"]  # fp8 weights: under prequant
    assert fp8_tma and set(fp8_tma) <= set(tune._tiles_for(tune.FP8_TILES[which], 64, torch.bfloat16, True, True))
    assert not set(fp8_tma) & set(tune._tiles_for(tune.FP8_TILES[which], 128, torch.bfloat16, True, False))
    two = [t for t in fp8_tma if t[4].endswith("@2")]  # two persistent programs per SM
    assert two and all(tune._config(t, 64)["per_sm"] == 2 and tune._tile(tune._config(t, 64)).endswith("@2")
                       for t in two)
    assert all("per_sm" not in tune._config(t, 64) for t in fp8_tma if "@" not in t[4])


@pytest.mark.parametrize("which", ["g1", "g2"])
def test_gluon_tiles_only_for_fp8_where_the_device_runs_them(which, monkeypatch):
    """The "gluon" candidate (the Gluon FP8 GEMMs): one per GEMM in the FP8 tiles, none in the 16-bit ones; offered
    only for fp8 weights under prequant from BLOCK_M 64 and where ``gluon`` says the device runs them (compute
    capability 9.x, a Gluon with the kernels' names: never on this CPU); its config is a TMA one with "gluon": 1."""
    from moecomp.ops import triton_fp8_gluon

    gl = [t for t in tune.FP8_TILES[which] if len(t) == 5 and t[4] == "gluon"]
    assert len(gl) == 1 and not [t for t in tune.TILES[which] if len(t) == 5 and t[4] == "gluon"]
    on = tune._tiles_for(tune.FP8_TILES[which], 64, torch.bfloat16, True, True, gluon=True)
    assert gl[0] in on and gl[0] not in tune._tiles_for(tune.FP8_TILES[which], 64, torch.bfloat16, True, True)
    assert gl[0] not in tune._tiles_for(tune.FP8_TILES[which], 32, torch.bfloat16, True, True, gluon=True)
    assert gl[0] not in tune._tiles_for(tune.FP8_TILES[which], 128, torch.bfloat16, True, False, gluon=True)
    assert gl[0] not in tune._tiles_for(tune.FP8_TILES[which], 128, torch.bfloat16, False, True, gluon=True)
    c = tune._config(gl[0], 128)
    assert c["tma"] == 1 and c["gluon"] == 1 and "tma_a" not in c and tune._tile(c).endswith("/gluon")
    assert not tune.gluon_tiles_ok(torch.device("cpu"))
    monkeypatch.setattr(triton_fp8_gluon, "gluon_api", lambda gemm1=False: "hopper.tma: missing")
    assert not tune.gluon_tiles_ok(torch.device("cpu"))


@pytest.mark.parametrize("major,kept", [(8, ()), (9, ("tma", "gluon")), (10, ("tma",))])
def test_borrowed_config_keeps_gluon_on_hopper_only(major, kept, monkeypatch):
    """A nearest-entry config borrowed on another GPU: "gluon" (wgmma) is kept on compute capability 9.x only, the TMA
    keys from 9 up (``tuning_nearest._fit_device``)."""
    from moecomp.ops import tuning_nearest

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    cfg = dict(BLOCK_M=128, g1=dict(BLOCK_N=128, tma=1, gluon=1), g2=dict(BLOCK_N=128, tma=1, per_sm=2, gluon=1))
    out = tuning_nearest._fit_device(cfg, torch.device("cuda", 0))
    for g in ("g1", "g2"):
        assert {k for k in ("tma", "gluon") if k in out[g]} == set(kept), (major, out)
    assert tuning_nearest._fit_device(dict(g1=dict(gluon=1)), torch.device("cpu")) == dict(g1=dict(gluon=1))


@pytest.mark.parametrize("path", sorted(p.name for p in tuning.CONFIG_DIR.glob("*.json") if ".meta." not in p.name))
def test_shipped_tables_are_well_formed(path):
    """Every shipped table entry is a config the launchers take: the GEMM keys (and the TMA switches), BLOCK_M a power
    of two >= 16, decode entries with a token limit (and tiles, unless never)."""
    table = json.loads((tuning.CONFIG_DIR / path).read_text())
    keys = {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
    for shape, buckets in table.items():
        for bucket, cfg in buckets.items():
            where = f"{path} {shape} bucket {bucket}"
            assert int(bucket) >= 1 and cfg["BLOCK_M"] in (16, 32, 64, 128), where
            assert keys <= set(cfg["g1"]) and set(cfg["g1"]) <= keys | {"tma", "tma_a", "ws", "per_sm", "gluon"}, where
            assert keys <= set(cfg["g2"]) and set(cfg["g2"]) <= keys | {"tma", "ws", "per_sm", "gluon"}, where
            for g in ("g1", "g2"):  # the Gluon FP8 GEMMs: on the TMA path, fp8 shapes only
                assert "gluon" not in cfg[g] or cfg[g].get("tma") and "fp8" in shape, where
            for g in ("g1", "g2"):  # programs per SM: the persistent (TMA) kernels only
                assert cfg[g].get("per_sm", 1) in (1, 2) and ("per_sm" not in cfg[g] or cfg[g].get("tma")), where
            dec = cfg.get("decode")
            if dec is not None:
                assert dec["max_t"] >= 0 and (dec["max_t"] == 0 or {"g1", "g2"} <= set(dec)), where
