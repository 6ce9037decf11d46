"""torchfn.save / torchfn.load: bit-exact round trips, atomic writes, integrity, clear errors."""

import glob
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torchopt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

import torchfn
from torchfn import CheckpointError, Model, random
from torchfn.core.checkpoint import load_metadata


class Moments(NamedTuple):
    mu: object
    nu: object


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8]


def _make_tensor(dtype, shape, seed, view):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) < 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    else:
        t = torch.randint(0, 200, shape, generator=g, dtype=torch.int64).to(dtype)
    if view == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif view == "sliced" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif view == "strided" and t.dim() >= 1:
        t = t[::2]
    return t


tensor_st = st.builds(
    _make_tensor,
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.integers(0, 10_000),
    st.sampled_from(["plain", "transposed", "sliced", "strided"]),
)
scalar_st = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=5),
    st.none(),
)
key_st = st.one_of(st.text(max_size=4), st.integers(-5, 5))
tree_st = st.recursive(
    tensor_st | scalar_st,
    lambda c: st.one_of(
        st.lists(c, max_size=3),
        st.lists(c, max_size=3).map(tuple),
        st.dictionaries(key_st, c, max_size=3),
        st.dictionaries(st.text(max_size=3), c, max_size=2).map(OrderedDict),
        st.tuples(c, c).map(lambda t: Moments(*t)),
    ),
    max_leaves=10,
)


def flat_bytes(t):
    """The tensor's bytes in row-major order (a fresh copy: any strides, any size)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def bit_equal(a, b) -> bool:
    """Same container types and keys, same tensor dtype/shape/bytes, same scalar bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(flat_bytes(a), flat_bytes(b))
        )
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b))
    return a == b


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=tree_st, meta=st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))

def test_round_trip_is_bit_exact(tmp_path, tree, meta):
    path = tmp_path / "ckpt.safetensors"
    torchfn.save(path, tree, metadata=meta)
    back, meta_back = torchfn.load(path, with_metadata=True)
    assert bit_equal(back, tree)
    assert meta_back == meta and load_metadata(path) == meta
    assert bit_equal(torchfn.load(path, like=tree), tree)


def test_round_trip_torchopt_state_and_special_values(tmp_path):
    params = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    opt = torchopt.adamw(1e-3)
    state = {"params": params, "opt": opt.init(params), "step": 3, "lr": float("nan"),
             "neg0": -0.0, "big": 2**80, "name": "run", "none": None}  # fmt: skip
    path = tmp_path / "s.safetensors"
    torchfn.save(path, state)
    back = torchfn.load(path)
    assert bit_equal(back, state)
    assert type(back["opt"][0]) is type(state["opt"][0])  # NamedTuple class re-imported
    # other tools see plain safetensors keyed by tree paths
    assert set(load_file(path)) >= {"params.w", "params.b"}


def test_aliasing(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    tree = {"a": base, "same": base, "row": base[1], "t": base.t()}
    path = tmp_path / "a.safetensors"
    torchfn.save(path, tree)
    back = torchfn.load(path)
    assert back["a"] is back["same"]  # one object twice -> one object twice
    assert all(torch.equal(back[k], tree[k]) for k in tree)
    back["row"].add_(100)  # views of one storage come back independent
    assert torch.equal(back["a"], base)
    assert len(load_file(path)) == 3


def test_model_params_checkpoint_loads_into_original_module(tmp_path):
    module = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    model = Model(module)
    params, state = model.init(random.key(0)), model.init_state()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    _, state = model.apply(params, x, state=state, train=True)
    path = tmp_path / "model.safetensors"
    torchfn.save(path, {**params, **state})
    module.load_state_dict(torchfn.load(path))  # strict
    module.eval()
    assert torch.allclose(module(x), model.apply(params, x, state=state), rtol=1e-6)
    module.load_state_dict(load_file(path))  # plain safetensors readers too

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return self.head(self.emb(t))

    lm = TiedLM()
    model = Model(lm)
    params = model.init(random.key(1))
    torchfn.save(path, model.state_dict(params))
    lm.load_state_dict(torchfn.load(path))
    tokens = torch.tensor([1, 5, 6])
    assert torch.allclose(lm(tokens), model.apply(params, tokens))


# ------------------------------------------------------------------ integrity


def _sample_file(tmp_path):
    path = tmp_path / "c.safetensors"
    tree = {"w": torch.linspace(-1, 1, 40), "opt": Moments(torch.ones(3), [torch.tensor(2)]),
            "step": 5}  # fmt: skip
    torchfn.save(path, tree, metadata={"note": "x"})
    return path, tree, path.read_bytes()


def test_flipped_data_byte_is_detected(tmp_path):
    path, _, raw = _sample_file(tmp_path)
    header_len = int.from_bytes(raw[:8], "little")
    for pos in range(8 + header_len, len(raw)):
        bad = bytearray(raw)
        bad[pos] ^= 1 << (pos % 8)
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=f"{path}: checksum mismatch"):
            torchfn.load(path)


def test_every_flipped_byte_anywhere_is_an_error(tmp_path):
    path, _, raw = _sample_file(tmp_path)  # header (structure, checksum, metadata) and data
    for pos in range(0, len(raw), 3):
        bad = bytearray(raw)
        bad[pos] ^= 0x04
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=str(path)):
            torchfn.load(path)


