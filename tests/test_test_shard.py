"""tests/conftest.py's --test-shard K/N: the parts are disjoint, cover every test and are stable."""

from __future__ import annotations

import pytest

from helpers import in_test_shard, parse_test_shard

IDS = [f"tests/test_x.py::test_{i}[cpu-{j}]" for i in range(60) for j in range(3)]


def test_parts_partition_the_suite():
    for n in (1, 2, 3, 5):
        parts = [[i for i in IDS if in_test_shard(i, (k, n))] for k in range(1, n + 1)]
        assert sorted(i for part in parts for i in part) == sorted(IDS), n
        assert all(parts), n  # 180 ids: no part empty
    assert [i for i in IDS if in_test_shard(i, (1, 2))] == [i for i in IDS if in_test_shard(i, (1, 2))]


@pytest.mark.parametrize("text", ["", "2", "0/2", "3/2", "a/b", "1/2/3", "-1/2"])
def test_bad_shards_are_refused(text):
    with pytest.raises(ValueError, match="K/N"):
        parse_test_shard(text)
