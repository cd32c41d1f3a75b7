"""gateway.epp.wire and gateway.epp.addresses: the protocol's pieces without Envoy."""

from __future__ import annotations

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from google.protobuf.struct_pb2 import Struct

from gateway.epp import wire
from gateway.epp.addresses import AddressBook, address_of
from gateway.types import ReplicaId, ReplicaState


def test_bodies_are_re_streamed_in_bounded_chunks_ending_once() -> None:
    body = bytes(range(256)) * 1000  # 256,000 bytes
    out = list(wire.request_body_chunks(body, 62_000))
    chunks = [m.request_body.response.body_mutation.streamed_response for m in out]
    assert all(len(c.body) <= 62_000 for c in chunks)
    assert b"".join(c.body for c in chunks) == body
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    empty = list(wire.request_body_chunks(b"", 62_000))
    assert len(empty) == 1
    assert empty[0].request_body.response.body_mutation.streamed_response.end_of_stream


def test_the_destination_answer_carries_the_same_value_as_header_and_metadata() -> None:
    answer = wire.destination_response("10.0.0.1:8000,10.0.0.2:8000", [], [])
    common = answer.request_headers.response
    assert common.clear_route_cache
    answer = wire.destination_response(
        "10.0.0.1:8000,10.0.0.2:8000",
        [(wire.DESTINATION, b"10.0.0.1:8000,10.0.0.2:8000")],
        [],
    )
    header = answer.request_headers.response.header_mutation.set_headers[0].header
    metadata = answer.dynamic_metadata.fields[wire.LB_NAMESPACE].struct_value
    assert header.raw_value.decode() == metadata.fields[wire.DESTINATION].string_value


def test_every_answer_names_the_message_it_answers_even_with_nothing_to_change() -> None:
    # An answer whose oneof is empty is "spurious" to Envoy: it fails the request with 500.
    assert wire.response_headers([]).WhichOneof("response") == "response_headers"
    set_one = wire.response_headers([("x-kvgate-replica", b"r0")])
    header = set_one.response_headers.response.header_mutation.set_headers[0].header
    assert (header.key, header.raw_value) == ("x-kvgate-replica", b"r0")
    for end in (False, True):
        assert wire.response_body(b"", end).WhichOneof("response") == "response_body"
    assert wire.EMPTY_REQUEST_TRAILERS.WhichOneof("response") == "request_trailers"
    assert wire.EMPTY_RESPONSE_TRAILERS.WhichOneof("response") == "response_trailers"
    assert wire.destination_response("10.0.0.1:8000", [], []).WhichOneof("response") == (
        "request_headers"
    )


def hinted(value: object) -> ProcessingRequest:
    request = ProcessingRequest()
    hint = Struct()
    hint.update({wire.SUBSET: value})
    request.metadata_context.filter_metadata[wire.SUBSET_NAMESPACE].CopyFrom(hint)
    return request


def test_the_subset_hint_is_a_list_or_a_comma_string() -> None:
    as_list = hinted(["10.0.0.1:8000", "10.0.0.2:8000"])
    as_text = hinted("10.0.0.1:8000, 10.0.0.2:8000")
    for request in (as_list, as_text):
        value = wire.metadata_value(request, wire.SUBSET_NAMESPACE, wire.SUBSET)
        assert wire.address_list(value) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert wire.address_list(wire.metadata_value(ProcessingRequest(), "x", "y")) is None
    assert (
        wire.address_list(wire.metadata_value(hinted(""), wire.SUBSET_NAMESPACE, wire.SUBSET)) == []
    )


def test_addresses_both_ways_follow_membership() -> None:
    assert address_of("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert address_of("http://[fd00::1]:8000/v1") == "[fd00::1]:8000"
    assert address_of("https://10.0.0.1") == "10.0.0.1:443"
    book = AddressBook()
    first = {ReplicaId("a"): ReplicaState(id=ReplicaId("a"), url="http://10.0.0.1:8000")}
    assert book.address(first, ReplicaId("a")) == "10.0.0.1:8000"
    assert book.replica(first, "10.0.0.1:8000") == "a"
    second = {ReplicaId("b"): ReplicaState(id=ReplicaId("b"), url="http://10.0.0.1:8000")}
    assert book.replica(second, "10.0.0.1:8000") == "b"
    assert book.replica(second, "10.0.0.9:1") is None


def test_immediate_answers_keep_the_error_body_and_say_why() -> None:
    answer = wire.immediate(
        429,
        [(b"content-type", b"application/json"), (b"content-length", b"2")],
        b"{}",
        "rejected-saturated",
    ).immediate_response
    assert answer.status.code == 429 and answer.body == b"{}"
    names = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
    assert names == {
        "content-type": b"application/json",
        wire.DROPPED_REASON: b"rejected-saturated",
    }
