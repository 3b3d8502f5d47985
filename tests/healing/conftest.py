"""The tiny teacher/student pair the healing tests share."""

from __future__ import annotations

import pytest

from tests.helpers.healing import HealPair, heal_pair


@pytest.fixture(scope="package")
def pair(tmp_path_factory) -> HealPair:
    return heal_pair(tmp_path_factory.mktemp("heal-pair"))
