"""The writer processes of `test_records_concurrency`, in a module of their own so that each
spawned process imports only the records database (not the tests' models and tuning)."""

from __future__ import annotations

from gimlet_tvm.schedules.tuning.records import Record, RecordsDB

SCALE = 1e-6  # a record's run times carry its (writer, batch, item) as multiples of this


def make_batch(entry: tuple[list, list], writer: int, batch: int, size: int) -> list[tuple[list, list]]:
    """`size` copies of `entry`'s record, each tagged with (writer, batch, item)."""
    workload, record = entry
    return [(workload, [record[0], [(writer + 1) * SCALE, (batch + 1) * SCALE, (item + 1) * SCALE],
                        *record[2:]]) for item in range(size)]


def tag(record: Record) -> tuple[int, int, int]:
    """(writer, batch, item) of a record `make_batch` made."""
    writer, batch, item = (round(s / SCALE) - 1 for s in record.data[1])
    return writer, batch, item


def write_batches(path: str, entry: tuple[list, list], writer: int, batches: int, size: int,
                  report=None) -> None:
    """Append `batches` batches, one `add` each; after each, send its number to `report`."""
    db = RecordsDB(path)
    for batch in range(batches):
        db.add(make_batch(entry, writer, batch, size), dedupe=False)
        if report is not None:
            report.send(batch)  # only after `add` returned: this batch is finished
