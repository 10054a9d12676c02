"""One transfer record: the service's `Transfer` and the SDK's `TransferInfo` extend `TransferRecord`, and what
the service writes of one the SDK reads back field for field."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from rendezvous.clients import TransferInfo, _convert
from rendezvous.core.model import AbortReason, Mode, State, Transfer, TransferTimes
from rendezvous.protocol import convert
from rendezvous.protocol.transfer import TransferRecord

SHARED = tuple(f.name for f in dataclasses.fields(TransferRecord))


def test_both_records_extend_the_protocols_and_keep_its_fields_in_place() -> None:
    assert issubclass(Transfer, TransferRecord) and issubclass(TransferInfo, TransferRecord)
    service = tuple(f.name for f in dataclasses.fields(Transfer))
    sdk = tuple(f.name for f in dataclasses.fields(TransferInfo))
    assert service[: len(SHARED)] == SHARED and service[len(SHARED) :] == ("assigned_generation", "block_digests")
    assert sdk == SHARED
    assert not hasattr(TransferInfo("t", State.MATCHED), "__dict__")


def test_each_side_keeps_its_own_defaults() -> None:
    # The service's record always has a deadline and no source blocks until the producer says them; the SDK
    # reads both from a message, which has no "not said".
    info = TransferInfo("t", State.TARGETED)
    assert (info.deadline, info.source_block_ids) == (0.0, ())
    assert Transfer("t", State.TARGETED, 5.0).source_block_ids is None
    assert [p.name for p in dataclasses.fields(Transfer) if p.default is dataclasses.MISSING][:3] == [
        "transfer_id",
        "state",
        "deadline",
    ]


ids = st.text(st.characters(codec="utf-8"), max_size=8)
small = st.integers(min_value=0, max_value=2**31 - 1)
blocks = st.lists(small, max_size=5).map(tuple)
# Whole seconds up to 2**32 (2106): a Timestamp keeps them exactly (their nanoseconds are exact floats; a
# fraction, or a later second, may move an ulp).
moments = st.integers(min_value=0, max_value=2**32).map(float)
transfers = st.builds(
    Transfer,
    transfer_id=ids,
    state=st.sampled_from(State),
    deadline=moments,
    mode=st.sampled_from(Mode),
    generation=small,
    consumer_engine_id=ids,
    consumer_incarnation=small,
    producer_engine_id=ids,
    producer_incarnation=small,
    target_block_ids=blocks,
    source_block_ids=st.none() | blocks,
    num_tokens=small,
    abort_reason=st.sampled_from(AbortReason),
    abort_message=ids,
    revoking_generation=small,
    times=st.builds(TransferTimes, *[moments] * 6),
    reported_ranks=blocks,
    progressive=st.booleans(),
    assigned_generation=small,
    block_digests=ids,
)


@given(transfers)
def test_the_sdk_reads_every_shared_field_the_service_writes(t: Transfer) -> None:
    message = convert.transfer_message(t)
    info = _convert.transfer(message)
    assert type(info) is TransferInfo
    expected = {n: getattr(t, n) for n in SHARED} | {"source_block_ids": t.source_block_ids or ()}
    assert {n: getattr(info, n) for n in SHARED} == expected
    assert message == convert.transfer_message(info)  # and writes it back the same
