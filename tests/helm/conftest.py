"""The chart rendered once per module: every example values file (deploy/helm/examples)."""

from __future__ import annotations

import pytest

from tests.helm.chart import EXAMPLES_NAMES, Doc, example_values, render


@pytest.fixture(scope="module", params=EXAMPLES_NAMES)
def example(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(example_values(request.param))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {name: render(example_values(name)) for name in EXAMPLES_NAMES}
