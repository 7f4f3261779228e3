"""How a server says it has no stream slot for a caller, and how a client tells that
``RESOURCE_EXHAUSTED`` (worth a retry: slots come free) from one that retrying cannot
cure (a message over gRPC's size limit: the same request gets the same message).

Both ends import this module: the server puts :data:`SLOT_REFUSAL` into the details of
every refusal and eviction for want of a slot (``sampling_server/fair_share.py``), and
the trainer resumes a stream after a ``RESOURCE_EXHAUSTED`` only when
:func:`retryable_exhaustion` says so.
"""

from __future__ import annotations

#: Words in the details of every ``RESOURCE_EXHAUSTED`` that a free slot cures.
SLOT_REFUSAL = "no stream slot"


def retryable_exhaustion(details: str | None) -> bool:
    """Whether a ``RESOURCE_EXHAUSTED`` with these details is worth another call: a
    server without a free slot for the caller (now or after ending one of its streams
    for another client). Anything else (a message larger than the limit, a server out of
    memory for this request) would fail again the same way."""
    return SLOT_REFUSAL in (details or "")
