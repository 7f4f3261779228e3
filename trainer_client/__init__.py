"""The graphfeed client: PyG minibatches streamed from sampling servers, and a DDP trainer.

One path for both kinds of graph: a plain graph is a typed graph of one node type and
one edge type below the user's API (``graph.py``: :class:`TypedGraph`, the graph's facts,
and ``to_plain_data``, which makes a plain graph's batch the ``Data`` users get).

* :class:`RemoteNeighborLoader` (``loader.py``): one rank's epoch as PyG ``Data`` batches
  in original node IDs, like ``torch_geometric.loader.NeighborLoader``, or ``HeteroData``
  on a typed graph (``inputs.py`` checks what it is asked to iterate); :class:`Cluster`
  (``cluster.py``) holds the channels, the servers' checked ``ClusterInfo``, the node
  lookups and the tables it fills once (``connect.py``: reaching the servers;
  ``fills.py``: the feature caches of ``cache.py`` and the node tables of
  ``node_table.py``);
* ``stream.py``: one stream per server, merged in batch order, prefetched, resumed after
  breaks, failing with a clear error within bounded time;
* ``decode.py``: ``MinibatchChunk`` messages to a batch without copies (``batch_checks.py``:
  every tensor checked, one path for both kinds);
* ``models.py``: GraphSAGE / GCN / GAT / GIN node classifiers using ``trim_to_layer``;
  ``typed_models.py``: R-GCN and ``to_hetero`` GraphSAGE for ``HeteroData`` batches;
* ``evaluate.py``: sampled accuracy and full-neighbor layer-wise inference;
* ``train.py``: the torchrun-compatible trainer (``graphfeed-train``), its loop in
  ``loop.py`` (one for both kinds), its process group and checkpoints in ``ddp.py``;
  ``in_process.py``: typed batches sampled in the trainer's process (``--partition-dir``);
* ``warmup.py``: compiles the trainer's Numba kernels ahead of use;
* ``local.py``: servers for every partition on one machine, then the trainer
  (``graphfeed-local``).

See ``docs/training.md``.
"""

from trainer_client.cluster import Cluster
from trainer_client.decode import BatchAssembler, BatchDecodeError, BatchSpec, DecodedBatch, decode_batch
from trainer_client.graph import TypedGraph, to_plain_data
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
    "RemoteNeighborLoader",
    "StreamStats",
    "StreamTimeouts",
    "TypedGraph",
    "build_model",
    "decode_batch",
    "to_plain_data",
]
