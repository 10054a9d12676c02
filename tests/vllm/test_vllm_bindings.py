"""1P1D behind a rendezvous that requires the router's bindings (a `--binding-key-file`, issue 17 item 5).

The connector presents the binding it finds in `kv_transfer_params` with its half: legs bound to this pair move
their KV (the transfer commits), legs bound to other engines, or without a binding, are refused at the
rendezvous (decode fails cleanly under policy "fail"), and the reference router with `--binding-key-file`
serves requests end to end.
"""

from __future__ import annotations

import time
import urllib.error
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from rendezvous.clients import NotFound, TransferState
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import Engine, RouterProcess, connector_config, running_engine
from rendezvous.protocol import bindings
from tests.vllm.conftest import running_router, wait_committed, warm_up
from tests.vllm.test_vllm_1p1d import MAX_TOKENS, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

KEY = b"vllm-test-binding-key-0123456789abcdef"
PREFILL, DECODE = "prefill-bound", "decode-bound"  # engine names, which warm_up takes for their pools


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("binding") / "binding.key"
    path.write_bytes(KEY + b"\n")
    return path


@pytest.fixture(scope="module")
def bound_rendezvous(key_file: Path) -> Iterator[TestServer]:
    with TestServer(binding_key_file=str(key_file)) as server:  # a key requires bindings
        yield server


@pytest.fixture(scope="module")
def bound_pair(tiny_model: Path, bound_rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine]]:
    address = bound_rendezvous.address
    producer = partial(connector_config, "kv_producer", address, PREFILL)
    consumer = partial(connector_config, "kv_consumer", address, DECODE)
    with (
        running_engine(PREFILL, tiny_model, engine_logs, producer) as prefill,
        running_engine(DECODE, tiny_model, engine_logs, consumer) as decode,
    ):
        warm_up(bound_rendezvous, [prefill, decode])  # plain requests: no transfer, no binding needed
        yield prefill, decode


def engine_ids(server: TestServer) -> tuple[str, str]:
    with RendezvousClient(server.address) as client:
        engines = {e.pool: e.engine_id for e in client.list_engines()}
    return engines[PREFILL], engines[DECODE]


def legs(prefill: Engine, decode: Engine, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """Both legs at once with these kv_transfer_params; decode's response."""
    body: dict[str, Any] = {"kv_transfer_params": params}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.complete, prompt, 1, **body)
        d = pool.submit(decode.complete, prompt, MAX_TOKENS, **body)
        p.result()
        return d.result()


def transfer_state(server: TestServer, transfer_id: str) -> TransferState | None:
    with RendezvousClient(server.address) as client:
        try:
            return client.get_transfer(transfer_id).state
        except NotFound:
            return None


def test_legs_bound_to_this_pair_move_their_kv(bound_pair: tuple[Engine, Engine], bound_rendezvous: TestServer) -> None:
    prefill, decode = bound_pair
    producer_id, consumer_id = engine_ids(bound_rendezvous)
    transfer_id = uuid.uuid4().hex
    binding = bindings.sign(KEY, transfer_id, consumer_id, producer_id, int(time.time()) + 600)
    params = {"transfer_id": transfer_id, bindings.PARAMS_KEY: binding.to_params()}
    response = legs(prefill, decode, token_prompt(40, seed=9100), params)
    assert response["choices"][0]["text"]
    wait_committed(bound_rendezvous, transfer_id)


@pytest.mark.parametrize("case", ["no binding", "bound to another pair"])
def test_legs_without_this_pairs_binding_are_refused(
    bound_pair: tuple[Engine, Engine], bound_rendezvous: TestServer, case: str
) -> None:
    prefill, decode = bound_pair
    transfer_id = uuid.uuid4().hex
    params: dict[str, Any] = {"transfer_id": transfer_id}
    if case != "no binding":
        other = bindings.sign(KEY, transfer_id, "decode-elsewhere", "prefill-elsewhere", int(time.time()) + 600)
        params[bindings.PARAMS_KEY] = other.to_params()
    with pytest.raises(urllib.error.HTTPError) as error:
        legs(prefill, decode, token_prompt(40, seed=9200), params)
    assert error.value.code == 500  # kv_load_failure_policy "fail": an error, never garbage
    assert transfer_state(bound_rendezvous, transfer_id) is None  # neither half was admitted


@pytest.fixture(scope="module")
def signing_router(
    bound_pair: tuple[Engine, Engine], bound_rendezvous: TestServer, key_file: Path, engine_logs: Path
) -> Iterator[RouterProcess]:
    args = ["--address", bound_rendezvous.address, "--prefill-pool", PREFILL, "--decode-pool", DECODE]
    with running_router(engine_logs, [*args, "--binding-key-file", str(key_file)], name="router-bound") as router:
        yield router


def test_the_router_signs_and_requests_are_served_end_to_end(signing_router: RouterProcess) -> None:
    for n in range(3):
        response = signing_router.complete(token_prompt(20 + 17 * n, seed=9300 + n), MAX_TOKENS)
        assert response["choices"][0]["text"]
