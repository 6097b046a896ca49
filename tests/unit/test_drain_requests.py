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
