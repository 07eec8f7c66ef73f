"""The history writer's recording side (``HistoryWriter.lines``): chunks appended without a
lock while the writer's thread takes batches, each written once, with the rank, stream,
cell and run it was recorded with; and batches spooled before chunks were kept as columns
still convert."""

from __future__ import annotations

import itertools
import threading

import pytest

import monarch_kernel
from monarch_kernel.history import places
from monarch_kernel.history.parquet_files import Batch, LineChunks, ParquetFiles
from monarch_kernel.history.writer import HistoryWriter

pytestmark = pytest.mark.timeout(120)


def _rows(root, mesh: str, run: str = "all") -> list[tuple]:
    df = monarch_kernel.history(mesh, root=root, run=run).sql(
        "SELECT run, rank, stream, cell, line FROM lines")
    return sorted(zip(df["run"], df["rank"], df["stream"], [c if isinstance(c, str) else None for c in df["cell"]],
                      df["line"], strict=True), key=repr)


def test_lines_recorded_while_batches_are_taken_are_each_written_once_with_their_columns(tmp_path):
    writer = HistoryWriter(tmp_path, "h", flush_s=0.01, max_bytes=1 << 30)  # its thread takes batches all along
    run = writer.begin_run("m")
    want = []
    try:
        def record() -> None:
            for i in range(6_000):
                rank, stream, cell = i % 4, ("stdout", "stderr")[i % 3 == 0], f"cell {i // 1000}" if i % 7 else None
                writer.cell = cell
                writer.lines("m", rank, stream, f"{i} a\n{i} b\n{i} c\n".encode())
                want.extend((run, rank, stream, cell, f"{i} {x}") for x in "abc")

        recorder = threading.Thread(target=record)
        recorder.start()
        recorder.join(timeout=100)
        writer.flush()
    finally:
        writer.close()
    assert _rows(tmp_path, "m") == sorted(want, key=repr)


def test_chunks_of_two_meshes_and_a_run_begun_between_go_each_to_their_run(tmp_path):
    writer = HistoryWriter(tmp_path, "h", flush_s=60.0, max_bytes=1 << 30)  # batches taken here alone
    try:
        first = writer.begin_run("a")
        other = writer.begin_run("b")
        writer.lines("a", 0, "stdout", b"a before\n")
        writer.lines("b", 1, "stderr", b"b one\nb two\n")
        second = writer.begin_run("a")  # a respawn: what comes from now on is the new run's
        writer.lines("a", 0, "stdout", b"a after\n")
        writer.lines("b", 1, "stdout", b"b three\n")
        writer.flush()
    finally:
        writer.close()
    assert first != second
    assert _rows(tmp_path, "a") == sorted([(first, 0, "stdout", None, "a before"),
                                          (second, 0, "stdout", None, "a after")], key=repr)
    assert _rows(tmp_path, "b") == sorted([(other, 1, "stderr", None, "b one"), (other, 1, "stderr", None, "b two"),
                                           (other, 1, "stdout", None, "b three")], key=repr)


def test_a_batch_spooled_with_chunks_as_tuples_still_converts(tmp_path):
    """A spool written by a recorder before chunks were kept as columns (a kernel upgraded
    while its spool waited) reads as it did."""
    run = places.new_run()
    chunks = [(1_700_000_000_000_000, 2, "stdout", "cell 3", b"old one\nold two\n"),
              (1_700_000_000_000_001, 2, "stderr", None, b"old three\n")]
    ParquetFiles().write(Batch(str(tmp_path), "h", 1 << 30, 1, {("old", run): {}}, {("old", run): chunks}, {}))
    assert _rows(tmp_path, "old") == sorted([(run, 2, "stderr", None, "old three"),
                                             (run, 2, "stdout", "cell 3", "old one"),
                                             (run, 2, "stdout", "cell 3", "old two")], key=repr)


class _Kept:
    """A sink that keeps the batches it is given (what the spool would hold)."""

    def __init__(self):
        self.batches: list[Batch] = []

    def write(self, batch: Batch | None, wait: bool) -> None:
        if batch is not None:
            self.batches.append(batch)

    def close(self) -> None:
        pass


def test_a_batch_holds_each_places_chunks_in_order_as_the_converter_reads_them(tmp_path):
    """What is pickled to the spool: a place's chunks as recorded, read by the converter as
    a few columns (``LineChunks``), each chunk with its own time, rank, stream and cell."""
    kept = _Kept()
    writer = HistoryWriter(tmp_path, "h", flush_s=60.0, max_bytes=1 << 30, sink=kept)
    run = writer.begin_run("m")
    try:
        for i in range(1000):
            writer.cell = f"cell {i // 500}"
            writer.lines("m", i % 4, "stderr" if i % 2 else "stdout", f"{i}\n".encode())
        writer.flush()
    finally:
        writer.close()
    [batch] = kept.batches
    assert list(batch.chunks) == [("m", run)]
    got = LineChunks.of(batch.chunks[("m", run)])
    assert len(got) == 1000
    assert bytes(got.data) == b"".join(f"{i}\n".encode() for i in range(1000))
    assert list(got.ends) == list(itertools.accumulate(len(f"{i}\n") for i in range(1000)))
    assert list(got.ranks) == [i % 4 for i in range(1000)]
    assert list(got.streams) == ["stderr" if i % 2 else "stdout" for i in range(1000)]
    assert list(got.cells) == [f"cell {i // 500}" for i in range(1000)]
    assert list(got.times) == sorted(got.times)


def test_a_files_lines_are_written_without_dictionary_or_statistics_its_other_columns_with(tmp_path):
    """A line is rarely repeated and never looked up by its min or max: trying a dictionary on
    it and keeping its statistics cost a quarter of a file's writing for nothing."""
    import pyarrow.parquet as pq

    run = places.new_run()
    chunks = [(1_700_000_000_000_000 + i, i % 2, "stdout", "cell 1", f"line {i} {'x' * (i % 50)}\n".encode())
              for i in range(2000)]
    ParquetFiles().write(Batch(str(tmp_path), "h", 1 << 30, 1, {("m", run): {}}, {("m", run): chunks}, {}))
    [path] = tmp_path.glob("m/*/h/lines-*.parquet")
    meta = pq.ParquetFile(path).metadata
    columns = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i) for i in range(meta.num_columns)}
    assert columns["line"].statistics is None
    assert not any("DICTIONARY" in e for e in columns["line"].encodings)
    assert columns["rank"].statistics is not None and columns["rank"].statistics.max == 1
    assert any("DICTIONARY" in e for e in columns["stream"].encodings)
