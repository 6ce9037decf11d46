"""Checkpoints: any pytree of tensors and Python scalars as ONE safetensors file.

    >>> import torch, torchfn
    >>> state = {"params": {"w": torch.ones(2, 3)}, "step": 7, "opt": (torch.zeros(3), None)}
    >>> torchfn.save("/tmp/run.safetensors", state, metadata={"lr": 1e-3})
    >>> back = torchfn.load("/tmp/run.safetensors", like=state)   # checks structure, shapes, dtypes
    >>> back["step"], torchfn.load_metadata("/tmp/run.safetensors")
    (7, {'lr': 0.001})

The file is plain safetensors: each tensor leaf is stored under its '.'-joined
tree path (for a flat params dict, its ``state_dict`` names), so other tools
read it with ``safetensors.torch.load_file``. The tree structure (dicts with
any int/float/bool/None/str keys, lists, tuples, NamedTuples by import path,
scalar leaves) lives in the header metadata as JSON, next to a BLAKE2b
checksum of the structure, the user metadata and every tensor's dtype, shape
and bytes, verified on load.

Writes are atomic: a temporary file in the same folder is written, flushed,
fsynced and ``os.replace``-d over the target, then the folder is fsynced. A
process killed mid-save leaves the previous checkpoint intact (and possibly a
stale ``.<name>.*.tmp`` file next to it).

Round trips are bit-exact. Tensors load on the CPU (or on the device of the
matching leaf of ``like``) as plain, contiguous tensors without
``requires_grad``. The same tensor object appearing twice in the tree loads as
one object appearing twice; distinct views of one storage load as independent
copies.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import struct
import tempfile
from collections import OrderedDict
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["save", "load", "load_metadata", "CheckpointError"]

FORMAT = "torchfn-checkpoint-1"
_STRUCTURE, _CHECKSUM, _USER, _FORMAT = (
    "torchfn.structure", "torchfn.checksum", "torchfn.metadata", "torchfn.format",
)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint file is corrupted, truncated, not a torchfn checkpoint, or does
    not match the expected structure. The message names the file."""


# ------------------------------------------------------------------ encoding


def _encode_key(k: Any, path: str) -> list:
    if isinstance(k, bool):
        return ["b", k]
    if isinstance(k, int):
        return ["i", k]
    if isinstance(k, float):
        return ["f", k.hex()]
    if isinstance(k, str):
        return ["s", k]
    if k is None:
        return ["n", None]
    raise TypeError(
        f"tree: dict key {k!r} at {path or '<root>'!r} must be str, int, float, bool or None, "
        f"got {type(k).__name__}"
    )


def _decode_key(k: list) -> Any:
    kind, v = k
    return {"b": bool, "i": int, "s": str}[kind](v) if kind in "bis" else (
        float.fromhex(v) if kind == "f" else None
    )


