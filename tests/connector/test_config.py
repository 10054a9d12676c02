"""`kv_connector_extra_config` parsing (no vLLM needed)."""

from __future__ import annotations

import pytest

from rendezvous.connector import ConnectorConfig
from rendezvous.connector.config import trace_context


def test_minimal() -> None:
    config = ConnectorConfig.from_extra_config({"rendezvous": "127.0.0.1:50051"})
    assert config.rendezvous == ("127.0.0.1:50051",)
    assert config.pool == "default"
    assert config.engine_id == ""
    assert config.lease_ttl == 0.0 and config.transfer_timeout == 0.0
    assert config.labels == {}


def test_every_key() -> None:
    config = ConnectorConfig.from_extra_config(
        {
            "rendezvous": ["a:1", "b:2"],
            "pool": "decode",
            "engine_id": "d0",
            "lease_ttl": 30,
            "transfer_timeout": "5.5",
            "call_timeout": 3,
            "start_timeout": 90,
            "token": "secret",
            "labels": {"url": "http://127.0.0.1:8100", "zone": 1},
        }
    )
    assert config.rendezvous == ("a:1", "b:2")
    assert (config.pool, config.engine_id, config.token) == ("decode", "d0", "secret")
    assert (config.lease_ttl, config.transfer_timeout, config.call_timeout, config.start_timeout) == (30, 5.5, 3, 90)
    assert config.labels == {"url": "http://127.0.0.1:8100", "zone": "1"}


def test_comma_separated_endpoints() -> None:
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1, b:2,"}).rendezvous == ("a:1", "b:2")


@pytest.mark.parametrize(
    "extra",
    [None, {}, {"rendezvous": ""}, {"rendezvous": []}, {"pool": "p"}],
)
def test_rendezvous_is_required(extra: dict[str, object] | None) -> None:
    with pytest.raises(ValueError, match="rendezvous"):
        ConnectorConfig.from_extra_config(extra)


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="poool"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "poool": "x"})


def test_negative_durations_are_refused() -> None:
    with pytest.raises(ValueError, match="lease_ttl"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "lease_ttl": -1})


def test_tls_keys_turn_tls_on() -> None:
    plain = ConnectorConfig.from_extra_config({"rendezvous": "a:1"})
    assert not plain.uses_tls
    mtls = ConnectorConfig.from_extra_config(
        {"rendezvous": "a:1", "tls_ca": "/ca.pem", "tls_cert": "/engine.pem", "tls_key": "/engine.key"}
    )
    assert mtls.uses_tls and (mtls.tls_ca, mtls.tls_cert, mtls.tls_key) == ("/ca.pem", "/engine.pem", "/engine.key")


def test_a_client_certificate_needs_its_key() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "tls_cert": "/engine.pem"})


def test_the_routers_trace_context_is_read_from_kv_transfer_params() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace_context({"transfer_id": "t1", "traceparent": parent, "other": 1}) == {"traceparent": parent}
    assert trace_context({"transfer_id": "t1"}) == trace_context(None) == {}


def test_the_routers_binding_is_read_from_kv_transfer_params_as_plain_data() -> None:
    from rendezvous.connector.config import BINDING_KEY, binding_params

    value = {"consumer": "d0", "producer": "p0", "expires": 1, "mac": "00"}
    assert binding_params({"transfer_id": "t", BINDING_KEY: value}) == value
    assert binding_params({"transfer_id": "t"}) is None
    assert binding_params({BINDING_KEY: "not an object"}) is None
    assert binding_params(None) is None


def test_a_decode_engine_declares_its_capacity() -> None:
    config = ConnectorConfig.from_extra_config({"rendezvous": "a:1", "max_transfers": "8", "max_blocks": 4096})
    assert (config.max_transfers, config.max_blocks) == (8, 4096)
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1"}).max_transfers == 0  # no limit
    with pytest.raises(ValueError, match="max_transfers must not be negative"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "max_transfers": -1})


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), ("true", True), ("False", False)])
def test_progressive_push_is_a_flag(value: object, expected: bool) -> None:
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1", "progressive": value}).progressive is expected
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1"}).progressive is False


@pytest.mark.parametrize(("value", "expected"), [(True, True), ("true", True), (False, False)])
def test_the_kv_index_feed_is_a_flag(value: object, expected: bool) -> None:
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1", "kv_index": value}).kv_index is expected
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1"}).kv_index is False
    with pytest.raises(ValueError, match="kv_index must be true or false"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "kv_index": "on"})


@pytest.mark.parametrize("value", [1, "yes", None])
def test_progressive_push_refuses_what_is_not_a_boolean(value: object) -> None:
    with pytest.raises(ValueError, match="progressive must be true or false"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "progressive": value})


def test_progressive_layers_needs_progressive() -> None:
    config = ConnectorConfig.from_extra_config({"rendezvous": "a:1", "progressive": True, "progressive_layers": True})
    assert config.progressive and config.progressive_layers
    with pytest.raises(ValueError, match="progressive_layers needs progressive"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "progressive_layers": True})


def test_the_idle_step_wait() -> None:
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1"}).idle_wait_ms == 2.0
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1", "idle_wait_ms": "0"}).idle_wait_ms == 0.0
    with pytest.raises(ValueError, match="idle_wait_ms"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "idle_wait_ms": -1})


def test_integrity_is_a_flag_off_by_default() -> None:
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1", "integrity": "true"}).integrity is True
    assert ConnectorConfig.from_extra_config({"rendezvous": "a:1"}).integrity is False
    with pytest.raises(ValueError, match="integrity must be true or false"):
        ConnectorConfig.from_extra_config({"rendezvous": "a:1", "integrity": 1})
