"""The base of every config section (sleuth.config, sleuth.task_config): unknown keys are errors,
assignments validated, numbers finite, never a boolean for a number."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated, numbers
    are finite (no .inf / .nan) and a boolean is never taken for a number (iterations=true is not 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        items = value if isinstance(value, list | tuple) else [value]
        if field is not None and any(isinstance(v, bool) for v in items) and _is_numeric(field.annotation):
            raise ValueError("expected a number, not a boolean")
        return value


def _is_numeric(annotation: Any) -> bool:
    """Whether a field holds numbers: int, float, an optional one, or a tuple of them."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) is Annotated:
        return _is_numeric(get_args(annotation)[0])
    args = [a for a in get_args(annotation) if a is not type(None)]
    return bool(args) and get_origin(annotation) is not Literal and all(_is_numeric(a) for a in args)


Beta = Annotated[float, Field(ge=0, lt=1)]
