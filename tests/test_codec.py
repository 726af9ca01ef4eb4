"""What a hostile rank can send the judge, and how strictly its answer is compared.

The frames are fed to `recv_frame` through a socketpair, as a rank's process would write
them; every refusal is a `CodecError` (what the judge catches), never a crash, a stall or
an allocation of the size a frame merely declares.
"""
import json
import socket
import struct
import threading
import time
import tracemalloc

import pytest
import torch

from parakit.grading import codec, compare_values

PREFIX = struct.Struct("!IQ")


def feed(data: bytes, close: bool = True) -> socket.socket:
    """The judge's end of a socketpair whose other end wrote `data` (then hung up, with `close`)."""
    judge, rank = socket.socketpair()
    threading.Thread(target=_write, args=(rank, data, close), daemon=True).start()
    return judge


def _write(sock, data, close):
    sock.sendall(data)
    if close:
        sock.close()
    else:
        time.sleep(5)


def frame_of(text: str, payload: bytes = b"", declared: int | None = None) -> bytes:
    data = text.encode()
    return PREFIX.pack(len(data), len(payload) if declared is None else declared) + data + payload


def peak_bytes(fn) -> int:
    """The most bytes Python's allocator held at once while fn() ran."""
    tracemalloc.start()
    try:
        fn()
    except codec.CodecError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


# ---------------------------------------------------------------------------- frames

def test_recv_frame_grows_memory_only_with_the_bytes_that_arrive():
    declared = 2**31  # what the rank claims; it sends 10 bytes and hangs up
    sock = feed(frame_of("{}", b"0123456789", declared))
    with pytest.raises(codec.CodecError, match=r"connection closed inside a frame \(10 of 2,147,483,648 bytes\)"):
        codec.recv_frame(sock, max_payload=declared)
    sock = feed(frame_of("{}", b"0123456789", declared))
    assert peak_bytes(lambda: codec.recv_frame(sock, max_payload=declared)) < 4 * 2**20


def test_recv_frame_refuses_more_data_than_its_cap_naming_both():
    sock = feed(frame_of("{}", b"", 2**31))
    with pytest.raises(codec.CodecError, match="2,147,483,648 bytes of tensor data in one frame are over the limit "
                                               "of 268,435,456"):
        codec.recv_frame(sock)
    sock = feed(frame_of("{}", b"x" * 1001))
    with pytest.raises(codec.CodecError, match="1,001 bytes of tensor data in one frame are over the limit of 1,000"):
        codec.recv_frame(sock, max_payload=1000)


def test_recv_frame_refuses_a_header_over_one_mib():
    sock = feed(PREFIX.pack(2**20 + 1, 0))
    with pytest.raises(codec.CodecError, match="a header of 1,048,577 bytes is over the limit of 1,048,576"):
        codec.recv_frame(sock)


def test_recv_frame_gives_up_on_a_rank_that_stops_inside_a_frame():
    sock = feed(frame_of("{}", b"01234", 100), close=False)
    start = time.monotonic()
    with pytest.raises(codec.CodecError, match=r"the frame did not arrive in time \(5 of 100 bytes\)"):
        codec.recv_frame(sock, timeout=0.3)
    assert time.monotonic() - start < 3  # a hang bound only: 10x the 0.3 s it waits out (0.30 s measured idle)
    assert sock.gettimeout() is None  # the socket is left blocking, as it was


@pytest.mark.parametrize("opening", ["[", "{\"a\":"])
def test_recv_frame_refuses_a_header_nested_100000_deep(opening):
    text = opening * 100_000 + "1" + ("]" if opening == "[" else "}") * 100_000
    sock = feed(frame_of(text))
    with pytest.raises(codec.CodecError, match="header nested deeper than 64 values allow"):
        codec.recv_frame(sock)


def test_recv_frame_counts_brackets_inside_strings_as_text():
    sock = feed(frame_of(json.dumps({"note": "[" * 10_000})))
    assert codec.recv_frame(sock) == ({"note": "[" * 10_000}, b"")


def test_recv_frame_reads_a_value_nested_as_deep_as_encode_allows():
    value = torch.ones(2)
    for _ in range(codec.MAX_DEPTH):
        value = {"k": value}
    header, payload = codec.encode(value)
    judge, rank = socket.socketpair()
    codec.send_frame(rank, {"result": header}, payload)
    got, data = codec.recv_frame(judge)
    back = codec.decode(got["result"], data)
    for _ in range(codec.MAX_DEPTH):
        back = back["k"]
    assert torch.equal(back, torch.ones(2))


@pytest.mark.parametrize("text, why", [
    ('{"id": ' + "9" * 5000 + "}", "header holds an int of 5,000 digits"),
    ("[1, 2]", "header is not a JSON object"),
    ('{"a": ', "header is not JSON"),
])
def test_recv_frame_refuses_malformed_headers_as_codec_errors(text, why):
    with pytest.raises(codec.CodecError, match=why):
        codec.recv_frame(feed(frame_of(text)))


def test_recv_frame_refuses_a_header_that_is_not_utf8():
    with pytest.raises(codec.CodecError, match="header is not JSON: 'utf-8' codec"):
        codec.recv_frame(feed(PREFIX.pack(2, 0) + b"\xff{"))


