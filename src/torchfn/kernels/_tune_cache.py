"""The GPU autotuner's picks, kept on disk so a new process does not tune again.

The first launch of a Triton attention kernel per shape key compiles and times every
candidate config (seconds, up to a dozen candidates on sm_90). The pick depends only on
the GPU, the software and the kernels, so it is written to a small JSON file per

    (GPU name, compute capability, Triton version, torch version, kernel sources)

under ``TORCHFN_TRITON_TUNE_CACHE`` (a directory; default
``$XDG_CACHE_HOME/torchfn/tuning``, i.e. ``~/.cache/torchfn/tuning``; ``0`` turns it
off). Editing a kernel or a config table changes the sources' hash, so a stale pick is
never read. A cached pick is used only while it is still one of the candidates the
launcher would try; anything else in the file is ignored (and retuned).

Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a
killed process leaves the old file or the new one, never half of one. Two processes
tuning at once can each overwrite the other's new entries: the loser is tuned again
next time, never wrong. An unreadable file is warned about once and replaced on the
next write.

Example::

    TORCHFN_TRITON_TUNE_CACHE=/scratch/tuning python train.py   # tunes once, then reuses
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from torchfn.kernels._triton_configs import Config

_SOURCES = ("_triton_fwd.py", "_triton_bwd.py", "_triton_jvp.py", "_triton_configs.py",
            "_triton_ops.py", "_triton_launch.py", "_triton_ordered_bwd.py", "_triton_merge.py",
            "_split_kv.py", "_triton_dropout.py", "_triton_ordered_dq.py", "_ordered_dq.py")
_FORMAT = 1
_loaded: dict[Path, dict[str, list]] = {}  # path -> entries, read once per process
_warned: set[Path] = set()


def cache_dir() -> Path | None:
    """The directory the picks live in, or None when ``TORCHFN_TRITON_TUNE_CACHE=0``."""
    value = os.environ.get("TORCHFN_TRITON_TUNE_CACHE", "").strip()
    if value == "0":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return Path(base).expanduser() / "torchfn" / "tuning"


@functools.cache
def _sources_hash() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def device_tag(device: torch.device) -> str:
    """What a pick depends on besides the kernels: the GPU model and the versions."""
    import triton

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)}-sm{major}{minor}"
    else:  # (the launcher tunes only on a GPU; tests drive it with CPU tensors)
        gpu = device.type
    return f"{gpu}-triton{triton.__version__}-torch{torch.__version__}"


def _path(device: torch.device) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    name = re.sub(r"[^A-Za-z0-9._+-]+", "_", f"{device_tag(device)}-{_sources_hash()}")
    return root / f"{name}.json"


def _key(full_key: tuple) -> str:
    return repr(tuple(str(k) if isinstance(k, torch.dtype) else k for k in full_key))


def _read(path: Path) -> dict[str, list]:
    if path in _loaded:
        return _loaded[path]
    entries: dict[str, list] = {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"expected a format {_FORMAT} tuning cache")
        entries = {k: v for k, v in data["entries"].items() if isinstance(v, list)}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as err:
        if path not in _warned:
            _warned.add(path)
            warnings.warn(f"torchfn: ignoring the unreadable Triton tuning cache {path} "
                          f"({err}); it is rewritten on the next tuning", RuntimeWarning,
                          stacklevel=3)
    _loaded[path] = entries
    return entries


def lookup(device: torch.device, full_key: tuple, candidates: list[Config]) -> Config | None:
    """The cached pick for ``full_key`` if it is one of ``candidates``, else None."""
    path = _path(device)
    if path is None:
        return None
    raw = _read(path).get(_key(full_key))
    try:
        cfg = Config(*raw) if raw is not None else None
    except TypeError:  # wrong number of fields
        return None
    return cfg if cfg in candidates else None


def record(device: torch.device, full_key: tuple, cfg: Config) -> None:
    """Add the pick for ``full_key`` to the file (atomically); I/O errors only warn:
    the launch goes on with the pick, which is just not remembered."""
    path = _path(device)
    if path is None:
        return
    _loaded.pop(path, None)  # merge with what other processes wrote meanwhile
    entries = dict(_read(path))
    entries[_key(full_key)] = [_plain(x) for x in cfg]
    _loaded[path] = entries
    payload = json.dumps({"format": _FORMAT, "entries": entries}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        warnings.warn(f"torchfn: could not write the Triton tuning cache {path}: {err}",
                      RuntimeWarning, stacklevel=3)


def _plain(x: Any) -> Any:
    return bool(x) if isinstance(x, bool) else int(x)
