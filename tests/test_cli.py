"""The torchfn console command: info, inspect (with --verify catching a flipped byte),
clear errors and exit codes, and ``python -m torchfn``."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import torchfn
from torchfn import random
from torchfn.cli import main


def test_info_names_the_versions_and_the_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch              {torch.__version__}" in out
    assert "attention backend" in out and torchfn.__version__ in out


def test_inspect_lists_tensors_shapes_and_metadata(tmp_path, capsys):
    path = tmp_path / "run.safetensors"
    state = {"params": {"w": random.normal(random.key(0), (3, 4)), "b": torch.zeros(4)},
             "step": 7, "opt": (torch.zeros(2), None, 0.5)}
    torchfn.save(path, state, metadata={"lr": 0.001})
    assert main(["inspect", str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "3 tensors" in out and "params.w  F32    (3, 4)" in out
    assert "params.b  F32    (4,)" in out and "18 values" in out
    assert 'metadata: {"lr": 0.001}' in out and "verify: ok" in out
    assert "other leaves: step = 7, opt.1 = None, opt.2 = 0.5" in out


def test_verify_catches_a_flipped_data_byte(tmp_path, capsys):
    path = tmp_path / "run.safetensors"
    torchfn.save(path, {"w": torch.arange(64, dtype=torch.float32)})
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # a byte of the tensor data, past the header
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(path)]) == 0  # the header alone still reads
    assert main(["inspect", str(path), "--verify"]) == 1
    assert "verify: FAILED" in capsys.readouterr().err


def test_unreadable_files_get_a_clear_error_and_status_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2)}, str(plain))
    assert main(["inspect", str(plain)]) == 2
    assert "not a torchfn checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def test_python_dash_m_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "torchfn", "info"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "torch" in done.stdout
