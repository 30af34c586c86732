"""A bounded memo keyed by objects' identity: the search prices the same plan on the same model and cluster objects
many times (a plan placed again by a later search of the same cluster, the same layer terms of each layer split),
and those specs are not hashable by value cheaply."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class IdentityMemo(Generic[T]):
    """``get(objects, values, make)``: ``make()``'s result, remembered for the same ``objects`` (by identity, checked
    on every hit: an id is reused once its object is gone) and equal hashable ``values``; at most ``kept`` results
    (all forgotten at once past it). What it returns is shared: callers must not modify it."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._held: dict[tuple, tuple[tuple[object, ...], T]] = {}

    def get(self, objects: tuple[object, ...], values: tuple[Hashable, ...], make: Callable[[], T]) -> T:
        key = (*map(id, objects), *values)
        hit = self._held.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], objects)):
            return hit[1]
        if len(self._held) >= self.kept:
            self._held.clear()
        made = make()
        self._held[key] = (objects, made)
        return made
