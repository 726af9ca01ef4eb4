"""Plain data across a trust boundary, decoded without running code.

What a student's process sends back (its results, its requests to the relay) is read
here: a frame is a JSON header and a block of raw bytes. Values are None, bools, ints,
floats, strings, lists, tuples, dicts and tensors of a listed dtype (a Parameter stays a
Parameter); a tensor is its dtype, shape and bytes, rebuilt with `torch.frombuffer`.
Anything else cannot be encoded, and a frame that is not exactly this is refused with
`CodecError`. Nothing is unpickled, imported or called while decoding.

    header, payload = encode(value); value = decode(header, payload)
    send_frame(sock, header, payload); header, payload = recv_frame(sock)
"""
from __future__ import annotations

import json
import math
import struct

import torch

__all__ = ["CodecError", "encode", "decode", "send_frame", "recv_frame", "DTYPES", "tensor_bytes", "tensor_from"]

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
MAX_HEADER = 16 * 2**20      # bytes of JSON in one frame
MAX_PAYLOAD = 2**31          # bytes of tensor data in one frame
MAX_DEPTH = 64               # nesting of containers in one value
_PREFIX = struct.Struct("!IQ")  # header length, payload length


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
            return {"i": str(v)}
        if type(v) is float:
            return {"f": repr(v)}
        if type(v) in (list, tuple):
            return {type(v).__name__: [walk(x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v)]}
        if type(v) is dict:
            return {"dict": [[walk(k, depth + 1, f"{where} key"), walk(x, depth + 1, f"{where}[{k!r}]")]
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


def decode(header: dict, payload: bytes):
    """The value `encode` made; CodecError for anything else."""
    def walk(node, depth):
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) not in (1, 3):
            raise CodecError("malformed value")
        (kind, body), = list(node.items())[:1]
        if kind == "v" and (body is None or type(body) in (bool, str)):
            return body
        if kind == "i" and type(body) is str and len(body) < 5000:
            return int(body)
        if kind == "f" and type(body) is str:
            return float(body)
        if kind in ("list", "tuple") and type(body) is list:
            items = [walk(x, depth + 1) for x in body]
            return items if kind == "list" else tuple(items)
        if kind == "dict" and type(body) is list:
            pairs = [(walk(k, depth + 1), walk(x, depth + 1)) for k, x in _pairs(body)]
            try:
                return dict(pairs)
            except TypeError:
                raise CodecError("unhashable dict key") from None
        if kind == "tensor" and len(node) == 3:
            start = node.get("at")
            if type(start) is not int or start < 0:
                raise CodecError("malformed tensor")
            tensor = tensor_from(body, payload, start)
            return torch.nn.Parameter(tensor, requires_grad=tensor.is_floating_point()) \
                if node.get("parameter") is True else tensor
        raise CodecError(f"malformed value of kind {kind!r}")

    if not isinstance(header, dict) or "value" not in header:
        raise CodecError("no value in the frame")
    return walk(header["value"], 0)


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
    """A new tensor from `meta` ({"dtype", "shape"}) and the bytes of payload at `start`."""
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES or type(meta.get("shape")) is not list:
        raise CodecError("malformed tensor description")
    shape = meta["shape"]
    if len(shape) > 16 or not all(type(s) is int and 0 <= s < 2**40 for s in shape):
        raise CodecError("malformed tensor shape")
    dtype = DTYPES[meta["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    if start + nbytes > len(payload):
        raise CodecError("tensor data past the end of the frame")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload[start:start + nbytes]), dtype=dtype).reshape(shape)


def send_frame(sock, header: dict, payload: bytes = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(len(data), len(payload)) + data + payload)


def recv_frame(sock) -> tuple[dict, bytes] | None:
    """The next frame, or None when the peer closed the connection between frames."""
    prefix = _recv_exact(sock, _PREFIX.size, eof_ok=True)
    if prefix is None:
        return None
    hlen, plen = _PREFIX.unpack(prefix)
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise CodecError(f"frame too large ({hlen:,} header bytes, {plen:,} data bytes)")
    try:
        header = json.loads(_recv_exact(sock, hlen))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CodecError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise CodecError("header is not a JSON object")
    return header, _recv_exact(sock, plen)


def _recv_exact(sock, n: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise CodecError("connection closed inside a frame")
        got += k
    return bytes(buf)
