"""The rows of local parquet files, read where they lie: no conversion into `datasets`' Arrow cache.

`datasets.load_dataset("parquet", ...)` rewrites the whole source into its cache before the first row can be read:
a read (and a write) of every image before a run's first step, hundreds of GB for Pick-a-Pic. Here only what is
asked is read:

- a column read whole (the labels, the captions) reads that column's chunks alone (parquet is columnar);
- the images of a row read its row group's image columns (the smallest unit a parquet reader can decode: a row
  group holds ~100 rows in files written by `datasets`), kept until a row of another group is asked for, so rows
  read in order (a latent store's build) read each row group once.

So a run reads its label and caption columns, and the row groups of the pairs it trains on. The trade-off: without a
latent store (``--latent_store none``), pairs are read in the training order, one row group for each, so a run over
a large part of a big dataset reads its row groups many times over (a store, or a ``save_to_disk`` folder, which is
memory-mapped row by row, avoids that; docs/scale.md).
"""

from __future__ import annotations

import bisect
import hashlib
from pathlib import Path

import numpy as np

from align.data.pairs import DataError

IMAGE_COLUMNS = ("jpg_0", "jpg_1")


class ParquetRows:
    """The rows of ``files`` (in order) as one table. Pickles without its open files (DataLoader workers reopen)."""

    def __init__(self, files: list[str | Path]):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.files = [str(f) for f in files]
        self.starts: list[int] = []  # the first row of each row group, over all files
        self.groups: list[tuple[int, int]] = []  # (file, row group) of each
        self.sizes: list[int] = []
        self.metadata = []
        total = 0
        names = None
        for number, path in enumerate(self.files):
            try:
                meta = pq.read_metadata(path)
            except (pa.ArrowException, OSError) as err:
                raise DataError(f"cannot read {path} as parquet: {err}") from err
            own = meta.schema.to_arrow_schema().names
            if names is not None and own != names:
                raise DataError(f"{path} has other columns ({', '.join(own)}) than {self.files[0]} ({', '.join(names)})")
            names = own
            self.metadata.append(meta)
            self.sizes.append(Path(path).stat().st_size)
            for group in range(meta.num_row_groups):
                self.starts.append(total)
                self.groups.append((number, group))
                total += meta.row_group(group).num_rows
        self.column_names = list(names or [])
        self.num_rows = total
        self._handles: dict[int, object] = {}
        self._group: tuple[int, object] | None = None  # (row group index, its image columns)
        self._captions = None  # the caption column, read once when first asked for (kept by workers' copies)

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}, "_group": None}

    def __len__(self) -> int:
        return self.num_rows

    def _file(self, number: int):
        import pyarrow.parquet as pq

        if number not in self._handles:
            self._handles[number] = pq.ParquetFile(self.files[number])
        return self._handles[number]

    def column(self, name: str):
        """One column of every row (a pyarrow ChunkedArray), reading that column's chunks only."""
        import pyarrow as pa

        chunks = [self._file(n).read(columns=[name]).column(name) for n in range(len(self.files))]
        return pa.chunked_array([c for chunked in chunks for c in chunked.chunks], type=chunks[0].type)

    def locate(self, row: int) -> tuple[int, int]:
        """(row group index, row within it) of a row."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} of {self.num_rows}")
        index = bisect.bisect_right(self.starts, row) - 1
        return index, row - self.starts[index]

    def caption(self, row: int):
        if self._captions is None:
            self._captions = self.column("caption")
        return self._captions[row].as_py()

    def images(self, row: int) -> tuple:
        """The row's jpg_0 and jpg_1 values (bytes, or datasets' {bytes, path} dicts), read with their row group."""
        index, within = self.locate(row)
        if self._group is None or self._group[0] != index:
            self._group = None  # let go of the previous group before the next one is read
            number, group = self.groups[index]
            self._group = (index, self._file(number).read_row_group(group, columns=list(IMAGE_COLUMNS)))
        table = self._group[1]
        return tuple(table.column(name)[within].as_py() for name in IMAGE_COLUMNS)

    def reopened(self) -> ParquetRows:
        """The same rows without the open files and the row group held (their memory let go)."""
        fresh = ParquetRows.__new__(ParquetRows)
        fresh.__dict__.update(self.__getstate__())
        return fresh

    def layout_digest(self) -> hashlib._Hash:
        """sha256 over what the files' footers say of their content: each file's size, and each row group's rows and
        each column chunk's compressed and uncompressed sizes (no path, no file time; the images themselves are
        not read)."""
        digest = hashlib.sha256(b"parquet-layout-v1")
        for size, meta in zip(self.sizes, self.metadata):
            digest.update(np.array([size, meta.num_rows, meta.num_row_groups], dtype=np.int64).tobytes())
            for group in range(meta.num_row_groups):
                group_meta = meta.row_group(group)
                values = [group_meta.num_rows]
                for column in range(group_meta.num_columns):
                    chunk = group_meta.column(column)
                    values += [chunk.total_compressed_size, chunk.total_uncompressed_size, chunk.num_values]
                digest.update(np.array(values, dtype=np.int64).tobytes())
        return digest


__all__ = ["IMAGE_COLUMNS", "ParquetRows"]
