"""One whole-number column of an Arrow IPC file (the stream format `datasets` writes, or the file format), read by
its messages with the standard library (Python 3.8 and later, like the rest of worker/hostside/), seeking to that
column's buffers only: the token lengths of a speculators dataset (worker/hostside/totals.py). Anything it cannot
follow is `Unreadable`, never a guess."""

import struct
from array import array

# more rows than this are not read for their lengths (the total stays unknown; a run that large states it)
MAX_ROWS = 50_000_000


class Unreadable(Exception):
    """What could not be read, said to the user as is."""


class _Table:
    """A flatbuffer table: its fields by index, read from `buf`."""

    def __init__(self, buf, pos):
        self.buf, self.pos = buf, pos
        vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        size = struct.unpack_from("<H", buf, vtable)[0]
        self.offsets = [struct.unpack_from("<H", buf, vtable + 4 + 2 * i)[0] for i in range((size - 4) // 2)]

    def _at(self, field):
        off = self.offsets[field] if field < len(self.offsets) else 0
        return self.pos + off if off else None

    def scalar(self, field, fmt, default=0):
        at = self._at(field)
        return default if at is None else struct.unpack_from("<" + fmt, self.buf, at)[0]

    def table(self, field):
        at = self._at(field)
        return None if at is None else _Table(self.buf, at + struct.unpack_from("<I", self.buf, at)[0])

    def vector(self, field):
        """(start, length) of a vector field."""
        at = self._at(field)
        if at is None:
            return 0, 0
        start = at + struct.unpack_from("<I", self.buf, at)[0]
        return start + 4, struct.unpack_from("<I", self.buf, start)[0]

    def tables(self, field):
        start, n = self.vector(field)
        return [_Table(self.buf, start + 4 * i + struct.unpack_from("<I", self.buf, start + 4 * i)[0])
                for i in range(n)]

    def string(self, field):
        start, n = self.vector(field)
        return self.buf[start: start + n].decode("utf-8", "replace")


# Arrow's Type union (format/Schema.fbs) by the buffers each layout has (format/Columnar.md), and the message
# headers (format/Message.fbs)
_BUFFERS = {1: 0, 2: 2, 3: 2, 4: 3, 5: 3, 6: 2, 7: 2, 8: 2, 9: 2, 10: 2, 11: 2, 12: 2, 13: 1, 15: 2, 16: 1, 17: 2,
            18: 2, 19: 3, 20: 3, 21: 2}
_INT, _SCHEMA, _DICTIONARY, _RECORD_BATCH = 2, 1, 2, 3


def _span(field):
    """The nodes and buffers a field and the fields within it take in a record batch (depth-first), or None for a
    layout this reader does not follow (a union, a view, a dictionary-encoded field)."""
    kind = field.scalar(2, "B")
    if kind not in _BUFFERS or field.table(4) is not None:
        return None
    nodes, buffers = 1, _BUFFERS[kind]
    for child in field.tables(5):
        inner = _span(child)
        if inner is None:
            return None
        nodes, buffers = nodes + inner[0], buffers + inner[1]
    return nodes, buffers


def _layout(schema):
    """Each column of the schema: (name, type, int bits, signed, (nodes, buffers) or None)."""
    out = []
    for field in schema.tables(1):
        kind, bits, signed = field.scalar(2, "B"), 0, False
        if kind == _INT:
            t = field.table(3)
            bits, signed = t.scalar(0, "i"), bool(t.scalar(1, "B"))
        out.append((field.string(0), kind, bits, signed, _span(field)))
    return out


def _messages(f):
    """Each IPC message of an Arrow stream or file: (its flatbuffer, where its body starts)."""
    head = f.read(8)
    if head[:6] != b"ARROW1":
        f.seek(0)
    while True:
        prefix = f.read(4)
        if len(prefix) < 4:
            return
        size = struct.unpack("<i", prefix)[0]
        if size == -1:  # the continuation marker of format version 5
            prefix = f.read(4)
            if len(prefix) < 4:
                return
            size = struct.unpack("<i", prefix)[0]
        if size == 0:
            return  # end of stream
        if size < 0 or size > 64 << 20:
            raise Unreadable(f"not an Arrow IPC message (a metadata length of {size})")
        meta = f.read(size)
        if len(meta) < size:
            raise Unreadable("an Arrow message cut short")
        message = _Table(meta, struct.unpack_from("<I", meta, 0)[0])
        body = f.tell()
        yield message, body
        f.seek(body + message.scalar(3, "q"))


def arrow_column(path, column):
    """The values of the whole-number `column` in the Arrow file at `path`, in row order (nulls as 0)."""
    values = array("q")
    layout = None
    with open(path, "rb") as f:
        for message, body in _messages(f):
            kind, header = message.scalar(1, "B"), message.table(2)
            if kind == _SCHEMA:
                layout = _layout(header)
            elif kind == _RECORD_BATCH:
                if layout is None:
                    raise Unreadable("a record batch before the schema")
                if header.table(3) is not None:
                    raise Unreadable("compressed record batches")
                _batch_column(f, header, body, layout, column, values)
                if len(values) > MAX_ROWS:
                    raise Unreadable(f"more than {MAX_ROWS} rows")
            elif kind != _DICTIONARY:
                raise Unreadable(f"an Arrow message of kind {kind}")
    if layout is None:
        raise Unreadable("no Arrow schema")
    return values


def _batch_column(f, header, body, layout, column, values):
    rows = header.scalar(0, "q")
    nodes_at, node_count = header.vector(1)
    buffers_at, buffer_count = header.vector(2)
    node, buffer = 0, 0
    for name, kind, bits, signed, span in layout:
        if name == column:
            if kind != _INT or bits not in (8, 16, 32, 64) or span != (1, 2):
                raise Unreadable(f"column `{column}` is not a whole number")
            if node >= node_count or buffer + 1 >= buffer_count:
                raise Unreadable("a record batch with fewer columns than its schema")
            length, nulls = struct.unpack_from("<qq", header.buf, nodes_at + 16 * node)
            validity = struct.unpack_from("<qq", header.buf, buffers_at + 16 * buffer)
            data = struct.unpack_from("<qq", header.buf, buffers_at + 16 * (buffer + 1))
            if length != rows:
                raise Unreadable(f"column `{column}` is not one value per row")
            f.seek(body + data[0])
            chunk = array(("bhiq" if signed else "BHIQ")[(8, 16, 32, 64).index(bits)])
            chunk.frombytes(f.read(length * bits // 8))
            if len(chunk) != length:
                raise Unreadable(f"column `{column}` cut short")
            if nulls and validity[1]:
                f.seek(body + validity[0])
                bitmap = f.read(validity[1])
                chunk = [v if j >> 3 < len(bitmap) and bitmap[j >> 3] >> (j & 7) & 1 else 0
                         for j, v in enumerate(chunk)]
            values.extend(int(v) for v in chunk)
            return
        if span is None:
            raise Unreadable(f"a column of a layout this reader does not follow before `{column}`")
        node, buffer = node + span[0], buffer + span[1]
    raise Unreadable(f"no column `{column}`")
