"""Grouping helpers for arrays of candidates: distinct rows, and rows by value."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def packed_rows(*keys: np.ndarray) -> np.ndarray:
    """One integer per row of the non-negative integer columns ``keys``, equal where all keys are (so that numpy's
    fast 1-D unique finds the distinct rows)."""
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for col in keys:
        col = np.asarray(col, dtype=np.int64)
        packed = packed * (int(col.max(initial=0)) + 1) + col
    return packed


def distinct(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a first row of each distinct row of the integer columns ``keys``, each row's index among them)."""
    _, first, inverse = np.unique(packed_rows(*keys), return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def by_value(x: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(value, its rows) for each distinct value of the integer array ``x``, in increasing order (one sort;
    ``np.unique`` without indices would also import numpy.ma, slow the first time)."""
    first, inverse = distinct(x)
    order = np.argsort(inverse, kind="stable")
    for value, rows in zip(np.asarray(x)[first], np.split(order, np.cumsum(np.bincount(inverse))[:-1])):
        yield int(value), rows
