"""How the Triton launcher picks block configs and TMA loads (no kernel is compiled).

``_triton_launch.launch`` is driven with a recording stand-in kernel and the GPU branch forced on
(``is_interpreted`` patched to False), so the candidate lists, their order, the
``TORCHFN_TRITON_TMA`` modes, the untimed overlap and warp-specialized variants and
explicit configs are checked on a CPU. That the kernels give the same result with
either kind of load and with or without their variants is the job of
``test_triton_kernels`` (interpreter) and the gpu-marked tests.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from torchfn.kernels import _triton_configs as C  # noqa: E402
from torchfn.kernels import _triton_launch as T  # noqa: E402
from torchfn.kernels._triton_configs import Config  # noqa: E402


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: records each launch's config."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, BLOCK_N, num_warps=None, num_stages=None, **kw):
            overlap = kw.get("PIPELINE", False) or kw.get("EARLY_DP", False)
            self.launches.append(Config(BLOCK_M, BLOCK_N, num_warps, num_stages,
                                        kw.get("USE_TMA", False), overlap,
                                        kw.get("WARP_SPEC", False)))

        return launch


@pytest.fixture
def gpu_branch(monkeypatch):
    """Run ``launch``'s GPU branch with a recorded tuner (first-is-fastest by default)."""
    monkeypatch.setattr(T, "is_interpreted", lambda: False)
    monkeypatch.setattr(T, "_TUNED", {})
    monkeypatch.setenv("TORCHFN_TRITON_TUNE_CACHE", "0")  # (test_tune_cache covers it)
    seen = {}

    def tune(run, cands, *rest):
        seen["cands"] = list(cands)
        return cands[0]

    monkeypatch.setattr(T, "tune", tune)
    return seen


def _launch(kind, dtype, block_d, config=None, tma_usable=True, ws_usable=False):
    kernel = _Recorder()
    x = torch.zeros(1, dtype=dtype)
    tma = (lambda bm, bn: {"USE_TMA": True}) if tma_usable else None
    ws = (lambda bm, bn: {"WARP_SPEC": True}) if ws_usable else None
    T.launch(kind, kernel, lambda bm, bn: (1,), (x,), {"BLOCK_D": block_d},
              ("key", block_d, dtype), config, tma=tma, ws=ws)
    return kernel.launches


def _overlap(kind, dtype, block_d):
    return [Config(*c[:4], tma=c[4], overlap=True)
            for c in C._GPU_OVERLAP_CONFIGS.get(kind, {}).get(C._class(dtype, block_d), [])]


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dkdv_atomic"])
def test_auto_tries_tma_configs_first_then_pointer_configs(kind, gpu_branch, monkeypatch):
    monkeypatch.delenv("TORCHFN_TRITON_TMA", raising=False)
    launches = _launch(kind, torch.bfloat16, 128)
    tma = [Config(*c, tma=True) for c in C._tma_candidates(kind, torch.bfloat16, 128)]
    ptr = [Config(*c) for c in C._candidates(kind, torch.bfloat16, 128)]
    assert tma, f"{kind} has TMA configs at D=128"
    # then the untimed overlap variants (forward and dK/dV; none for the atomic dK/dV)
    ovl = _overlap(kind, torch.bfloat16, 128)
    assert bool(ovl) == (kind != "dkdv_atomic")
    assert gpu_branch["cands"] == tma + ptr + ovl
    assert launches == [tma[0]]  # the tuner's pick is launched, with descriptors


@pytest.mark.parametrize("kind, dtype, block_d", [("dkdv", torch.bfloat16, 64),
                                                   ("dkdv", torch.float16, 128),
                                                   ("fwd", torch.bfloat16, 128)])
