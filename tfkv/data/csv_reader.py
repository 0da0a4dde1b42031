"""CSV files, streamed: `dataset._target_: tfkv.data.csv_reader.load`.

`label` names the column that is y; `select` the columns that make x (default: every other
column). Column types are read from the first rows (int64, float32 or string) unless `dtypes`
says; with `pack` (default) the selected columns become one float32 vector per row, what a
dense model takes, else x is a dict of columns (one Keras input each). Rows are read by
`tf.data.experimental.CsvDataset` (the file list shuffled by (seed, epoch)), dealt to
workers before they are batched, shuffled through a bounded buffer, and turned into tensors a
batch at a time in a parallel map. Rows are counted once per file while it is unchanged. A row
that does not fit (a field missing, one that is not a number, bytes that are not UTF-8) is one
line naming the file and the line, whether counting or reading finds it.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Sequence

import tensorflow as tf

from tfkv.data import streaming
from tfkv.data.base import Context
from tfkv.errors import ConfigError, DataError, with_article

DTYPES = {"int64": tf.int64, "float32": tf.float32, "string": tf.string}
INFER_ROWS = 100  # rows read to guess column types, as make_csv_dataset's num_rows_for_inference
_COUNTS: dict = {}


def _rows(path: str, delimiter: str):
    with tf.io.gfile.GFile(path, "r") as f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            yield from (row for row in reader if row)
        except (UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"dataset.files: line {reader.line_num + 1} of {path} cannot be read as CSV ({e}); "
                            "fix or replace the file") from None


def damaged(paths: Sequence[str], names: list[str], types: Mapping[str, str], wanted: Sequence[int],
            header: bool, delimiter: str) -> str | None:
    """The line for the first row of `paths` that CsvDataset cannot read (a field missing or
    extra, a wanted field empty or not of its column's type), or None. Read only after reading
    failed: TensorFlow's error names neither the file nor the row."""
    for path in paths:
        rows = _rows(path, delimiter)
        if header:
            next(rows, None)
        for i, row in enumerate(rows, 1 + header):
            if len(row) != len(names):
                return (f"dataset.files: row {i} of {path} has {len(row)} fields, not {len(names)} "
                        f"({', '.join(names)}); fix the row or remove it")
            for k in wanted:
                name, kind, value = names[k], types[names[k]], row[k]
                if value and (kind == "string" or _infer(value) in ("int64", kind)):
                    continue
                return (f"dataset.files: row {i} of {path} has {value!r} in column {name!r}, not "
                        f"{'a value' if kind == 'string' else with_article(kind) + ' number'}; fix the row or remove it")
    return None


def _header(path: str, delimiter: str) -> list[str]:
    first = next(_rows(path, delimiter), None)
    if first is None:
        raise DataError(f"dataset.files: {path} is empty; remove it or write its header and rows")
    return [c.strip() for c in first]


def _infer(value: str) -> str:
    for name, cast in (("int64", int), ("float32", float)):
        try:
            cast(value)
            return name
        except ValueError:
            pass
    return "string"


def _column_types(path: str, names: list[str], header: bool, delimiter: str,
                  given: Mapping[str, str]) -> dict[str, str]:
    """Each column's type: `given`, else the widest of int64 < float32 < string in the first rows."""
    rank = ["int64", "float32", "string"]
    seen = {n: 0 for n in names}
    rows = _rows(path, delimiter)
    if header:
        next(rows, None)
    for i, row in enumerate(rows):
        if i == INFER_ROWS:
            break
        if len(row) != len(names):
            raise DataError(f"dataset.files: row {i + 1 + header} of {path} has {len(row)} fields, the header "
                            f"{len(names)}; fix the file (or dataset.column_names)")
        for n, v in zip(names, row):
            seen[n] = max(seen[n], rank.index(_infer(v)))
    types = {n: rank[r] for n, r in seen.items()}
    for n, t in given.items():
        if n not in types:
            raise ConfigError(f"dataset.dtypes.{n}: no column {n!r} (columns: {', '.join(names)})")
        if t not in DTYPES:
            raise ConfigError(f"dataset.dtypes.{n}={t!r} must be one of {', '.join(DTYPES)}")
        types[n] = str(t)
    return types


def count_rows(path: str, header: bool, delimiter: str) -> int:
    """Data rows of one file (quoted newlines and blank lines as CSV readers see them), remembered
    while the file keeps its size and modification time."""
    return streaming.cached_by_stat(
        _COUNTS, path, lambda: sum(1 for _ in _rows(path, delimiter)) - int(header), header, delimiter)


@streaming.reader
def load(
    files: Any,
    label: str,
    select: Sequence[str] | None = None,
    header: bool = True,
    column_names: Sequence[str] | None = None,
    dtypes: Mapping[str, str] | None = None,
    pack: bool = True,
    delimiter: str = ",",
    shuffle_buffer: int = 10_000,
    *,
    context: Context,
) -> Any:
    """This worker's batches of (x, y) for one epoch of `split`.

    `files`: a glob (or list of globs), or {train: glob, test: glob}; every file has the same
    columns (`header`: the first line names them, else give `column_names`).
    """
    paths = streaming.match_files(streaming.for_split(files, context.split, "files"), "files")
    if header:
        names = _header(paths[0], delimiter)
        for p in paths[1:]:
            if _header(p, delimiter) != names:
                raise DataError(f"dataset.files: {p} has columns {', '.join(_header(p, delimiter))}, {paths[0]} "
                                f"has {', '.join(names)}; give files of one layout")
        if column_names is not None:
            names = [str(n) for n in column_names]
    elif column_names is None:
        raise ConfigError("dataset.column_names: the files have no header (dataset.header=false); list the "
                          "names of their columns")
    else:
        names = [str(n) for n in column_names]
    if label not in names:
        raise ConfigError(f"dataset.label={label!r} is not a column of {paths[0]} (columns: {', '.join(names)}); "
                          "name the column that holds y")
    chosen = [n for n in names if n != label] if select is None else [str(n) for n in select]
    unknown = [n for n in chosen if n not in names]
    if unknown or label in chosen or not chosen:
        bad = f"{', '.join(unknown)} not among the columns ({', '.join(names)})" if unknown else (
            f"the label {label!r} is in it" if chosen else "it is empty")
        raise ConfigError(f"dataset.select: {bad}; list input columns other than the label")
    types = _column_types(paths[0], names, header, delimiter, dtypes or {})
    if types[label] == "string":
        raise ConfigError(f"dataset.label={label!r} holds text in {paths[0]}; store class ids (0..n-1) or "
                          f"numbers, or set dataset.dtypes.{label}=int64 if the first rows misled the guess")
    text = [n for n in chosen if types[n] == "string"]
    if pack and text:
        raise ConfigError(f"dataset.select: column(s) {', '.join(text)} hold text and cannot join the float "
                          "vector x; drop them from dataset.select or set dataset.pack=false")

    train = context.train
    total = sum(count_rows(p, header, delimiter) for p in paths)
    ordered = [paths[i] for i in streaming.epoch_order(len(paths), context.seed, context.epoch, train)]
    wanted = sorted(names.index(n) for n in [*chosen, label])  # CsvDataset yields them in file order
    rows = tf.data.experimental.CsvDataset(ordered, [DTYPES[types[names[i]]] for i in wanted], header=header,
                                           field_delim=delimiter, select_cols=wanted)

    def to_xy(*columns: tf.Tensor) -> tuple[Any, tf.Tensor]:
        by_name = {names[i]: c for i, c in zip(wanted, columns)}
        if pack:
            x = tf.stack([tf.cast(by_name[n], tf.float32) for n in chosen], axis=-1)
        else:
            x = {n: by_name[n] for n in chosen}
        return x, by_name[label]

    data = streaming.deal(rows, total, to_xy, context, shuffle_buffer)
    return streaming.locating(data, lambda: damaged(ordered, names, types, wanted, header, delimiter))


def write(path: str | os.PathLike, columns: Mapping[str, Sequence[Any]]) -> None:
    """Write equal-length columns as a CSV file with a header (for tests and examples)."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(list(columns))
        out.writerows(zip(*columns.values()))
