"""SqlStore listing, on both engines: filters pushed into SQL over 10,000 devices, paging in id order."""

from __future__ import annotations

import pytest
from store_records import GB, module_database_url_fixture, report, sample, spec  # noqa: F401 (fixtures)

from accelmesh.errors import InvalidArgument
from inventory_svc.filtering import parse_filter
from inventory_svc.store import SqlStore

# -- listing ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_store(module_database_url):
    """10,000 devices on 100 nodes: a quarter ROCm, one node lost, memory use varying by index."""
    store = SqlStore(module_database_url)
    for n in range(100):
        ip = f"10.1.{n // 250}.{n % 250}"
        address = f"{ip}:50051"
        store.upsert_node(address, ip, f"node-{n}", now=0.0)
        devices = [spec(ip, i, "rocm" if i % 4 == 0 else "cuda") for i in range(100)]
        samples = [sample(d, 1.0, used=(d.local_index % 10) * 8 * GB) for d in devices]
        store.record_poll_success(address, report(devices, samples, ip), now=1.0)
    store.record_poll_failure("10.1.0.7:50051", "gone", now=2.0, lost_after=1)
    yield store
    store.close()


def _all_pages(store, text: str, page_size: int = 100) -> list[str]:
    ids, after = [], ""
    while True:
        page, after = store.list_devices(parse_filter(text), page_size=page_size, after_id=after, now=3.0)
        assert len(page) <= page_size
        ids.extend(record.id for record in page)
        if not after:
            return ids


@pytest.mark.parametrize(
    "text, expected_count",
    [
        ("", 9900),
        ('platform = "rocm"', 2475),
        ('health = "lost"', 100),
        ("free_memory_bytes >= 60000000000", 2970),  # used 0, 8 or 16 GB of 80: indices ending 0-2
        ('platform = "cuda" AND free_memory_bytes < 10000000000', 990),  # indices ending 9, all cuda
        ("free_memory_bytes > 1e15", 0),  # matches nothing: the whole table is one page's work
        ("capabilities:avx2", 0),
    ],
)
def test_paging_10000_devices_returns_each_match_once_in_id_order(big_store, text, expected_count):
    ids = _all_pages(big_store, text)
    assert len(ids) == expected_count
    assert ids == sorted(set(ids))
    flt = parse_filter(text)
    every = [big_store.get_device(i, now=3.0) for i in ids[:: max(1, len(ids) // 50)]]
    assert all(flt.matches(record) for record in every)


def test_page_size_zero_means_default_and_negative_is_rejected(big_store):
    assert len(big_store.list_devices(page_size=0, now=3.0)[0]) == 100
    assert len(big_store.list_devices(page_size=5000, now=3.0)[0]) == 1000
    with pytest.raises(InvalidArgument, match="page_size"):
        big_store.list_devices(page_size=-1)


def test_next_token_is_the_last_id_and_empty_on_the_last_page(big_store):
    rocm = parse_filter('platform = "rocm"')
    sizes, after = [], ""
    while True:
        page, next_after = big_store.list_devices(rocm, page_size=1000, after_id=after, now=3.0)
        sizes.append(len(page))
        assert next_after in ("", page[-1].id)
        if not next_after:
            break
        after = next_after
    assert sizes == [1000, 1000, 475]
    # Exactly a page left: no phantom next page.
    exactly, after = big_store.list_devices(rocm, page_size=474, after_id=page[0].id, now=3.0)
    assert len(exactly) == 474 and after == ""