def test_overlap_variants_follow_the_tma_mode(kind, dtype, block_d, gpu_branch, monkeypatch):
    ovl = _overlap(kind, dtype, block_d)
    assert ovl
    for mode, want in (("auto", ovl),
                       ("0", [c for c in ovl if not c.tma]),
                       ("1", list(dict.fromkeys(c._replace(tma=True) for c in ovl)))):
        monkeypatch.setenv("TORCHFN_TRITON_TMA", mode)
        _launch(kind, dtype, block_d)
        n = len(want)
        assert gpu_branch["cands"][len(gpu_branch["cands"]) - n:] == want, mode
        assert not any(c.overlap for c in gpu_branch["cands"][:len(gpu_branch["cands"]) - n])
    # the tuner picked a variant: it is launched with its flag (and its TMA flag)
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    monkeypatch.setattr(T, "_TUNED", {})
    monkeypatch.setattr(T, "tune", lambda run, cands, *rest: cands[-1])
    assert _launch(kind, dtype, block_d) == [ovl[-1]]


def test_auto_without_tma_list_or_without_tma_support_uses_pointer_configs(gpu_branch,
                                                                          monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    ptr = [Config(*c) for c in C._candidates("dq", torch.bfloat16, 128)]
    _launch("dq", torch.bfloat16, 128)  # dq: TMA was not faster, so no TMA list
    assert gpu_branch["cands"] == ptr
    ptr_fwd = [Config(*c) for c in C._candidates("fwd", torch.float32, 64)]
    _launch("fwd", torch.float32, 64, tma_usable=False)  # e.g. sm_80, unaligned strides
    assert gpu_branch["cands"] == ptr_fwd


def test_mode_one_forces_tma_and_mode_zero_forbids_it(gpu_branch, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "1")
    _launch("dq", torch.bfloat16, 64)  # no TMA list: the pointer configs, with TMA loads
    assert gpu_branch["cands"] == [Config(*c, tma=True)
                                   for c in C._candidates("dq", torch.bfloat16, 64)]
    _launch("fwd", torch.bfloat16, 64)
    ovl = _overlap("fwd", torch.bfloat16, 64)  # TMA variants only
    assert ovl and all(c.tma for c in ovl)
    assert gpu_branch["cands"] == [Config(*c, tma=True) for c in
                                   C._tma_candidates("fwd", torch.bfloat16, 64)] + ovl
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "0")
    _launch("fwd", torch.bfloat16, 64)
    assert gpu_branch["cands"] == [Config(*c) for c in C._candidates("fwd", torch.bfloat16, 64)]


def test_tuned_choice_is_cached_per_mode(gpu_branch, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    _launch("fwd", torch.bfloat16, 128)
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "0")
    _launch("fwd", torch.bfloat16, 128)
    picks = {key[-1]: cfg for key, cfg in T.tuned_configs().items()}
    assert picks["auto"].tma is True and picks["0"].tma is False


def test_explicit_config(gpu_branch, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    assert _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4, 2)) == \
        [(64, 32, 4, 2, False, False, False)]
    assert _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4, 2, True)) == \
        [(64, 32, 4, 2, True, False, False)]
    # a forced TMA config falls back to pointer loads where TMA is unusable
    assert _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4, 2, True),
                   tma_usable=False) == [(64, 32, 4, 2, False, False, False)]
    assert _launch("dkdv", torch.bfloat16, 64, config=(32, 64, 4, 3, False, True)) == \
        [(32, 64, 4, 3, False, True, False)]
    assert _launch("dq", torch.bfloat16, 64, config=(64, 64, 4, 3, False, False, True),
                   ws_usable=True) == [(64, 64, 4, 3, False, False, True)]
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "1")
    assert _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4, 2)) == \
        [(64, 32, 4, 2, True, False, False)]
    # under TMA=1 a 7-tuple with ws still reads through the kernel's own descriptors
    assert _launch("fwd", torch.bfloat16, 64, config=(128, 64, 4, 3, False, False, True),
                   ws_usable=True) == [(128, 64, 4, 3, False, False, True)]
    assert "cands" not in gpu_branch  # nothing was tuned


