"""Which webhook targets are allowed: the host allow-list and non-public addresses (SSRF)."""

from __future__ import annotations

import pytest

from kvhandoff.service.webhooks.targets import TargetPolicy, TargetRefused


def test_the_allow_list_matches_hosts_and_dotted_suffixes() -> None:
    policy = TargetPolicy(["router.internal", ".hooks.example.com"], allow_private=False)
    assert policy.host_allowed("router.internal")
    assert policy.host_allowed("ROUTER.internal.")
    assert policy.host_allowed("a.hooks.example.com") and policy.host_allowed("hooks.example.com")
    assert not policy.host_allowed("evilhooks.example.com")
    assert not policy.host_allowed("router.internal.evil.com")
    assert TargetPolicy([], allow_private=False).host_allowed("anything.example")


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.0.0.1",
        "192.168.1.1",
        "172.16.0.1",
        "169.254.169.254",
        "::1",
        "fe80::1",
        "::ffff:127.0.0.1",
        "0.0.0.0",
        "100.64.0.1",
    ],
)
def test_non_public_addresses_are_refused_unless_allowed(address: str) -> None:
    assert not TargetPolicy([], allow_private=False).address_allowed(address)
    assert TargetPolicy([], allow_private=True).address_allowed(address)


@pytest.mark.parametrize(
    "address", ["224.0.0.1", "239.1.1.1", "224.0.1.1", "ff02::1", "ff0e::1", "::ffff:224.0.0.1"]
)
def test_multicast_addresses_are_never_targets(address: str) -> None:
    """Issue 18 B: 224.0.0.1 counts as `is_global`, so it was accepted as a public target."""
    for allow_private in (False, True):
        policy = TargetPolicy([], allow_private=allow_private)
        assert not policy.address_allowed(address)
        assert policy.literal_refusal(
            f"http://{address}/hook" if ":" not in address else f"http://[{address}]/hook"
        )


def test_public_addresses_are_allowed() -> None:
    policy = TargetPolicy([], allow_private=False)
    assert policy.address_allowed("8.8.8.8") and policy.address_allowed("2606:4700::1111")


def test_literal_refusal_is_judged_without_dns() -> None:
    policy = TargetPolicy([], allow_private=False)
    assert "non-public" in (policy.literal_refusal("http://127.0.0.1:8/x") or "")
    assert "non-public" in (policy.literal_refusal("http://[::1]:8/x") or "")
    assert policy.literal_refusal("http://8.8.8.8/x") is None
    assert policy.literal_refusal("http://name.example/x") is None  # the resolver checks names
    listed = TargetPolicy(["a.example"], allow_private=True)
    assert "allow_hosts" in (listed.literal_refusal("http://127.0.0.1/x") or "")


async def test_check_names_the_field_and_the_address() -> None:
    policy = TargetPolicy([], allow_private=False)
    with pytest.raises(TargetRefused) as refused:
        await policy.check("http://localhost:9/x", "url")
    assert refused.value.context["field"] == "url"
    assert refused.value.context["address"] in ("127.0.0.1", "::1")
    with pytest.raises(TargetRefused, match="http"):
        await policy.check("ftp://example.com/x", "callback_url")
    await TargetPolicy([], allow_private=True).check("http://127.0.0.1:9/x", "url")


@pytest.mark.parametrize(
    "url",
    [
        # Found by the fuzzer: a host IDNA cannot encode made the resolver raise UnicodeError (500).
        'http://x\u00b6"n\u00ac[}mF\ud964\udcb7}9\ud8cf\udc9c',
        "http://b\u00fccher.example/x",  # international names are sent as punycode
        "http://example.com:99999/x",
        "http://example.com:port/x",
        "http://[::1/x",
    ],
)
async def test_malformed_urls_are_refused_naming_the_field(url: str) -> None:
    with pytest.raises(TargetRefused) as refused:
        await TargetPolicy([], allow_private=True).check(url, "url")
    assert refused.value.context["field"] == "url"
