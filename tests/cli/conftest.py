"""Fixtures of the CLI tests."""

from __future__ import annotations

import pytest
from workflow_helpers import copy_workflow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A copy of the workflow (cheap: files only) shared by the module's tests; a real run
    in it leaves its results for the module's later tests."""
    return copy_workflow(tmp_path_factory.mktemp("cli"))