def test_bad_explicit_config_is_a_clear_error(gpu_branch):
    with pytest.raises(ValueError, match=r"config must be \(BLOCK_M, BLOCK_N, num_warps"):
        _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4))
    with pytest.raises(ValueError, match="the 'dq' kernel has no overlap variant"):
        _launch("dq", torch.bfloat16, 64, config=(64, 32, 4, 2, False, True))
    with pytest.raises(ValueError, match="the 'jvp' kernel has no warp-specialized variant"):
        _launch("jvp", torch.bfloat16, 64, config=(64, 32, 4, 2, False, False, True))
    with pytest.raises(ValueError, match="ws .* excludes tma and overlap"):
        _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4, 2, True, False, True),
                ws_usable=True)
    # inputs the variant cannot take (a mask, GQA in dK/dV, fp32 on a GPU, ...)
    with pytest.raises(ValueError, match="warp-specialized dkdv kernel needs .* with GQA"):
        _launch("dkdv", torch.bfloat16, 64, config=(64, 128, 4, 2, False, False, True))
    with pytest.raises(ValueError, match=r"config must be .*\[, ws\]"):
        _launch("fwd", torch.bfloat16, 64, config=(64, 32, 4, 2, False, False, True, 1))


def test_autotune_off_launches_the_first_candidate(gpu_branch, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    first = C._tma_candidates("fwd", torch.float16, 128)[0]
    assert _launch("fwd", torch.float16, 128) == [Config(*first, tma=True)]
    assert "cands" not in gpu_branch


def test_overlap_off_leaves_the_variants_out_and_tunes_apart(gpu_branch, monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    _launch("dkdv", torch.bfloat16, 128)
    with_variants = gpu_branch["cands"]
    monkeypatch.setenv("TORCHFN_TRITON_OVERLAP", "0")
    _launch("dkdv", torch.bfloat16, 128)
    assert gpu_branch["cands"] == [c for c in with_variants if not c.overlap] != with_variants
    assert len(T.tuned_configs()) == 2  # one pick with the variants, one without
    monkeypatch.setenv("TORCHFN_TRITON_OVERLAP", "yes")
    with pytest.raises(ValueError, match="TORCHFN_TRITON_OVERLAP must be '0' or '1'"):
        _launch("dkdv", torch.bfloat16, 128)


@pytest.mark.parametrize("kind, block_d", [("fwd", 128), ("dkdv", 64), ("dq", 128)])
def test_warp_specialized_variants_come_last_where_usable(kind, block_d, gpu_branch,
                                                          monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    monkeypatch.delenv("TORCHFN_TRITON_WS", raising=False)
    _launch(kind, torch.bfloat16, block_d, ws_usable=True)
    assert not any(c.ws for c in gpu_branch["cands"])  # opt-in: not tried by default
    monkeypatch.setenv("TORCHFN_TRITON_WS", "1")
    _launch(kind, torch.bfloat16, block_d)
    without = gpu_branch["cands"]
    assert not any(c.ws for c in without)  # inputs the variant cannot take: not tried
    _launch(kind, torch.bfloat16, block_d, ws_usable=True)
    ws = [Config(*c, ws=True) for c in C._GPU_WS_CONFIGS[kind][C._class(torch.bfloat16,
                                                                        block_d)]]
    assert ws and gpu_branch["cands"] == without + ws
    assert len(T.tuned_configs()) == 2  # tuned apart: with and without the variant
    assert len({k[:-2] for k in T.tuned_configs()}) == 2
    # the tuner picked one: launched with WARP_SPEC and without host descriptors
    monkeypatch.setattr(T, "_TUNED", {})
    monkeypatch.setattr(T, "tune", lambda run, cands, *rest: cands[-1])
    assert _launch(kind, torch.bfloat16, block_d, ws_usable=True) == [ws[-1]]
    # never for fp32 (3xTF32 dots); a bad value is a clear error
    assert C._ws_candidates(kind, torch.float32, block_d) == []
    monkeypatch.setenv("TORCHFN_TRITON_WS", "on")
    with pytest.raises(ValueError, match="TORCHFN_TRITON_WS must be '0' or '1'"):
        C._ws_candidates(kind, torch.bfloat16, block_d)


def test_bad_tma_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "yes")
    with pytest.raises(ValueError, match="TORCHFN_TRITON_TMA must be 'auto', '0' or '1'"):
        C._tma_mode()


def test_interpreter_uses_tma_only_when_forced(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(1, 2, 8, 32)
    for mode, usable in (("auto", False), ("0", False), ("1", True)):
        monkeypatch.setenv("TORCHFN_TRITON_TMA", mode)
        assert (T.tma_descriptors({"desc_q": x}, {"desc_q": "m"}, 32) is not None) == usable


def test_tma_and_overlap_lists_are_well_formed():
    # every TMA / overlap / warp-specialized list shadows a pointer list of the same
    # kernel and class, and holds power-of-two blocks of at least 16 (tl.dot's minimum);
    # Triton specializes only 4-warp launches (into 12 warps)
    assert set(C._GPU_OVERLAP_CONFIGS) <= set(C._OVERLAP)
    assert set(C._GPU_WS_CONFIGS) <= set(C._WARP_SPEC)
    assert all(c[2] == 4 for t in C._GPU_WS_CONFIGS.values() for cs in t.values() for c in cs)
    for kind, table in [*C._GPU_TMA_CONFIGS.items(), *C._GPU_OVERLAP_CONFIGS.items(),
                        *C._GPU_WS_CONFIGS.items()]:
        for cls, cfgs in table.items():
            assert cls in C._GPU_CONFIGS[kind], (kind, cls)
            for bm, bn, warps, stages, *tma in cfgs:
                assert tma in ([], [True], [False]), (kind, cls)
                for b in (bm, bn):
                    assert b >= 16 and b & (b - 1) == 0, (kind, cls, b)
                assert warps in (4, 8) and 1 <= stages <= 4, (kind, cls)


class _FakeGPU:
    """Each config has a true time; the GPU runs slower for its first ``ramp`` timed
    calls (an idle GPU ramps its clock up under load), as the H200 did."""

    def __init__(self, true_ms, ramp, slow=1.4):
        self.true_ms, self.ramp, self.slow = true_ms, ramp, slow
        self.calls, self.last = 0, None

    def run(self, cfg):
        if cfg not in self.true_ms:
            raise RuntimeError("out of resources")  # a config that does not compile
        self.last = cfg

    def do_bench(self, fn, warmup, rep, return_mode="mean"):
        fn()
        self.calls += 1
        return self.true_ms[self.last] * (self.slow if self.calls <= self.ramp else 1.0)


@pytest.mark.parametrize("ramp", [0, 1, 2, 3])
def test_tuner_finds_the_fastest_config_through_a_clock_ramp(ramp, monkeypatch):
    import triton.testing

    fastest = Config(128, 128, 8, 3, True)
    true_ms = {fastest: 1.00, Config(128, 64, 8, 3, True): 1.05,
               Config(64, 64, 4, 3, True): 1.07, Config(64, 64, 4, 3, False): 1.10}
    gpu = _FakeGPU(true_ms, ramp)
    monkeypatch.setattr(triton.testing, "do_bench", gpu.do_bench)
    cands = [fastest, Config(32, 32, 4, 2), *list(true_ms)[1:]]  # one does not compile
    assert T.tune(gpu.run, cands) == fastest
    # a single config that runs is returned without timing
    gpu = _FakeGPU(true_ms, ramp)
    monkeypatch.setattr(triton.testing, "do_bench", gpu.do_bench)
    assert T.tune(gpu.run, [Config(32, 32, 4, 2), fastest]) == fastest and gpu.calls == 0


@pytest.mark.parametrize("dtype, err, kept", [(torch.bfloat16, 1e-3, True),
                                               (torch.bfloat16, 5e-2, False),
                                               (torch.float32, 1e-3, False)])
def test_tuner_skips_a_config_whose_results_are_off(dtype, err, kept, monkeypatch):
    # an untimed variant (e.g. a miscompiled warp-specialized kernel) must never win on
    # speed with wrong results: each config's outputs are checked against the first's
    import triton.testing

    first, fast = Config(128, 64, 8, 3, True), Config(128, 128, 4, 2, ws=True)
    true_ms = {first: 1.0, fast: 0.8}
    gpu = _FakeGPU(true_ms, 0)
    monkeypatch.setattr(triton.testing, "do_bench", gpu.do_bench)
    ref = torch.linspace(-1, 1, 64).to(dtype)
    out = torch.empty_like(ref)

    def run(cfg):
        gpu.run(cfg)
        out.copy_(ref * (1 + err) if cfg == fast else ref)  # a relative error of `err`

    if kept:
        assert T.tune(run, [first, fast], (out,), "fwd") == fast
    else:
        with pytest.warns(RuntimeWarning, match=r"fwd config \(128, 128, 4, 2, .*off.*skipped"):
            assert T.tune(run, [first, fast], (out,), "fwd") == first
    # non-finite results where the first config's are finite: always skipped
    out_nan = torch.empty(4)
    with pytest.warns(RuntimeWarning, match="inf off"):
        picked = T.tune(lambda c: (gpu.run(c), out_nan.fill_(1.0 if c == first else
                                                               float("nan"))),
                         [first, fast], (out_nan,), "fwd")
    assert picked == first


def test_tuner_error_when_no_config_runs(monkeypatch):
    gpu = _FakeGPU({}, 0)
    with pytest.raises(RuntimeError, match="no Triton attention config could run"):
        T.tune(gpu.run, [Config(32, 32, 4, 2)])


def test_untuned_launch_falls_back_when_a_config_does_not_fit(monkeypatch):
    # a GPU with less shared memory than an H100 (e.g. 99 KiB): the first configs do not
    # fit; with the tuner off the launcher takes the first that does, and remembers it
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(T, "is_interpreted", lambda: False)
    monkeypatch.setattr(T, "_TUNED", {})
    monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "0")
    cands = C._candidates("fwd", torch.bfloat16, 128)
    launches = []

    class SmallGPU(_Recorder):
        def __getitem__(self, grid):
            def launch(*args, BLOCK_M, BLOCK_N, **kw):
                launches.append((BLOCK_M, BLOCK_N))
                if (BLOCK_M, BLOCK_N) == cands[0][:2]:
                    raise OutOfResources(229376, 101376, "shared memory")

            return launch

    x = torch.zeros(1, dtype=torch.bfloat16)
    for _ in range(2):
        T.launch("fwd", SmallGPU(), lambda bm, bn: (1,), (x,), {"BLOCK_D": 128}, ("k",),
                  None, tma=None)
    assert launches == [cands[0][:2], cands[1][:2], cands[1][:2]]
    assert list(T.tuned_configs().values()) == [Config(*cands[1])]


def test_scratch_allocator_is_lent_for_the_launch_only():
    # descriptors made in a kernel (WARP_SPEC) need Triton's scratch allocator: lent
    # from torch while launching when the caller set none, a caller's own left alone
    from triton.runtime import _allocation

    var = _allocation._allocator
    assert isinstance(var.get(), _allocation.NullAllocator)
    with T._scratch_allocator(torch.device("cuda")):
        lent = var.get()
        assert not isinstance(lent, _allocation.NullAllocator) and callable(lent)
    assert isinstance(var.get(), _allocation.NullAllocator)
    with T._scratch_allocator(torch.device("cpu")):  # the interpreter needs none
        assert isinstance(var.get(), _allocation.NullAllocator)

    def mine(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    token = var.set(mine)
    try:
        with T._scratch_allocator(torch.device("cuda")):
            assert var.get() is mine
    finally:
        var.reset(token)
