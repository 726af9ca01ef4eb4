"""Plain data across a trust boundary, decoded without running code.

What a student's process sends back (its results, its requests to the relay) is read
here: a frame is a JSON header and a block of raw bytes. Values are None, bools, ints,
floats, strings, lists, tuples, dicts and tensors of a listed dtype (a Parameter stays a
Parameter); a tensor is its dtype, shape and bytes, rebuilt with `torch.frombuffer`.
Anything else cannot be encoded, and a frame that is not exactly this is refused with
`CodecError`. Nothing is unpickled, imported or called while decoding.

A frame comes from a process the judge does not trust, so reading one is bounded: its
bytes are read in chunks as they arrive (never allocated from the declared size), under a
cap on the header and on the data that the reader can set, and within a deadline if given;
a header nested deeper than values may be is refused before it is parsed; the tensors must
tile the data in order, each byte used once, so a small frame cannot decode into a large value.

    header, payload = encode(value); value = decode(header, payload)
    send_frame(sock, header, payload); header, payload = recv_frame(sock)
"""
from __future__ import annotations

import itertools
import json
import math
import re
import reprlib
import socket
import struct
import time

import torch

__all__ = ["CodecError", "encode", "decode", "send_frame", "recv_frame", "DTYPES", "tensor_bytes", "tensor_from"]

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
MAX_HEADER = 2**20           # bytes of JSON in one frame
MAX_PAYLOAD = 256 * 2**20    # bytes of tensor data in one frame (recv_frame's default cap)
MAX_DEPTH = 64               # nesting of containers in one value
MAX_DIGITS = 4300            # digits of one int (Python's own limit on int <-> str)
_JSON_DEPTH = 3 * MAX_DEPTH + 16  # brackets: a dict's value sits 3 deeper ({"dict": [[k, v]]}), a shape 2
_JSON_INT = 30               # digits of an int in a header (ids, ranks, sizes, offsets)
_CHUNK = 2**20               # bytes asked of the socket at a time
_PREFIX = struct.Struct("!IQ")  # header length, payload length
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_INT = re.compile(r"-?[0-9]+")


class CodecError(ValueError):
    """A value that is not plain data, or a frame that is not well formed."""


def encode(value) -> tuple[dict, bytes]:
    """(header, payload) of a plain value; CodecError names the first part that is not plain."""
    chunks: list[bytes] = []
    offset = [0]

    def walk(v, depth, where):
        if depth > MAX_DEPTH:
            raise CodecError(f"{where}: nested deeper than {MAX_DEPTH}")
        if v is None or type(v) in (bool, str):
            return {"v": v}
        if type(v) is int:
            return {"i": _digits(v, where)}
        if type(v) is float:
            return {"f": repr(v)}
        if type(v) in (list, tuple):
            return {type(v).__name__: [walk(x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v)]}
        if type(v) is dict:
            return {"dict": [[walk(k, depth + 1, f"{where} key"), walk(x, depth + 1, f"{where}[{reprlib.repr(k)}]")]
                             for k, x in v.items()]}
        if isinstance(v, torch.Tensor) and type(v) in (torch.Tensor, torch.nn.Parameter):
            data = tensor_bytes(v)
            chunks.append(data)
            offset[0] += len(data)
            return {"tensor": tensor_meta(v), "at": offset[0] - len(data),
                    "parameter": type(v) is torch.nn.Parameter}
        raise CodecError(f"{where} is a {type(v).__module__}.{type(v).__qualname__}: only None, bools, ints, "
                         f"floats, strings, lists, tuples, dicts and plain tensors can be sent back")

    return {"value": walk(value, 0, "the result")}, b"".join(chunks)


def _digits(v: int, where: str) -> str:
    try:
        text = str(v) if v.bit_length() < 3.33 * MAX_DIGITS else ""
    except ValueError:  # past the limit this interpreter sets on int -> str
        text = ""
    if not text or len(text.lstrip("-")) > MAX_DIGITS:
        raise CodecError(f"{where} is an int of more than {MAX_DIGITS} digits")
    return text


def decode(header: dict, payload: bytes):
    """The value `encode` made; CodecError for anything else (tensors must use the data
    in order, every byte once)."""
    offset = [0]

    def walk(node, depth):
        if depth > MAX_DEPTH:
            raise CodecError(f"value nested deeper than {MAX_DEPTH}")
        if not isinstance(node, dict) or not node:
            raise CodecError("malformed value")
        (kind, body), = list(node.items())[:1]
        if len(node) != (3 if kind == "tensor" else 1):
            raise CodecError("malformed value")
        if kind == "v" and (body is None or type(body) in (bool, str)):
            return body
        if kind == "i" and type(body) is str and _INT.fullmatch(body) and len(body) <= MAX_DIGITS + 1:
            return int(body)
        if kind == "f" and type(body) is str and len(body) <= 32:
            return _float(body)
        if kind in ("list", "tuple") and type(body) is list:
            items = [walk(x, depth + 1) for x in body]
            return items if kind == "list" else tuple(items)
        if kind == "dict" and type(body) is list:
            pairs = [(walk(k, depth + 1), walk(x, depth + 1)) for k, x in _pairs(body)]
            try:
                return dict(pairs)
            except TypeError:
                raise CodecError("unhashable dict key") from None
        if kind == "tensor":
            return _tensor_node(node, payload, offset)
        raise CodecError(f"malformed value of kind {kind!r}")

    if not isinstance(header, dict) or "value" not in header:
        raise CodecError("no value in the frame")
    value = walk(header["value"], 0)
    if offset[0] != len(payload):
        raise CodecError(f"{len(payload) - offset[0]:,} bytes of tensor data that no tensor uses")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise CodecError(f"malformed float {text!r}") from None