class _Encoder:
    """Tree -> (JSON structure, {name: tensor}); names are the leaf paths."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.by_id: dict[int, str] = {}
        self.storages: set[int] = set()

    def _name(self, path: str) -> str:
        name, i = path or "_", 1
        while name in self.tensors:
            name, i = f"{path}#{i}", i + 1
        return name

    def _tensor(self, t: torch.Tensor, path: str) -> dict:
        if id(t) in self.by_id:  # the same object again: store once, restore as one object
            return {"t": "tensor", "k": self.by_id[id(t)]}
        data = t.detach().resolve_conj().resolve_neg().to("cpu")
        storage = data.untyped_storage()
        if (
            data.layout != torch.strided
            or data.stride() != _row_major_strides(data.shape)
            or storage.nbytes() != data.nbytes
            or storage.data_ptr() in self.storages
        ):
            data = data.to_dense() if data.layout != torch.strided else data
            # a fresh tensor: row-major strides even where torch calls any stride
            # contiguous (size-1 and empty dims), so the bytes can be viewed flat
            data = torch.empty(data.shape, dtype=data.dtype).copy_(data)
        if data.numel():
            self.storages.add(data.untyped_storage().data_ptr())
        name = self._name(path)
        self.tensors[name] = data
        self.by_id[id(t)] = name
        return {"t": "tensor", "k": name}

    def encode(self, node: Any, path: str = "") -> dict:
        join = (lambda k: f"{path}.{k}") if path else str
        if isinstance(node, torch.Tensor):
            return self._tensor(node, path)
        if node is None:
            return {"t": "none"}
        if isinstance(node, bool):
            return {"t": "bool", "v": node}
        if isinstance(node, int):
            return {"t": "int", "v": str(int(node))}
        if isinstance(node, float):
            # float.hex() drops a NaN's payload; keep its exact 64 bits instead
            if node != node:
                return {"t": "float", "bits": struct.pack(">d", node).hex()}
            return {"t": "float", "v": float(node).hex()}
        if isinstance(node, str):
            return {"t": "str", "v": node}
        if type(node) in (dict, OrderedDict):
            items = [[_encode_key(k, path), self.encode(v, join(k))] for k, v in node.items()]
            return {"t": "dict" if type(node) is dict else "odict", "items": items}
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            cls = type(node)
            return {
                "t": "namedtuple",
                "cls": f"{cls.__module__}:{cls.__qualname__}",
                "fields": list(cls._fields),
                "items": [self.encode(v, join(f)) for f, v in zip(cls._fields, node)],
            }
        if type(node) in (list, tuple):
            return {
                "t": type(node).__name__,
                "items": [self.encode(v, join(i)) for i, v in enumerate(node)],
            }
        raise TypeError(
            f"tree: leaf at {path or '<root>'!r} is a {type(node).__name__}; checkpoints hold "
            "tensors, int, float, bool, str and None in dicts, lists, tuples and NamedTuples"
        )


def _import_namedtuple(spec: str, fields: list[str], file: str) -> type:
    module_name, _, qualname = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CheckpointError(
            f"{file}: cannot import the NamedTuple class {spec!r} of the saved tree ({e}); "
            "import the module that defines it, or load with like=<a template tree>"
        ) from e
    if not (isinstance(obj, type) and issubclass(obj, tuple) and list(obj._fields) == fields):
        raise CheckpointError(
            f"{file}: {spec!r} is not the NamedTuple saved (fields {fields}), got {obj!r}"
        )
    return obj


def _decode(node: dict, tensors: dict[str, torch.Tensor], file: str, like: Any = None) -> Any:
    t = node["t"]
    if t == "tensor":
        return tensors[node["k"]]
    if t == "none":
        return None
    if t == "bool":
        return bool(node["v"])
    if t == "int":
        return int(node["v"])
    if t == "float":
        if "bits" in node:
            return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
        return float.fromhex(node["v"])
    if t == "str":
        return str(node["v"])
    if t in ("dict", "odict"):
        pairs = [(_decode_key(k), _decode(v, tensors, file)) for k, v in node["items"]]
        return dict(pairs) if t == "dict" else OrderedDict(pairs)
    if t in ("list", "tuple"):
        items = [_decode(v, tensors, file) for v in node["items"]]
        return items if t == "list" else tuple(items)
    if t == "namedtuple":
        cls = _import_namedtuple(node["cls"], node["fields"], file)
        return cls(*[_decode(v, tensors, file) for v in node["items"]])
    raise CheckpointError(f"{file}: unknown node type {t!r} in the saved structure")


# ------------------------------------------------------------------ checksum


def _row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _checksum(structure: str, user: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=32)
    for part in (FORMAT, structure, user):
        h.update(len(part).to_bytes(8, "little") + part.encode())
    for name in sorted(tensors):
        t = tensors[name]
        head = json.dumps([name, str(t.dtype), list(t.shape)]).encode()
        h.update(len(head).to_bytes(8, "little") + head)
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# --------------------------------------------------------------------- save


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Any) -> None:
    """``write(tmp)`` a temporary file beside ``path``, flush and fsync it, then move it
    over ``path``: a write that dies midway leaves ``path`` as it was (and no temporary
    file). The caller fsyncs the folder after its last file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # the writer closed it; flush the data to disk
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save(path: str | os.PathLike, tree: Any, metadata: Any = None) -> None:
    """Write ``tree`` to ``path`` atomically as one safetensors file.

    Args:
        path: the checkpoint file (conventionally ``*.safetensors``); its folder
            must exist.
        tree: a pytree (dicts, lists, tuples, NamedTuples, None) of tensors and
            int/float/bool/str leaves, e.g. a whole train state.
        metadata: optional JSON-serialisable data (config, step, git hash),
            returned by :func:`load_metadata`.

    Example::

        >>> import os
        >>> import tempfile
        >>> import torch
        >>> import torchfn
        >>> state = {"params": {"w": torch.ones(2, 3)}, "step": 7, "opt": (torch.zeros(3), None)}
        >>> with tempfile.TemporaryDirectory() as folder:      # removed with its files
        ...     path = os.path.join(folder, "run.safetensors")
        ...     torchfn.save(path, state, metadata={"lr": 1e-3})
        ...     back = torchfn.load(path, like=state)
        ...     meta = torchfn.load_metadata(path)
        >>> back["step"], back["params"]["w"].shape, back["opt"][1], meta
        (7, torch.Size([2, 3]), None, {'lr': 0.001})
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"path: folder {folder!r} of checkpoint {path!r} does not exist")
    try:
        user = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (no NaN/inf), got {e}") from e
    enc = _Encoder()
    structure = json.dumps(enc.encode(tree), separators=(",", ":"))
    header = {
        _FORMAT: FORMAT,
        _STRUCTURE: structure,
        _USER: user,
        _CHECKSUM: _checksum(structure, user, enc.tensors),
    }
    atomic_write(path, lambda tmp: save_file(enc.tensors, tmp, metadata=header))
    _fsync_dir(folder)


# --------------------------------------------------------------------- load


def _open(path: Any):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint {path!r} is a directory, expected a file")
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (truncated or corrupted?): {e}"
        ) from e
    return path, handle


def _header(path: str, handle) -> tuple[dict, str]:
    meta = handle.metadata() or {}
    if meta.get(_FORMAT) != FORMAT or _STRUCTURE not in meta or _CHECKSUM not in meta:
        raise CheckpointError(
            f"{path}: not a torchfn checkpoint (no {_FORMAT!r} header entries; found "
            f"{sorted(meta)[:5]}); read plain safetensors with safetensors.torch.load_file"
        )
    try:
        structure = json.loads(meta[_STRUCTURE])
        json.loads(meta.get(_USER, "null"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupted structure metadata: {e}") from e
    return structure, meta


def load_metadata(path: str | os.PathLike) -> Any:
    """The ``metadata`` given to :func:`save` (reads only the header)."""
    path, handle = _open(path)
    with handle:
        _, meta = _header(path, handle)
    return json.loads(meta.get(_USER, "null"))


def load(
    path: str | os.PathLike,
    *,
    like: Any = None,
    with_metadata: bool = False,
) -> Any:
    """Read a tree written by :func:`save`, verifying its checksum.

    Args:
        path: the checkpoint file.
        like: optional template tree (e.g. a freshly initialised train state).
            The loaded tree must have its structure, tensor shapes and dtypes;
            tensors are moved to the template's devices.
        with_metadata: return ``(tree, metadata)`` instead of ``tree``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: (a ``ValueError``) truncated, corrupted or non-torchfn
            file, checksum mismatch, or a mismatch with ``like``; names the file.

    Example::

        >>> import os
        >>> import tempfile
        >>> import torch
        >>> import torchfn
        >>> with tempfile.TemporaryDirectory() as folder:      # removed with its files
        ...     path = os.path.join(folder, "run.safetensors")
        ...     torchfn.save(path, {"w": torch.arange(3.0)}, metadata={"step": 3})
        ...     tree, meta = torchfn.load(path, with_metadata=True)
        ...     try:
        ...         torchfn.load(path, like={"w": torch.zeros(4)})   # wrong shape
        ...     except torchfn.CheckpointError:
        ...         print("CheckpointError")
        CheckpointError
        >>> tree["w"].tolist(), meta
        ([0.0, 1.0, 2.0], {'step': 3})
    """
    path, handle = _open(path)
    with handle:
        structure, meta = _header(path, handle)
        try:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        except (SafetensorError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read tensor data (truncated?): {e}") from e
    expected = meta[_CHECKSUM]
    actual = _checksum(meta[_STRUCTURE], meta.get(_USER, "null"), tensors)
    if actual != expected:
        raise CheckpointError(
            f"{path}: checksum mismatch, the file is corrupted (stored {expected[:16]}..., "
            f"data gives {actual[:16]}...)"
        )
    try:
        tree = _decode(structure, tensors, path)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: malformed structure metadata: {e!r}") from e
    if like is not None:
        tree = _match(tree, like, path)
    if with_metadata:
        return tree, json.loads(meta.get(_USER, "null"))
    return tree


# --------------------------------------------------------------- like=template


def _match(tree: Any, like: Any, file: str) -> Any:
    """Check ``tree`` against the template ``like``; move tensors to its devices."""
    import optree

    from torchfn.core import tree as T

    def desc(x):
        if isinstance(x, torch.Tensor):
            return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
        return f"{type(x).__name__} {x!r}"[:80]

    got_spec, want_spec = optree.tree_structure(tree), optree.tree_structure(like)
    got_paths, want_paths = T.paths(tree), T.paths(like)
    if got_spec != want_spec:
        missing = [p for p in want_paths if p not in set(got_paths)]
        extra = [p for p in got_paths if p not in set(want_paths)]
        detail = (
            f"missing {missing[:6]}, unexpected {extra[:6]}"
            if missing or extra
            else f"saved {T._short(got_spec)}, expected {T._short(want_spec)}"
        )
        raise CheckpointError(f"{file}: tree structure differs from like: {detail}")
    out = []
    for p, x, y in zip(got_paths, optree.tree_leaves(tree), optree.tree_leaves(like)):
        if isinstance(y, torch.Tensor):
            if not isinstance(x, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
                raise CheckpointError(f"{file}: {p!r} is {desc(x)}, like has {desc(y)}")
            x = x.to(y.device)
        elif isinstance(x, torch.Tensor) or type(x) is not type(y):
            raise CheckpointError(f"{file}: {p!r} is {desc(x)}, like has {desc(y)}")
        out.append(x)
    return optree.tree_unflatten(got_spec, out)
