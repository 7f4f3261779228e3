"""The graphfeed client: PyG minibatches streamed from sampling servers, and a DDP trainer.

One path for both kinds of graph: a plain graph is a typed graph of one node type and
one edge type below the user's API (:class:`TypedGraph`), and :func:`to_plain_data`
makes its batches the ``Data`` users get. :class:`RemoteNeighborLoader` yields one rank's
epoch as PyG ``Data`` (``HeteroData`` on a typed graph) in original node IDs, like
``torch_geometric.loader.NeighborLoader``, and :class:`RemoteLinkNeighborLoader` link
batches (seed edges, negatives) like ``LinkNeighborLoader``; :class:`Cluster` shares the servers' channels
and the trainer's tables between loaders; ``graphfeed-train`` (``train.py``) trains a
model with DDP. The modules, one job each, are listed in ``docs/architecture.md``; how to
use them in ``docs/training.md``.
"""

from trainer_client.cluster import Cluster
from trainer_client.decode import BatchAssembler, BatchDecodeError, BatchSpec, DecodedBatch, decode_batch
from trainer_client.graph import TypedGraph, to_plain_data
from trainer_client.link_loader import RemoteLinkNeighborLoader
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.models import MODELS, NodeClassifier, build_model
from trainer_client.stream import EpochStream, StreamStats, StreamTimeouts

__all__ = [
    "MODELS",
    "BatchAssembler",
    "BatchDecodeError",
    "BatchSpec",
    "Cluster",
    "DecodedBatch",
    "EpochStream",
    "NodeClassifier",
    "RemoteLinkNeighborLoader",
    "RemoteNeighborLoader",
    "StreamStats",
    "StreamTimeouts",
    "TypedGraph",
    "build_model",
    "decode_batch",
    "to_plain_data",
]
