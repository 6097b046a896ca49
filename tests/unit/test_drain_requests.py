"""Which drain requests Ferry takes (ferry.drains.validate_request): the callback URL."""

from __future__ import annotations

import pytest

from ferry import drains, errors


@pytest.mark.parametrize("url", ["https://ops.example.com/ferry?token=abc", "http://10.0.0.7:8080/hooks/drain",
                                 "https://ops.example.com/caf%C3%A9"])
def test_an_http_or_https_callback_url_is_taken(url):
    drains.validate_request({"host": "compute-7", "callback_url": url})


@pytest.mark.parametrize("url", ["https://ops.example.com/a b?token=s3cret", "https://ops.example.com/a\tb?token=s3cret",
                                 "https://ops.example.com/\r\nX-Injected: s3cret", "https://ops.example.com/\x00s3cret",
                                 "https://ops.example.com/\x7fs3cret", "https://ops.example.com/ ", "ftp://s3cret.example",
                                 "https://"])
def test_a_callback_url_with_a_space_or_a_control_character_is_refused_without_repeating_it(url):
    with pytest.raises(errors.BadRequest) as refused:
        drains.validate_request({"host": "compute-7", "callback_url": url})

    assert "callback_url" in refused.value.message and "s3cret" not in refused.value.message


SECRET_URL = "https://ops.example.com/ferry?token=s3cret"


@pytest.mark.parametrize(("request_", "where"), [
    ({"host": "compute-7", "callback_url": SECRET_URL + " x"}, " at callback_url: must be an http:// or https:// URL"),
    ({"host": "compute-7", "callback_url": SECRET_URL + "a" * 2048},
     " at callback_url: is longer than 2048 characters"),
    ({"host": "compute-7", "cell": "cell1", "callback_url": SECRET_URL},
     ": name exactly one of 'host', 'hosts' or 'cell'"),
    ({"host": "compute-7", "callback_url": 7}, ' at callback_url: is not of type "string" or "null"'),
    ({"hosts": [SECRET_URL, SECRET_URL]}, " at hosts: names an item more than once"),
    ({"host": SECRET_URL * 10}, " at host: is longer than 255 characters"),
    ({"host": "compute-7", SECRET_URL: 1}, ": Additional properties are not allowed (it takes host, hosts, cell"),
    (SECRET_URL, ': is not of type "object"'),
])
def test_a_refused_request_is_worded_from_where_and_which_rule_never_from_what_was_sent(request_, where):
    with pytest.raises(errors.BadRequest) as refused:
        drains.validate_request(request_)
    with pytest.raises(errors.BadRequest) as refused_body:
        drains.request_of({"drain": request_})

    assert refused.value.message == refused_body.value.message
    assert refused.value.message.startswith(f"Invalid drain request{where}")
    assert "s3cret" not in refused.value.message
