"""Parquet files a run writes and reads back (AI feedback), sealed by a digest of their rows.

The digest covers every value of every row, in row order, whatever the file's row groups; it is kept in the file's
own key-value metadata, so the file and its seal are written (and replaced) as one. A file read back is hashed again:
a file without the seal (edited by hand, written by a version before files were sealed) or whose rows changed is
refused in one line by the caller, never trained on.
"""

from __future__ import annotations

import hashlib
import math
import struct
from pathlib import Path

DIGEST_KEY = b"t2i_align.rows_sha256"


class RowDigest:
    """sha256 over the rows of Arrow tables fed in order: the column names, then each value, type-tagged and
    length-prefixed (so no two different rows hash alike by running into each other)."""

    def __init__(self, names: list[str]):
        self._hash = hashlib.sha256(b"rows-v1")
        for name in names:
            self._value(name)
        self.names = list(names)

    def update(self, table) -> None:
        if list(table.column_names) != self.names:
            raise ValueError(f"columns {table.column_names} differ from the digest's {self.names}")
        for batch in table.to_batches():
            columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            for row in zip(*columns):
                for value in row:
                    self._value(value)

    def _value(self, value) -> None:
        update = self._hash.update
        if value is None:
            update(b"n")
        elif isinstance(value, bool):
            update(b"t" if value else b"f")
        elif isinstance(value, int):
            update(b"i" + struct.pack("<q", value))
        elif isinstance(value, float):
            update(b"d" + (b"nan" if math.isnan(value) else struct.pack("<d", value)))
        elif isinstance(value, str):
            data = value.encode("utf-8")
            update(b"s" + struct.pack("<q", len(data)) + data)
        elif isinstance(value, bytes):
            update(b"b" + struct.pack("<q", len(value)) + value)
        else:
            raise TypeError(f"cannot digest a {type(value).__name__} cell")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def table_digest(table) -> str:
    digest = RowDigest(table.column_names)
    digest.update(table)
    return digest.hexdigest()


class SealedParquetWriter:
    """pyarrow's ParquetWriter that seals what it wrote: tables are written (and hashed) in order, and the digest
    of their rows goes into the file's key-value metadata when it is closed. Write to a temporary path of an
    atomic write (align.run_folder.atomic_path): an unclosed file is never in place."""

    def __init__(self, path: str | Path, schema):
        import pyarrow.parquet as pq

        self._writer = pq.ParquetWriter(str(path), schema)
        self._digest = RowDigest(schema.names)

    def write_table(self, table) -> None:
        self._digest.update(table)
        self._writer.write_table(table)

    def __enter__(self) -> SealedParquetWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self._writer.add_key_value_metadata({DIGEST_KEY: self._digest.hexdigest().encode()})
        self._writer.close()


def write_sealed_table(table, path: str | Path) -> None:
    """Write ``table`` to ``path`` (a temporary path of an atomic write) sealed by its rows' digest."""
    with SealedParquetWriter(path, table.schema) as writer:
        writer.write_table(table)


def sealed_problem(path: str | Path) -> str | None:
    """Why the parquet file at ``path`` cannot be trusted (unreadable, no seal, rows changed), or None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
        recorded = (handle.metadata.metadata or {}).get(DIGEST_KEY)
        if recorded is None:
            return "carries no digest of its rows (edited, or written by a version before files were sealed)"
        digest = RowDigest(handle.schema_arrow.names)
        for batch in handle.iter_batches(batch_size=256):
            digest.update(pa.Table.from_batches([batch]))
    except (pa.ArrowException, OSError) as err:
        return f"is not a readable parquet file ({type(err).__name__}: {err})"
    if digest.hexdigest() != recorded.decode():
        return "has changed since it was written (the digest of its rows does not match)"
    return None


__all__ = ["DIGEST_KEY", "RowDigest", "SealedParquetWriter", "sealed_problem", "table_digest", "write_sealed_table"]
