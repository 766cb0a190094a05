"""The database columns' bounds, for the API's schemas: a value past them is a 400 naming the field,
not a 500 from Postgres (``integer out of range``)."""

from __future__ import annotations

import re
from datetime import date, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Annotated, Any

from fastapi import Path, Query
from pydantic import AfterValidator, AwareDatetime, BeforeValidator, Field, StringConstraints, WithJsonSchema

INT32_MAX = 2**31 - 1
JSON_INT_MAX = 2**53 - 1
"""The largest integer every JSON client holds exactly (a JavaScript number); fits a ``bigint``."""


def _json_integer(value: object) -> object:
    """A JSON integer, as JSON Schema counts them (1.0 is one); not a string or a boolean, which
    pydantic would otherwise turn into numbers."""
    if isinstance(value, bool | str):
        raise ValueError("must be an integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_int(*, ge: int, le: int) -> Any:
    """An integer in ``[ge, le]`` (the bounds first, so the JSON schema states them)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_json_integer)]


Int32 = json_int(ge=0, le=INT32_MAX)
"""An ``integer`` column that holds a count or a limit."""
Int64 = json_int(ge=0, le=JSON_INT_MAX)
"""A ``bigint`` column that holds a count or a budget."""
Offset = Annotated[int, Query(ge=0, le=JSON_INT_MAX)]
"""A list's ``offset`` query parameter."""
RowId = Annotated[int, Path(ge=1, le=JSON_INT_MAX)]
"""A ``bigint`` identity column in a path."""

_ISO_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _iso_text(value: object) -> object:
    """Dates and times only as ISO 8601 text, as the document says: pydantic would also take a
    number as a Unix time, which no client means."""
    if isinstance(value, str) and _ISO_DATE.match(value):
        return value
    if isinstance(value, date):  # already parsed (from Python callers)
        return value
    raise ValueError("must be an ISO 8601 date (2026-11-25) or date-time (2026-11-25T12:00:00Z)")


IsoDate = Annotated[date, BeforeValidator(_iso_text)]
IsoDateTime = Annotated[datetime, BeforeValidator(_iso_text)]
IsoAwareDateTime = Annotated[AwareDatetime, BeforeValidator(_iso_text)]
Month = Annotated[
    str, Query(pattern=r"^[0-9]{4}-(0[1-9]|1[0-2])$", description="YYYY-MM", examples=["2026-11"])
]


def money(*, max_digits: int, decimal_places: int) -> Any:
    """A non-negative amount for a ``Numeric(max_digits, decimal_places)`` column, as a JSON number or a
    decimal string. The document states exactly what is accepted (a maximum for numbers, a pattern
    for strings); a number with more decimals is rounded to the column's, as Postgres would."""
    integer_digits = max_digits - decimal_places
    largest = 10**integer_digits - 1
    pattern = rf"^[0-9]{{1,{integer_digits}}}(\.[0-9]{{1,{decimal_places}}})?$"
    step = Decimal(1).scaleb(-decimal_places)

    def parse(value: object) -> Decimal:
        if isinstance(value, Decimal):
            amount = value
        elif isinstance(value, str):
            if re.fullmatch(pattern, value) is None:
                raise ValueError(
                    f"must be a decimal number of at most {integer_digits} digits and "
                    f"{decimal_places} decimals, such as '12.5'"
                )
            amount = Decimal(value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            amount = Decimal(str(value))
        else:
            raise ValueError("must be a number or a decimal string")
        if not amount.is_finite() or not 0 <= amount <= largest:
            raise ValueError(f"must be between 0 and {largest}")
        return amount.quantize(step, rounding=ROUND_HALF_EVEN)

    schema = {
        "anyOf": [
            {"type": "number", "minimum": 0, "maximum": largest},
            {"type": "string", "pattern": pattern},
        ]
    }
    return Annotated[Decimal, BeforeValidator(parse), WithJsonSchema(schema, mode="validation")]


# Defined here, once, and imported where used: a type made by a call is opaque to mypy where it is
# made, so schemas import these rather than calling json_int / money themselves.
PositiveInt32 = json_int(ge=1, le=INT32_MAX)
"""A limit (requests, tokens, concurrency) in an ``integer`` column."""
Numeric20_6 = money(max_digits=20, decimal_places=6)
"""An amount of money, ``Numeric(20, 6)``: budgets."""
Numeric20_10 = money(max_digits=20, decimal_places=10)
"""A price per million tokens, ``Numeric(20, 10)``."""

_BLANK = "\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
NOT_BLANK = f"^[^\\x00]*[^\\x00{_BLANK}][^\\x00]*$"
"""No NUL (Postgres text cannot hold one) and at least one character that ``str.strip`` keeps."""

Name = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=NOT_BLANK), AfterValidator(str.strip)
]
"""A tenant, key or model name: 1 to 200 characters, not all blank, stored without surrounding blanks.
The checks come before the stripping, so the document states exactly what is accepted."""

Filter = Annotated[str, StringConstraints(max_length=200, pattern="^[^\\x00]*$")]
"""A text filter in a query (a model, an action): any text Postgres can compare, so no NUL."""
