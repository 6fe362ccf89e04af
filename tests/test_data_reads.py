"""What a run reads of a parquet dataset before its first step (issue 61 item 7): its label and caption columns, and
the row groups of the pairs it trains on; never a conversion of the whole file into datasets' cache. The content
fingerprint still tells the data apart without reading every image."""

from __future__ import annotations

import io
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from align.data import parquet_rows
from align.data.pair_stream import open_pairs
from align.train import dpo
from align.train.dpo_config import DPOConfig
from align.train.dpo_data import PairOrder

GROUP_ROWS = 5  # rows per row group (files written by datasets hold ~100)


def png(seed: int, size: int = 16) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buffer = io.BytesIO()
    Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def write(path, count: int = 60, change=None):
    rows = [{"caption": f"shape {i % 7}", "jpg_0": png(2 * i), "jpg_1": png(2 * i + 1), "label_0": float(i % 2),
             "label_1": float(1 - i % 2)} for i in range(count)]
    if change:
        change(rows)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=GROUP_ROWS)
    return str(path)


@pytest.fixture
def groups_read(monkeypatch):
    """The row groups whose image columns are read (ParquetRows' one place that reads images)."""
    read: list[int] = []
    real = pq.ParquetFile.read_row_group

    def recording(self, index, columns=None, **kwargs):
        read.append(index)
        return real(self, index, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", recording)
    return read


def test_opening_a_parquet_file_reads_its_labels_and_two_row_groups_of_images(tmp_path, groups_read):
    table = open_pairs(write(tmp_path / "pairs.parquet"), cache_dir=str(tmp_path / "cache"))
    assert isinstance(table.dataset, parquet_rows.ParquetRows) and len(table) == 60
    assert sorted(set(groups_read)) == [0, 11]  # the fingerprint's samples: the first and the last row group
    assert not (tmp_path / "cache").exists()  # no conversion into datasets' cache
    groups_read.clear()
    pairs = [table.pair(k) for k in (20, 21, 22)]  # rows 20-22: one row group, read once
    assert groups_read == [4] and pairs[1].caption == "shape 0"


def test_the_fingerprint_follows_the_content_not_the_file(tmp_path):
    first = open_pairs(write(tmp_path / "a.parquet")).fingerprint
    moved = tmp_path / "elsewhere" / "b.parquet"
    moved.parent.mkdir()
    shutil.copy(tmp_path / "a.parquet", moved)
    assert open_pairs(str(moved)).fingerprint == first  # moved (and touched): the same data, the same store

    def flip_a_label(rows):
        rows[30]["label_0"], rows[30]["label_1"] = rows[30]["label_1"], rows[30]["label_0"]

    def another_image_in_the_middle(rows):  # outside the sampled row groups: seen through the chunk sizes
        rows[30]["jpg_0"] = png(999, size=18)

    def a_caption(rows):
        rows[31]["caption"] = "something else"

    for change in (flip_a_label, another_image_in_the_middle, a_caption):
        assert open_pairs(write(tmp_path / f"{change.__name__}.parquet", change=change)).fingerprint != first


def test_a_short_run_reads_the_row_groups_of_its_pairs_only(tmp_path, groups_read, tiny_model):
    data = write(tmp_path / "pairs.parquet", count=200)  # 40 row groups
    config = DPOConfig(model=tiny_model, dataset=data, output_dir=str(tmp_path / "run"), finetune="lora", lora_rank=4,
                       train_batch_size=2, gradient_accumulation_steps=1, max_steps=1, learning_rate=1e-3,
                       scale_lr=False, lr_warmup_steps=0, checkpointing_steps=10, report_to="none", resolution=16)
    dpo.train(config)
    order = PairOrder(200, config.seed)
    table = open_pairs(data)
    trained = {int(table.rows[order.index(i)]) // GROUP_ROWS for i in range(2)}  # the row groups of its two pairs
    assert set(groups_read) <= trained | {0, 39} and len(set(groups_read)) <= 4
