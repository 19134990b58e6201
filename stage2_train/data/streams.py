"""The consumer stream of a plan's packing: `documents` (context-true, the default) or `stream`."""

from __future__ import annotations

from pipeline.choices import PACKINGS
from stage2_train.data.document_packing import DocumentStream
from stage2_train.data.packing import ConsumerStream
from stage2_train.data.plan import DataPlan
from stage2_train.data.position import StreamPosition


def consumer_stream(
    plan: DataPlan, consumer: int, position: StreamPosition | None = None
) -> ConsumerStream | DocumentStream:
    if plan.packing == "documents":
        return DocumentStream(plan, consumer, position)
    if plan.packing == "stream":
        return ConsumerStream(plan, consumer, position)
    raise ValueError(f"packing must be one of {PACKINGS}, not {plan.packing!r}")
