"""The ``torchfn`` console command.

    torchfn info                          # versions, devices, the attention backend
    torchfn inspect run.safetensors       # a checkpoint's tensors, shapes, other leaves,
                                          # metadata
    torchfn inspect run.safetensors --verify   # and check every byte against its checksum

``python -m torchfn ...`` is the same. Exit status: 0 on success, 1 when a checkpoint
fails verification, 2 for bad arguments or an unreadable file. The research scripts
are in ``examples/`` of the source tree, not behind this command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _info(_: argparse.Namespace) -> int:
    import torch

    import torchfn

    rows = [("torchfn", torchfn.__version__), ("python", sys.version.split()[0]),
            ("torch", torch.__version__)]
    rows += [(d, _version(d)) for d in ("triton", "optree", "torchopt", "safetensors")]
    rows.append(("cpu threads", str(torch.get_num_threads())))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, "
                                      f"sm_{p.major}{p.minor}"))
        backend = "triton" if _version("triton") != "not installed" else "torch"
    else:
        rows.append(("cuda", "not available"))
        backend = "torch"
    rows.append(("attention backend", f"{backend} (kernels.attention's default here)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _scalar_leaves(node: dict, path: str = ""):
    """``(path, value)`` for each leaf of a saved structure that is not a tensor (a
    step count, a learning rate, None)."""
    from torchfn.core.checkpoint import _decode, _decode_key

    join = (lambda k: f"{path}.{k}") if path else str
    kind = node["t"]
    if kind in ("dict", "odict"):
        for k, v in node["items"]:
            yield from _scalar_leaves(v, join(_decode_key(k)))
    elif kind in ("list", "tuple"):
        for i, v in enumerate(node["items"]):
            yield from _scalar_leaves(v, join(i))
    elif kind == "namedtuple":
        for f, v in zip(node["fields"], node["items"]):
            yield from _scalar_leaves(v, join(f))
    elif kind != "tensor":
        yield path or "<root>", _decode(node, {}, "")


def _inspect(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from torchfn.core.checkpoint import CheckpointError, _header, _open, load, load_metadata

    path = os.fspath(args.path)
    try:
        metadata = load_metadata(path)  # also checks it is a torchfn checkpoint
        file, handle = _open(path)
        with handle:
            structure, _ = _header(file, handle)
    except (CheckpointError, OSError) as e:
        print(f"torchfn inspect: {e}", file=sys.stderr)
        return 2
    total = 0
    with safe_open(path, framework="pt", device="cpu") as f:
        names = sorted(f.keys())
        width = max((len(n) for n in names), default=0)
        print(f"{path}: {len(names)} tensors")
        for name in names:
            t = f.get_slice(name)
            shape = t.get_shape()
            numel = 1
            for s in shape:
                numel *= s
            print(f"  {name:<{width}}  {t.get_dtype():<5}  {tuple(shape)}")
            total += numel
    print(f"{total:,} values, {os.path.getsize(path) / 2**20:.2f} MiB on disk")
    scalars = list(_scalar_leaves(structure))
    if scalars:
        print("other leaves: " + ", ".join(f"{k} = {v!r}" for k, v in scalars))
    print(f"metadata: {json.dumps(metadata)}")
    if args.verify:
        try:
            load(path)
        except CheckpointError as e:
            print(f"verify: FAILED: {e}", file=sys.stderr)
            return 1
        print("verify: ok (structure, metadata and every tensor's bytes match the checksum)")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchfn", description="torchfn's console command.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and the default attention backend")
    q = sub.add_parser("inspect", help="a checkpoint's tensors, shapes and metadata")
    q.add_argument("path", help="a file written by torchfn.save")
    q.add_argument("--verify", action="store_true",
                   help="read every tensor and check it against the checksum")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchfn`` command with ``argv`` (``sys.argv[1:]`` if None); returns the
    exit status.

    Example::

        >>> import torch, torchfn
        >>> torchfn.save("/tmp/cli_demo.safetensors", {"w": torch.ones(2, 3)}, metadata={"step": 3})
        >>> main(["inspect", "/tmp/cli_demo.safetensors"])
        /tmp/cli_demo.safetensors: 1 tensors
          w  F32    (2, 3)
        6 values, ... MiB on disk
        metadata: {"step": 3}
        0
    """
    args = _parser().parse_args(argv)
    return {"info": _info, "inspect": _inspect}[args.command](args)