def _tensor_node(node: dict, payload: bytes, offset: list[int]) -> torch.Tensor:
    if node.get("at") != offset[0] or type(node.get("at")) is not int or type(node.get("parameter")) is not bool:
        raise CodecError(f"malformed tensor: its data must start at byte {offset[0]:,}, after the tensors before it")
    tensor = tensor_from(node["tensor"], payload, offset[0])
    offset[0] += tensor.numel() * tensor.element_size()
    if node["parameter"]:
        return torch.nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
    return tensor


def _pairs(body):
    for pair in body:
        if type(pair) is not list or len(pair) != 2:
            raise CodecError("malformed dict")
        yield pair


def tensor_meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as raw bytes, row-major, on the CPU."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes()


def tensor_from(meta, payload: bytes, start: int = 0) -> torch.Tensor:
    """A new tensor from `meta` ({"dtype", "shape"}) and the bytes of payload at `start`;
    the shape is checked against the bytes before anything is allocated."""
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES or type(meta.get("shape")) is not list:
        raise CodecError("malformed tensor description")
    shape = meta["shape"]
    if len(shape) > 16 or not all(type(s) is int and 0 <= s < 2**40 for s in shape):
        raise CodecError("malformed tensor shape")
    if math.prod(max(s, 1) for s in shape) >= 2**62:  # torch's strides would overflow, even with no elements
        raise CodecError(f"tensor shape {shape} is too large")
    dtype = DTYPES[meta["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    if type(start) is not int or start < 0 or start + nbytes > len(payload):
        raise CodecError("tensor data past the end of the frame")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload[start:start + nbytes]), dtype=dtype).reshape(shape)


def send_frame(sock, header: dict, payload: bytes = b"") -> None:
    """Send one frame to the peer: a 12-byte prefix, the header's JSON, then len(payload) bytes."""
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(len(data), len(payload)) + data + payload)


def recv_frame(sock, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD,
               timeout: float | None = None) -> tuple[dict, bytes] | None:
    """The next frame, or None when the peer closed the connection between frames.

    CodecError for a frame over `max_header` or `max_payload` bytes (before reading it), a
    header that is not a JSON object or is nested too deep, or a frame not whole within
    `timeout` s. Memory grows only with the bytes that arrive."""
    deadline = None if timeout is None else time.monotonic() + timeout
    prefix = _recv_exact(sock, _PREFIX.size, deadline, eof_ok=True)
    if prefix is None:
        return None
    hlen, plen = _PREFIX.unpack(prefix)
    if hlen > max_header:
        raise CodecError(f"a header of {hlen:,} bytes is over the limit of {max_header:,}")
    if plen > max_payload:
        raise CodecError(f"{plen:,} bytes of tensor data in one frame are over the limit of {max_payload:,}")
    header = _parse_header(_recv_exact(sock, hlen, deadline))
    return header, _recv_exact(sock, plen, deadline)


def _parse_header(data: bytes) -> dict:
    """The header's JSON object; its depth is measured on the text before json parses it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CodecError(f"header is not JSON: {error}") from None
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if brackets and max(itertools.accumulate(map(_STEP.__getitem__, brackets))) > _JSON_DEPTH:
        raise CodecError(f"header nested deeper than {MAX_DEPTH} values allow ({_JSON_DEPTH} brackets)")
    try:
        header = json.loads(text, parse_int=_json_int)
    except (json.JSONDecodeError, RecursionError) as error:
        raise CodecError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise CodecError("header is not a JSON object")
    return header


def _json_int(text: str) -> int:
    if len(text) > _JSON_INT:
        raise CodecError(f"header holds an int of {len(text):,} digits (at most {_JSON_INT})")
    return int(text)


def _recv_exact(sock, n: int, deadline: float | None, eof_ok: bool = False) -> bytes | None:
    """n bytes from sock, read in chunks of at most 1 MiB as they arrive (by `deadline`)."""
    chunks, got, previous = [], 0, sock.gettimeout()
    try:
        while got < n:
            if deadline is not None:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                chunk = sock.recv(min(n - got, _CHUNK))
            except socket.timeout:
                raise CodecError(f"the frame did not arrive in time ({got:,} of {n:,} bytes)") from None
            if not chunk:
                if eof_ok and got == 0:
                    return None
                raise CodecError(f"connection closed inside a frame ({got:,} of {n:,} bytes)")
            chunks.append(chunk)
            got += len(chunk)
    finally:
        if deadline is not None:
            sock.settimeout(previous)
    return b"".join(chunks)
