"""Snapshots of node tensors, written by the servers beside their partition
(``--state-dir``): per tensor and step a directory ``<name>/step-<step>/`` with the rows
and each optimizer state as ``.npy`` (no pickle), and ``meta.json`` holding the spec, the
step, each file's SHA-256, and what the snapshot belongs to (the graph's fingerprint and
the partition). A snapshot is written into a temporary directory and renamed into place
once complete, so a crash never leaves one that looks whole; the two newest steps of a
tensor are kept. docs/partition-format.md describes the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from google.protobuf import json_format

from protos import sampling_pb2 as pb

#: Snapshots kept per tensor (the newest steps).
KEEP = 2
_STEP_PREFIX = "step-"


@dataclass(frozen=True)
class SnapshotFiles:
    """Where one tensor's snapshots live."""

    root: Path

    def step_dir(self, step: int) -> Path:
        return self.root / f"{_STEP_PREFIX}{step:012d}"

    def steps(self) -> list[int]:
        """The steps with a complete snapshot, oldest first."""
        if not self.root.is_dir():
            return []
        found = [int(p.name[len(_STEP_PREFIX):]) for p in self.root.iterdir()
                 if p.name.startswith(_STEP_PREFIX) and p.name[len(_STEP_PREFIX):].isdigit()
                 and (p / "meta.json").is_file()]
        return sorted(found)


def tensor_dir_name(name: str) -> str:
    """A tensor name as a directory name (``/`` is not allowed in one)."""
    return name.replace("/", "%2F")


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _save(path: Path, array: np.ndarray) -> str:
    with path.open("wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return _sha256(path)


def write_snapshot(files: SnapshotFiles, spec: pb.NodeTensorSpec, step: int, rows: torch.Tensor,
                   state: Mapping[str, torch.Tensor], identity: Mapping[str, object],
                   pin: bool = False) -> Path:
    """Write ``rows`` and ``state`` at ``step``; the snapshot's directory. The
    :data:`KEEP` newest snapshots are kept, and the newest ``pin``-ned one (a trainer's
    best epoch so far)."""
    files.root.mkdir(parents=True, exist_ok=True)
    tmp = files.root / f".{_STEP_PREFIX}{step}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        sums = {"rows": _save(tmp / "rows.npy", _as_numpy(rows))}
        for name, tensor in state.items():
            sums[name] = _save(tmp / f"{name}.npy", _as_numpy(tensor))
        meta = {"spec": json_format.MessageToDict(spec), "step": step, "dtype": str(rows.dtype),
                "sha256": sums, "pinned": pin, **identity}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        final = files.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    steps = files.steps()
    pinned = [s for s in steps if _meta(files, s).get("pinned")]
    keep = set(steps[-KEEP:]) | set(pinned[-1:])
    for old in steps:
        if old not in keep:
            shutil.rmtree(files.step_dir(old), ignore_errors=True)
    return final


def _meta(files: SnapshotFiles, step: int) -> dict[str, object]:
    try:
        meta: dict[str, object] = json.loads((files.step_dir(step) / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta


def read_snapshot(files: SnapshotFiles, step: int, identity: Mapping[str, object]
                  ) -> tuple[pb.NodeTensorSpec, torch.Tensor, dict[str, torch.Tensor]]:
    """The spec, rows and optimizer state of the snapshot at ``step``; ``ValueError``
    saying what does not match (another graph or partition, a checksum)."""
    where = files.step_dir(step)
    meta = json.loads((where / "meta.json").read_text())
    for key, want in identity.items():
        if meta.get(key) != want:
            raise ValueError(f"{where}: {key}: expected {want!r} (this server's), got {meta.get(key)!r}")
    spec = json_format.ParseDict(meta["spec"], pb.NodeTensorSpec())
    loaded: dict[str, torch.Tensor] = {}
    for name, digest in meta["sha256"].items():
        path = where / f"{name}.npy"
        if _sha256(path) != digest:
            raise ValueError(f"{path}: its SHA-256 differs from meta.json's: the file is damaged")
        tensor = torch.from_numpy(np.load(path, allow_pickle=False))
        loaded[name] = tensor.view(torch.bfloat16) if name == "rows" and meta["dtype"] == "torch.bfloat16" \
            else tensor
    rows = loaded.pop("rows")
    return spec, rows, loaded


def snapshots(state_dir: Path) -> dict[str, list[int]]:
    """Every tensor with a snapshot under ``state_dir``: its name and steps, oldest first."""
    out: dict[str, list[int]] = {}
    if state_dir.is_dir():
        for path in sorted(state_dir.iterdir()):
            steps = SnapshotFiles(path).steps() if path.is_dir() and not path.name.startswith(".") else []
            if steps:
                out[path.name.replace("%2F", "/")] = steps
    return out


def snapshot_job(files: SnapshotFiles, step: int) -> str:
    """The job ID of the snapshot at ``step`` (its meta.json only)."""
    spec = _meta(files, step).get("spec")
    return str(spec.get("jobId", "")) if isinstance(spec, dict) else ""
