"""The load tool's memory check (`kvhandoff.service.tools.load.rss_check`): it fails a process whose
resident memory grows from the first to the last quarter of the run, passes a flat one, looks
past the warm-up, and refuses to pass what it cannot compare."""

from __future__ import annotations

import os

from kvhandoff.service.tools.load import MIB, RssSeries, default_warmup, read_rss, rss_check


def series(rss_mib: list[float], anon_mib: list[float] | None = None) -> RssSeries:
    anon = anon_mib if anon_mib is not None else [x / 2 for x in rss_mib]
    return RssSeries(
        t_s=[float(i) for i in range(len(rss_mib))],
        rss=[int(x * MIB) for x in rss_mib],
        anon=[int(x * MIB) for x in anon],
    )


def test_flat_memory_passes() -> None:
    (v,) = rss_check({"decode": series([300.0, 301, 299, 300, 302, 300, 301, 300])},
                     warmup_s=0, max_growth=1.25)  # fmt: skip
    assert v.ok and v.reason is None
    assert 0.99 < v.ratio < 1.01 and v.peak_mib == 302.0


def test_growth_beyond_the_bound_fails_naming_it() -> None:
    grow = [300.0 + 20 * i for i in range(12)]  # 300 -> 520 MiB
    (v,) = rss_check({"prefill-0": series(grow)}, warmup_s=0, max_growth=1.25)
    assert not v.ok
    assert v.reason is not None and "grew" in v.reason and "1.25" in v.reason
    assert v.ratio > 1.25


def test_private_heap_growth_fails_even_when_vmrss_is_dominated_by_shared_pages() -> None:
    rss = [2000.0 + 2 * i for i in range(12)]  # 2 GB of touched shm pool: VmRSS barely moves
    anon = [100.0 + 10 * i for i in range(12)]  # the heap doubles
    (v,) = rss_check({"decode": series(rss, anon)}, warmup_s=0, max_growth=1.25)
    assert v.ratio < 1.25 and v.anon_ratio > 1.25
    assert not v.ok and v.reason is not None and "RssAnon" in v.reason


def test_the_warm_up_ramp_is_not_compared() -> None:
    ramp = [100.0, 200, 300] + [400.0] * 12  # pools touched and caches filled in the first 3 s
    assert rss_check({"decode": series(ramp)}, warmup_s=3, max_growth=1.25)[0].ok
    assert not rss_check({"decode": series(ramp)}, warmup_s=0, max_growth=1.25)[0].ok


def test_too_few_samples_fail_rather_than_pass() -> None:
    (v,) = rss_check({"decode": series([300.0, 300, 300])}, warmup_s=0, max_growth=1.25)
    assert not v.ok and v.reason is not None and "too few" in v.reason


def test_each_process_is_judged_on_its_own() -> None:
    verdicts = rss_check(
        {"decode": series([300.0] * 8), "prefill-0": series([300.0 + 40 * i for i in range(8)])},
        warmup_s=0,
        max_growth=1.25,
    )
    assert [v.ok for v in verdicts] == [True, False]


def test_read_rss_of_this_process_and_of_none() -> None:
    got = read_rss(os.getpid())
    assert got is not None and got[0] > 0 and 0 < got[1] <= got[0]
    assert read_rss(2**22 + 12345) is None  # above pid_max: no such process


def test_the_warm_up_lasts_until_the_decode_s_bounded_history_is_full() -> None:
    # 100 completions a second: a history of 1,000 is full at 10 s of a 60 s run.
    done_at = [i / 100 for i in range(1, 6001)]
    assert default_warmup(60.0, done_at, 1000) == 10.0
    # Never full, or full too late to leave a quarter of the run to compare: 10% of the run.
    assert default_warmup(60.0, done_at[:500], 1000) == 6.0
    assert default_warmup(60.0, done_at, 5000) == 6.0
    assert default_warmup(20.0, [], 1000) == 5.0
