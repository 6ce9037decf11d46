"""The autotuner's picks on disk (``_tune_cache``): a new process on the same GPU and
software launches the pick without tuning again; anything else retunes.

The launcher's GPU branch is driven with a stand-in kernel and a stand-in tuner (no
kernel is compiled), as in ``test_triton_configs``. "A new process" is the in-memory
state cleared: the launcher's ``_TUNED`` and the cache's once-per-process reads.
"""

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from torchfn.kernels import _triton_configs as C  # noqa: E402
from torchfn.kernels import _triton_launch as T  # noqa: E402
from torchfn.kernels import _tune_cache  # noqa: E402
from torchfn.kernels._triton_configs import Config  # noqa: E402

KIND, DTYPE, BLOCK_D = "fwd", torch.bfloat16, 128


class _GPU:
    """A stand-in kernel that records launches, and a tuner that picks the last
    candidate (so a reused pick is told apart from the untuned default) and counts."""

    def __init__(self):
        self.launches, self.tunings = [], 0

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, BLOCK_N, num_warps=None, num_stages=None, **kw):
            overlap = kw.get("PIPELINE", False) or kw.get("EARLY_DP", False)
            self.launches.append(Config(BLOCK_M, BLOCK_N, num_warps, num_stages,
                                        kw.get("USE_TMA", False), overlap))

        return launch

    def tune(self, run, cands, *rest):
        self.tunings += 1
        return cands[-1]


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "is_interpreted", lambda: False)
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "auto")
    monkeypatch.setenv("TORCHFN_TRITON_TUNE_CACHE", str(tmp_path / "tuning"))
    monkeypatch.delenv("TORCHFN_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(_tune_cache, "_loaded", {})
    g = _GPU()
    monkeypatch.setattr(T, "tune", g.tune)
    new_process(monkeypatch)
    return g


def new_process(monkeypatch):
    monkeypatch.setattr(T, "_TUNED", {})
    monkeypatch.setattr(_tune_cache, "_loaded", {})


def launch(gpu, n_bucket=4096):
    x = torch.zeros(1, dtype=DTYPE)
    T.launch(KIND, gpu, lambda bm, bn: (1,), (x,), {"BLOCK_D": BLOCK_D},
              (n_bucket, BLOCK_D, False, 0, DTYPE, True), None,
              tma=lambda bm, bn: {"USE_TMA": True})
    return gpu.launches[-1]


def files(tmp_path):
    return sorted((tmp_path / "tuning").glob("*.json")) if (tmp_path / "tuning").exists() else []


def test_a_new_process_reuses_the_pick_without_tuning(gpu, monkeypatch, tmp_path):
    picked = launch(gpu)
    assert gpu.tunings == 1
    assert picked != Config(*C._tma_candidates(KIND, DTYPE, BLOCK_D)[0], tma=True)  # not first
    [path] = files(tmp_path)
    new_process(monkeypatch)
    assert launch(gpu) == picked and gpu.tunings == 1  # read back, not tuned
    assert list(T.tuned_configs().values()) == [picked]
    # another shape key is tuned, and joins the same file
    launch(gpu, n_bucket=8192)
    assert gpu.tunings == 2
    assert len(json.loads(path.read_text())["entries"]) == 2


def test_another_gpu_or_software_or_kernel_source_retunes(gpu, monkeypatch, tmp_path):
    launch(gpu)
    monkeypatch.setattr(_tune_cache, "device_tag", lambda device: "H100-sm90-triton3.6")
    new_process(monkeypatch)
    launch(gpu)
    assert gpu.tunings == 2 and len(files(tmp_path)) == 2
    monkeypatch.setattr(_tune_cache, "_sources_hash", lambda: "an-edited-kernel")
    new_process(monkeypatch)
    launch(gpu)
    assert gpu.tunings == 3 and len(files(tmp_path)) == 3


def test_a_pick_that_is_no_longer_a_candidate_is_retuned(gpu, monkeypatch, tmp_path):
    launch(gpu)
    [path] = files(tmp_path)
    data = json.loads(path.read_text())
    [key] = data["entries"]
    data["entries"][key] = [999, 999, 4, 2, True, False, False]  # e.g. a removed config
    path.write_text(json.dumps(data))
    new_process(monkeypatch)
    picked = launch(gpu)
    assert gpu.tunings == 2 and picked.block_m != 999
    assert json.loads(path.read_text())["entries"][key] == list(picked)  # replaced


@pytest.mark.parametrize("text", ["{not json", '{"format": 99, "entries": {}}', "[1, 2]"])
def test_an_unreadable_file_warns_retunes_and_is_replaced(text, gpu, monkeypatch, tmp_path):
    launch(gpu)
    [path] = files(tmp_path)
    path.write_text(text)
    new_process(monkeypatch)
    with pytest.warns(RuntimeWarning, match="unreadable Triton tuning cache"):
        picked = launch(gpu)
    assert gpu.tunings == 2
    new_process(monkeypatch)
    assert launch(gpu) == picked and gpu.tunings == 2  # the rewritten file is good


def test_off_writes_nothing_and_tunes_in_every_process(gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHFN_TRITON_TUNE_CACHE", "0")
    assert _tune_cache.cache_dir() is None
    launch(gpu)
    new_process(monkeypatch)
    launch(gpu)
    assert gpu.tunings == 2 and files(tmp_path) == []


def test_autotune_off_ignores_the_cache(gpu, monkeypatch):
    picked = launch(gpu)
    new_process(monkeypatch)
    monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")
    first = Config(*C._tma_candidates(KIND, DTYPE, BLOCK_D)[0], tma=True)
    assert launch(gpu) == first != picked


def test_a_failed_write_keeps_the_old_file_and_only_warns(gpu, monkeypatch, tmp_path):
    launch(gpu)
    [path] = files(tmp_path)
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(_tune_cache.os, "replace", fail)
    with pytest.warns(RuntimeWarning, match="could not write the Triton tuning cache.*disk full"):
        launch(gpu, n_bucket=8192)  # tuned and launched all the same
    assert gpu.tunings == 2 and len(gpu.launches) == 2
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_default_directory_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHFN_TRITON_TUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _tune_cache.cache_dir() == tmp_path / "torchfn" / "tuning"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _tune_cache.cache_dir() == _tune_cache.Path("~/.cache/torchfn/tuning").expanduser()


def test_every_kernel_source_keys_the_cache():
    """An edit to any Triton kernel file (or the split rule) starts a new cache file."""
    import pathlib

    from torchfn.kernels import _tune_cache

    here = pathlib.Path(_tune_cache.__file__).parent
    kernels = {p.name for p in here.glob("_triton_*.py")} | {"_split_kv.py", "_ordered_dq.py"}
    assert kernels <= set(_tune_cache._SOURCES), kernels - set(_tune_cache._SOURCES)