def test_truncated_files(tmp_path):
    path, _, raw = _sample_file(tmp_path)
    for n in (0, 4, 8, 20, len(raw) // 2, len(raw) - 1):
        path.write_bytes(raw[:n])
        with pytest.raises(CheckpointError, match=str(path)):
            torchfn.load(path)


def test_missing_and_foreign_files(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        torchfn.load(missing)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        torchfn.load(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a checkpoint at all")
    with pytest.raises(CheckpointError, match="notes.txt: not a readable safetensors"):
        torchfn.load(text)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2)}, plain)
    with pytest.raises(CheckpointError, match="plain.safetensors: not a torchfn checkpoint"):
        torchfn.load(plain)
    with pytest.raises(CheckpointError, match="not a torchfn checkpoint"):
        load_metadata(plain)


def test_like_checks_structure_shapes_dtypes(tmp_path):
    path, tree, _ = _sample_file(tmp_path)
    name = str(path)
    assert bit_equal(torchfn.load(path, like=tree), tree)
    cases = {
        "missing \\['extra'\\]": {**tree, "extra": torch.ones(1)},
        "unexpected \\['step'\\]": {k: v for k, v in tree.items() if k != "step"},
        "'w' is a torch.float32 tensor of shape \\(40,\\), like has .*shape \\(41,\\)": {
            **tree, "w": torch.ones(41)},
        "'w' is a torch.float32 tensor.*like has a torch.float64": {
            **tree, "w": tree["w"].double()},
        "'step' is int 5, like has float": {**tree, "step": 5.0},
        "'step' is int 5, like has a torch.int64 tensor": {**tree, "step": torch.tensor(5)},
        "missing \\['opt.0', 'opt.1.0'\\]": {**tree, "opt": (torch.ones(3), [torch.tensor(2)])},
        "saved .*Moments.*\\[\\*\\].*expected .*Moments.*\\(\\*,\\)": {
            **tree, "opt": Moments(torch.ones(3), (torch.tensor(2),))},
    }  # fmt: skip
    for msg, like in cases.items():
        with pytest.raises(CheckpointError, match=f"{name}: .*{msg}"):
            torchfn.load(path, like=like)


def test_unimportable_namedtuple_is_a_clear_error(tmp_path):
    class Local(NamedTuple):  # qualname has <locals>: not importable on load
        a: int

    path = tmp_path / "l.safetensors"
    torchfn.save(path, {"s": Local(1)})
    with pytest.raises(CheckpointError, match="l.safetensors: cannot import the NamedTuple"):
        torchfn.load(path)


def test_bad_input_to_save(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="leaf at 'a.0' is a object"):
        torchfn.save(path, {"a": [object()]})
    with pytest.raises(TypeError, match="dict key \\(1, 2\\) at 'a' must be str"):
        torchfn.save(path, {"a": {(1, 2): 1}})
    with pytest.raises(TypeError, match="metadata must be JSON-serialisable"):
        torchfn.save(path, {}, metadata={"f": object()})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        torchfn.save(tmp_path / "no" / "x.safetensors", {})
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        torchfn.save(3, {})
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        torchfn.load(3)
    assert not os.listdir(tmp_path)  # nothing half-written


# ------------------------------------------------------------------ atomicity


def test_failed_save_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path, tree, raw = _sample_file(tmp_path)
    import torchfn.core.checkpoint as ckpt

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        torchfn.save(path, {"w": torch.zeros(2)})
    assert path.read_bytes() == raw and bit_equal(torchfn.load(path), tree)
    assert os.listdir(tmp_path) == [path.name]


CHILD = textwrap.dedent(
    """
    import sys, torch, torchfn
    path = sys.argv[1]
    def version(v):
        return {"w": torch.full((3_000_000,), float(v)), "step": v}
    torchfn.save(path, version(0))
    print("ready", flush=True)
    v = 1
    while True:
        torchfn.save(path, version(v))
        v += 1
    """
)


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "run.safetensors"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        killed_mid_write = False
        while time.monotonic() < deadline:
            tmps = glob.glob(str(tmp_path / ".run.safetensors.*.tmp"))
            if tmps and any(os.path.exists(t) and os.path.getsize(t) > 0 for t in tmps):
                os.kill(proc.pid, signal.SIGKILL)  # while a temp file is being written
                killed_mid_write = True
                break
            time.sleep(0.0005)
        assert killed_mid_write, "the child never started a second save"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    back = torchfn.load(path)  # a complete earlier version, checksum verified
    v = back["step"]
    assert torch.equal(back["w"], torch.full((3_000_000,), float(v)))
    assert glob.glob(str(tmp_path / ".run.safetensors.*.tmp"))  # the killed write's leftover


def test_overwrite_replaces_content(tmp_path):
    path = tmp_path / "o.safetensors"
    torchfn.save(path, {"v": torch.tensor(1.0)})
    torchfn.save(path, [math.pi, "b"])
    assert torchfn.load(path) == [math.pi, "b"]
    assert os.listdir(tmp_path) == ["o.safetensors"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip_to_like_devices(tmp_path):
    tree = {"w": torch.randn(3, 4, device="cuda").t(), "step": 1}
    path = tmp_path / "g.safetensors"
    torchfn.save(path, tree)
    back = torchfn.load(path, like=tree)
    assert back["w"].is_cuda and torch.equal(back["w"], tree["w"])
    assert not torchfn.load(path)["w"].is_cuda


def test_size_one_and_empty_views_with_odd_strides(tmp_path):
    # torch calls these contiguous whatever their stride, and "one" fills its storage
    # exactly, so no copy is made on the way: its bytes must still be read flat
    tree = {"one": torch.arange(1.0)[::2], "empty": torch.arange(0.0)[::2],
            "col": torch.arange(8.0).reshape(4, 2)[:, :1]}
    assert tree["one"].stride() == (2,) and tree["one"].is_contiguous()
    torchfn.save(tmp_path / "ck", tree)
    back = torchfn.load(tmp_path / "ck")
    assert bit_equal(back, {k: v.clone() for k, v in tree.items()})
