"""The graphfeed client: PyG minibatches streamed from sampling servers, and a DDP trainer.

* :class:`RemoteNeighborLoader` (``loader.py``): one rank's epoch as PyG ``Data``
  batches in original node IDs, like ``torch_geometric.loader.NeighborLoader``
  (``inputs.py`` checks what it is asked to iterate), or ``HeteroData`` on a typed graph
  (``hetero_loader.py``: :class:`TypedGraph`, the typed inputs; ``hetero_decode.py``);
  :class:`Cluster` (``cluster.py``) holds the channels, the servers' checked
  ``ClusterInfo`` and the node lookups;
* ``stream.py``: one stream per server, merged in batch order, prefetched, resumed after
  breaks, failing with a clear error within bounded time;
* ``decode.py``: ``MinibatchChunk`` messages to a ``Data`` without copies;
* ``models.py``: GraphSAGE / GCN / GAT / GIN node classifiers using ``trim_to_layer``;
* ``hetero_models.py``: R-GCN and ``to_hetero`` GraphSAGE for ``HeteroData`` batches;
  ``hetero_source.py``: typed batch sources (the servers', or sampled in process);
  ``hetero_train.py``: the trainer's typed path;
* ``evaluate.py``: sampled accuracy and full-neighbor layer-wise inference;
* ``train.py``: the torchrun-compatible trainer (``graphfeed-train``);
* ``local.py``: servers for every partition on one machine, then the trainer
  (``graphfeed-local``).

See ``docs/training.md``.
"""

from trainer_client.decode import BatchAssembler, BatchDecodeError, BatchSpec, DecodedBatch, decode_batch
from trainer_client.hetero_loader import TypedGraph
from trainer_client.loader import Cluster, RemoteNeighborLoader
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
    "RemoteNeighborLoader",
    "StreamStats",
    "StreamTimeouts",
    "TypedGraph",
    "build_model",
    "decode_batch",
]
