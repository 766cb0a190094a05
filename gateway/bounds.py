"""The database columns' bounds, for the API's schemas: a value past them is a 400 naming the field,
not a 500 from Postgres (``integer out of range``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query
from pydantic import Field

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
"""An ``integer`` column that holds a count or a limit."""
Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A ``bigint`` column that holds a count or a budget."""
Offset = Annotated[int, Query(ge=0, le=INT64_MAX)]
"""A list's ``offset`` query parameter (Postgres takes a bigint)."""
RowId = Annotated[int, Path(ge=1, le=INT64_MAX)]
"""A ``bigint`` identity column in a path."""
