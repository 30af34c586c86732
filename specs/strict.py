"""The base of the profile schemas: unknown keys, NaN and infinity refused, frozen, true/false refused where a
number is asked for (pydantic would read them as 1 and 0) and anything else where a switch is."""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from specs.errors import bool_only, number_only


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse true/false for numbers, also inside mappings of numbers (pydantic reads them as 1 and 0), and
        anything but true/false for a switch (pydantic reads "yes", "off", 1 as one); text and other fields get
        pydantic's own message."""
        ann = cls.model_fields[info.field_name].annotation
        if _numeric(ann):
            for x in v.values() if isinstance(v, dict) else [v]:
                number_only(x)
        elif ann is bool or (get_args(ann) and set(get_args(ann)) == {bool, type(None)} and v is not None):
            bool_only(v)
        return v


def _numeric(ann: Any) -> bool:
    """Whether a field's annotation is a number, an optional number, or a mapping to numbers."""
    if ann in (int, float):
        return True
    args = get_args(ann)
    if get_origin(ann) is dict:
        return args[-1] in (int, float)
    return bool(args) and all(a in (int, float, type(None)) for a in args)
