"""Microversion parsing and negotiation."""

from __future__ import annotations

import pytest

from ferry import errors
from ferry.api import microversions
from ferry.api.microversions import MAX_VERSION, MIN_VERSION, APIVersion


def test_versions_compare_numerically():
    assert APIVersion.parse("2.9") < APIVersion.parse("2.10") < APIVersion.parse("2.96")
    assert str(APIVersion.parse("2.37")) == "2.37"
    assert APIVersion.parse("2.52").at_least("2.47") and not APIVersion.parse("2.46").at_least("2.47")


@pytest.mark.parametrize("text", ["2", "2.", "v2.1", "2.1.1", "latest-ish", "02.1", ""])
def test_malformed_versions_are_bad_requests(text):
    with pytest.raises(errors.BadRequest):
        APIVersion.parse(text)


def test_no_header_gets_the_minimum_and_latest_gets_the_maximum():
    assert microversions.negotiate({}) == MIN_VERSION
    assert microversions.negotiate({"openstack-api-version": "compute latest"}) == MAX_VERSION
    assert microversions.negotiate({"X-OpenStack-Nova-API-Version": "latest"}) == MAX_VERSION


def test_the_new_header_wins_over_the_legacy_one_and_other_services_are_ignored():
    headers = {"OpenStack-API-Version": "placement 1.39, compute 2.56", "X-OpenStack-Nova-API-Version": "2.3"}
    assert microversions.negotiate(headers) == APIVersion(2, 56)
    assert microversions.negotiate({"OpenStack-API-Version": "placement 1.39",
                                    "X-OpenStack-Nova-API-Version": "2.3"}) == APIVersion(2, 3)


@pytest.mark.parametrize("text", ["2.0", "2.97", "3.0", "1.1"])
def test_versions_outside_the_range_are_not_acceptable(text):
    with pytest.raises(errors.NotAcceptable) as raised:
        microversions.negotiate({"OpenStack-API-Version": f"compute {text}"})
    assert raised.value.http_status == 406
    assert raised.value.message == f"Version {text} is not supported by the API. Minimum is 2.1 and maximum is 2.96."


def test_response_headers_name_the_version_and_vary_on_both_headers():
    assert microversions.response_headers(APIVersion(2, 60)) == {
        "OpenStack-API-Version": "compute 2.60", "X-OpenStack-Nova-API-Version": "2.60",
        "Vary": "OpenStack-API-Version, X-OpenStack-Nova-API-Version"}
