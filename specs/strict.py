"""The base of the profile schemas: unknown keys, NaN and infinity refused, frozen, true/false refused where a
number is asked for (pydantic would read them as 1 and 0), 8.0 where a whole number is (pydantic would read it as
8), and anything but true/false where a switch is."""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from specs.errors import bool_only, number_only, whole_only


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse true/false for numbers, also inside mappings of numbers (pydantic reads them as 1 and 0), a
        decimal point for a whole number, and anything but true/false for a switch (pydantic reads "yes", "off", 1
        as one); text and other fields get pydantic's own message."""
        ann = cls.model_fields[info.field_name].annotation
        if _numeric(ann):
            check = whole_only if _numeric(ann) == {int} else number_only
            for x in v.values() if isinstance(v, dict) else [v]:
                if x is not None:
                    check(x)
        elif ann is bool or (get_args(ann) and set(get_args(ann)) == {bool, type(None)} and v is not None):
            bool_only(v)
        return v


def _numeric(ann: Any) -> set[type]:
    """The number types of a field's annotation where it is a number, an optional number, or a mapping to numbers
    (empty otherwise)."""
    if ann in (int, float):
        return {ann}
    args = get_args(ann)
    if get_origin(ann) is dict:
        return {args[-1]} if args[-1] in (int, float) else set()
    if args and all(a in (int, float, type(None)) for a in args):
        return set(args) - {type(None)}
    return set()