# ---------------------------------------------------------------------------- values

def test_encode_refuses_a_value_nested_100000_deep():
    value = []
    for _ in range(100_000):
        value = [value]
    with pytest.raises(codec.CodecError, match="nested deeper than 64"):
        codec.encode(value)
    loop = []
    loop.append(loop)
    with pytest.raises(codec.CodecError, match="nested deeper than 64"):
        codec.encode({"a": loop})


def test_encode_refuses_an_int_of_more_than_4300_digits():
    assert codec.decode(*codec.encode(-10**4299)) == -10**4299
    with pytest.raises(codec.CodecError, match=r"the result\[1\] is an int of more than 4300 digits"):
        codec.encode([0, 10**4300])


def tensor_node(shape, at=0, dtype="float32", parameter=False):
    return {"tensor": {"dtype": dtype, "shape": shape}, "at": at, "parameter": parameter}


@pytest.mark.parametrize("header, payload, why", [
    ({"value": tensor_node([0] + [2**39] * 15)}, b"", r"tensor shape \[0, 549755813888, .* is too large"),
    ({"value": {"list": [tensor_node([256])] * 1000}}, bytes(1024),
     "its data must start at byte 1,024, after the tensors before it"),
    ({"value": tensor_node([1])}, bytes(8), "4 bytes of tensor data that no tensor uses"),
    ({"value": tensor_node([1], parameter=1)}, bytes(4), "malformed tensor"),
    ({"value": {"i": "12abc"}}, b"", "malformed value of kind 'i'"),
    ({"value": {"i": "9" * 5000}}, b"", "malformed value of kind 'i'"),
    ({"value": {"f": "one"}}, b"", "malformed float 'one'"),
    ({"value": {"f": "1" * 100}}, b"", "malformed value of kind 'f'"),
    ({"value": {"v": "x", "tensor": 2, "at": 0}}, b"", "malformed value"),
    ({"value": {"dict": [[{"list": []}, {"v": "x"}]]}}, b"", "unhashable dict key"),
])
def test_decode_refuses_hostile_values_as_codec_errors(header, payload, why):
    with pytest.raises(codec.CodecError, match=why):
        codec.decode(header, payload)


def test_decode_keeps_nan_and_infinite_floats():
    back = codec.decode(*codec.encode([float("nan"), float("inf"), -float("inf")]))
    assert back[0] != back[0] and back[1:] == [float("inf"), -float("inf")]


# ---------------------------------------------------------------------------- comparisons

def differs(got, expected, rtol=None, atol=None) -> str:
    """compare_values' message, or "" where it finds them equal."""
    try:
        compare_values(got, expected, "f", rtol, atol)
    except AssertionError as error:
        return str(error)
    return ""


def test_compare_values_tells_a_nested_tuple_from_a_list():
    assert differs([[1, 2]], [(1, 2)]) == "f: item [0] is a list, the reference's a tuple"
    assert differs({"a": (torch.ones(2),)}, {"a": [torch.ones(2)]}) == "f: item ['a'] is a tuple, the reference's a list"


def test_compare_values_finds_equal_strings_equal():
    assert differs(["ring", "tree"], ["ring", "tree"]) == ""
    assert differs({"algo": "ring"}, {"algo": "tree"}) == "f: item ['algo'] is 'ring', the reference's 'tree'"


def test_compare_values_does_not_pass_zeros_for_values_below_atol():
    expected = torch.full((4,), 1e-7)
    assert differs(torch.zeros(4), expected) == (
        "f: 4 of 4 elements differ, the first at [0] (got 0, expected 1e-07); the reference's values are all below "
        "atol 1e-05, so atol counts at their scale: 1e-12")
    assert differs(expected * (1 + 1e-7), expected) == ""
    assert differs(0.0, 1e-9) == "f: the result is 0.0, the reference's 1e-09"


def test_compare_values_keeps_atol_for_an_all_zero_reference():
    assert differs(torch.full((3,), 1e-6), torch.zeros(3)) == ""


def test_compare_values_names_missing_and_extra_dict_keys():
    assert differs({"a": 1}, {"a": 1, "b": 2}) == "f: the result lacks the key 'b'"
    assert differs({"a": 1, "c": 3}, {"a": 1}) == "f: the result has a key 'c' the reference's does not"


@pytest.mark.parametrize("got, expected, why", [
    ([True], [1], "item [0] is a bool, the reference's a int"),
    ([1.0], [1], "item [0] is a float, the reference's a int"),
    ([float("nan")], [float("nan")], "item [0] is nan, the reference's nan"),
    ((torch.ones(2, dtype=torch.int64),), (torch.ones(2),), "item [0]: a torch.int64 tensor of shape [2]"),
])
def test_compare_values_keeps_types_and_refuses_nan(got, expected, why):
    assert why in differs(got, expected)


def test_compare_values_keeps_the_first_differing_element():
    expected = torch.arange(8.0).view(2, 4)
    got = expected.clone()
    got[1, 2] += 1
    assert differs((got,), (expected,)) == \
        "f: item [0]: 1 of 8 elements differ, the first at [1, 2] (got 7, expected 6)"
