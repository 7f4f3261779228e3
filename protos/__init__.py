"""The graphfeed wire contract.

* ``sampling.proto``: the one contract (package ``graphfeed.v1``), documented field by field;
* ``sampling_pb2`` / ``sampling_pb2_grpc`` (+ ``.pyi``): stubs generated from it with
  ``python -m protos.generate``; never edit them by hand;
* :mod:`protos.codec`: tensors to and from ``Tensor`` / ``TensorChunk`` messages.

See ``docs/wire.md``.
"""
