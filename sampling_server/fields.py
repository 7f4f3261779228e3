"""Checks of request fields every service shares: node-ID tensors and the dtype features
(node or edge) travel in."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from protos import codec, halfcast
from protos import sampling_pb2 as pb
from sampling_server.errors import RequestError

#: Feature dtypes a request may ask for on the wire (UNSPECIFIED: the stored one).
FEATURE_WIRE_DTYPES: tuple[codec.WireDType, ...] = (pb.DTYPE_UNSPECIFIED, pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)
#: The stored dtypes of edge features that travel in the requested dtype (as node features).
_FLOAT = (pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT64)


def decode_node_ids(msg: pb.Tensor, field: str, what: str = "node IDs") -> np.ndarray:
    """A request's 1-d INT64 tensor of IDs (``what``: node IDs) as an owned int64 array."""
    try:
        ids = codec.decode_tensor(msg, writable=True)
    except codec.CodecError as exc:
        raise RequestError(f"{field}: {exc}") from exc
    if msg.dtype != pb.INT64 or ids.ndim != 1:
        raise RequestError(f"{field}: expected a 1-d int64 tensor of {what}, got "
                           f"{codec.dtype_name(msg.dtype)} of shape {list(ids.shape)}")
    return ids


def wire_feature_dtype(requested: int, stored: codec.WireDType, field: str) -> codec.WireDType:
    """The dtype features travel in: ``requested``, or ``stored`` when unspecified. The
    stored dtype may also be named (float64 features: a server resolves "as stored" to it
    in the requests it makes of its peers)."""
    if requested not in FEATURE_WIRE_DTYPES and requested != stored:
        names = [codec.dtype_name(d) for d in FEATURE_WIRE_DTYPES[1:]]
        raise RequestError(f"{field}: expected one of {names}, the stored dtype "
                           f"({codec.dtype_name(stored)}) or dtype_unspecified, got "
                           f"{codec.dtype_name(requested)}")
    return stored if requested == pb.DTYPE_UNSPECIFIED else cast(codec.WireDType, requested)


def edge_wire_dtype(requested: codec.WireDType, stored: codec.WireDType) -> codec.WireDType:
    """The dtype edge features travel in: floating-point features in ``requested`` (the
    batch's feature dtype; unspecified: as stored), other features as stored."""
    return requested if stored in _FLOAT and requested != pb.DTYPE_UNSPECIFIED else stored


def cast_features(x: torch.Tensor, dtype: int) -> torch.Tensor:
    """Features in the wire ``dtype`` (no copy when they already are; float32 ->
    bfloat16 on the CPU in one parallel Numba pass, :mod:`protos.halfcast`)."""
    return halfcast.cast(x, codec.dtype_to_torch(dtype))
