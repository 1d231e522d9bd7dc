"""The Ray Serve ingress deployment: its routes, and what each does before the worker call.

It holds no model. Every generating route is a row of the dialect table
(serve_app/dialects/table.py): `/v1/chat/completions` (dialects/chat/),
`/lm/v2/chat/completions` (dialects/lm_v2.py), `/v1/completions` (dialects/completions.py),
`/v1/responses` (dialects/responses/) and `/v1/messages` (dialects/messages/, Anthropic's
errors), each a chat request underneath. One path, `_generate`,
serves them all, each step the same way for every dialect (serve_app/schema/dialect.py
says what a row supplies): the API keys (serve_app/http/auth.py); the body, validated by
the dialect's request model (every rule of the dialect at parse time); `model` resolved,
a LoRA adapter attached (serve_app/lora/adapters.py); the translation to the worker's
`GenerateRequest`; its token ids checked against the vocabulary; its image parts fetched
(serve_app/media/images.py; a text-only model refuses them); the session key; then the
one worker call (serve_app/transport/worker_call.py: first chunk awaited, so worker errors
keep their status; after that, errors travel as a final SSE event before `[DONE]`),
answered by the dialect's streamer or accumulator. The handle API (handle_api.py) takes
the same path with the chat row. `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
change which adapters are served.

`/v1/embeddings` (dialects/embeddings.py) asks the model's worker for pooled vectors,
which its engine computes beside generation. `/tokenize` and `/detokenize`
(dialects/tokenization.py, vLLM's) and Anthropic's
`/v1/messages/count_tokens` generate nothing: the model's worker answers them with its
tokenizer (workers/serving/tokenization.py).
"""


import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)

from serve_app.config.app_config import AppConfig
from serve_app.dialects import embeddings, tokenization
from serve_app.dialects.messages.request import CountTokensRequest
from serve_app.dialects.messages.response import TokenCount
from serve_app.dialects.messages.route import (
    COUNT_TOKENS_PATH,
    MESSAGES,
    count_tokens_fields,
)
from serve_app.dialects.responses.route import RESPONSES
from serve_app.dialects.table import DIALECTS
from serve_app.handle_api import HandleAPI
from serve_app.http.auth import APIKeyAuth
from serve_app.http.errors import APIError, not_found_model
from serve_app.http.exposure import serve_http_address, warn_if_open_without_key
from serve_app.http.health import ModelHealth, health_report
from serve_app.http.metrics import (
    CONTENT_TYPE,
    STATUS_CLIENT_GONE,
    IngressMetrics,
    current_record,
    route_request_log_to_serve,
)
from serve_app.http.request_body import parse_request, read_json_body
from serve_app.http.session import current_session, remember_session
from serve_app.http.tracing import IngressTracing
from serve_app.lora.adapters import (
    AdapterCatalog,
    LoadLoraAdapterRequest,
    Target,
    UnloadLoraAdapterRequest,
)
from serve_app.media.images import MediaResolver, first_image_param, image_error
from serve_app.schema.common import ModelCard, ModelList
from serve_app.schema.dialect import CallContext, Dialect
from serve_app.transport.channels import WorkerChannels
from serve_app.transport.fan_out import call_workers
from serve_app.transport.worker_call import (
    Accumulator,
    Streamer,
    accumulate,
    call_worker,
    over_grpc,
    relay,
)
from workers.contract.chunks import ErrorInfo
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.contract.tokenize import TokenizeRequest, TokenizeResult
from workers.contract.worker_info import ModelInfo

logger = logging.getLogger("chatserve.ingress")

# No /docs, /redoc, /openapi.json: the routes read raw bodies, so the schema would say
# nothing, and with API keys on every route but /health must need a key.
api = FastAPI(title="chatserve", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)


# Routes whose errors have their dialect's own shape (Anthropic's); the others have OpenAI's.
_ERROR_RESPONSES = {d.path: d.error_response for d in DIALECTS if d.error_response is not None}
_ERROR_RESPONSES[COUNT_TOKENS_PATH] = MESSAGES.error_response


def _route_path(request: Request) -> str:
    """The matched route's path (without the app's route prefix), else the URL's."""
    return getattr(request.scope.get("route"), "path", None) or request.url.path


def _error_response(request: Request, exc: APIError) -> Response:
    shape = _ERROR_RESPONSES.get(_route_path(request))
    return exc.response() if shape is None else shape(exc)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> Response:
    if (record := current_record()) is not None:
        record.fail(exc.status, exc.type, exc.message)
    return _error_response(request, exc)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error")
    if (record := current_record()) is not None:
        record.fail(500, "internal_error", type(exc).__name__)
    return _error_response(request, APIError(500, f"internal error: {type(exc).__name__}", type="internal_error"))


@dataclass(frozen=True)
class Prepared:
    """A request ready for its worker calls: the model's transport, the worker's requests
    (one, or one per part of a request the dialect splits), and the dialect's streamer or
    accumulator that answers it."""

    transport: WorkerChannels
    requests: tuple[GenerateRequest, ...]
    output: Streamer | Accumulator
    request_id: str  # the answer's id (each part's worker request adds "~<part>")

    @property
    def request(self) -> GenerateRequest:
        """The worker's request of a request that is not split."""
        return self.requests[0]


def _generate_route(dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
    """The POST route of a dialect: this replica's ingress, by the replica context as Serve's
    class-based routes reach it, then the one generate path."""

    async def generate(request: Request) -> Response:
        ingress: ChatIngress = serve.get_replica_context().servable_object
        return await ingress._generate(request, dialect)

    return generate


# One route per row of the dialect table, added before `@serve.ingress` copies the app.
for _dialect in DIALECTS:
    api.add_api_route(_dialect.path, _generate_route(_dialect), methods=["POST"])


@serve.deployment(name="ChatIngress")
@serve.ingress(api)
class ChatIngress(HandleAPI):
    def __init__(self, app_config: dict, workers: dict[str, DeploymentHandle],
                 lora_registry: DeploymentHandle | None = None,
                 prefill_workers: dict[str, DeploymentHandle] | None = None) -> None:
        """`lora_registry`: the app's LoraRegistry (serve_app/lora/adapters.py), when a model serves
        adapters; `prefill_workers`: the prefill deployments of disaggregated models (`workers`
        then holds their decode deployments)."""
        self.config = AppConfig.model_validate(app_config)
        self.adapters = AdapterCatalog(self.config, lora_registry)
        self.auth = APIKeyAuth.from_options(self.config.server)  # reads the key env var / file here
        warn_if_open_without_key(*serve_http_address(), self.auth.enabled)
        self.media = MediaResolver(self.config.server.media)
        self.workers = {model: over_grpc(handle) for model, handle in workers.items()}
        prefills = {model: over_grpc(handle) for model, handle in (prefill_workers or {}).items()}
        self.prefill_workers = prefills
        self.transports = {model: self._transport(model, handle, prefills.get(model))
                           for model, handle in self.workers.items()}
        self._infos: dict[str, ModelInfo] = {}
        for model, transport in self.transports.items():
            transport.start()
            # The first call builds the handle's router, which then names the replicas and
            # the channels open: do it now rather than on the first request.
            asyncio.get_running_loop().create_task(self._info(model))
        self.created = int(time.time())
        self.metrics = IngressMetrics(list(workers), list(prefills))  # this replica's own registry
        # Each dialect's own state on this replica (the responses store), by route.
        self.dialect_states = {d.path: d.state(self.config.server) for d in DIALECTS if d.state is not None}
        self.tracing = IngressTracing.from_config(self.config.server.tracing)  # None: not configured
        route_request_log_to_serve()

    def _transport(self, model: str, handle: DeploymentHandle, prefill: DeploymentHandle | None) -> WorkerChannels:
        resume = self.config.model(model).resume
        return WorkerChannels(handle, resume, WorkerChannels(prefill, resume) if prefill is not None else None)

    @api.get("/health")
    async def health(self) -> Response:
        """Open (no key): whether each model has a ready worker replica (serve_app/http/health.py)."""
        models = {}
        for model_id, transport in self.transports.items():
            scaling = self.config.model(model_id).decode_deployment.autoscaling_config
            models[model_id] = ModelHealth(transport.ready_replicas, scaling is not None and scaling.min_replicas == 0)
        status, body = health_report(models)
        return JSONResponse(body, status_code=status)

    @api.get("/metrics")
    async def prometheus_metrics(self, request: Request) -> Response:
        """Prometheus text format; worker gauges are read now, from one replica per model."""
        self.auth.check(request.headers)
        await self.metrics.refresh_worker_gauges({m: h.stats.remote() for m, h in self.workers.items()})
        await self.metrics.refresh_prefill_gauges({m: p.stats.remote() for m, p in self.prefill_workers.items()})
        self.metrics.count_resumes({m: t.resumes for m, t in self.transports.items()})
        return Response(self.metrics.exposition(), headers={"content-type": CONTENT_TYPE})

    @api.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        self.auth.check(request.headers)
        cards = [await self._model_card(Target(model.id), name) for model in self.config.models for name in model.names]
        for adapter in await self.adapters.registered():
            cards.append(await self._model_card(Target(adapter.base_model, adapter.request)))
        return Response(ModelList(object="list", data=cards).dump_json(), media_type="application/json")

    # `:path`: model ids and adapter names may hold "/" (org/name).
    @api.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request) -> Response:
        """One entry of /v1/models: a served model or a LoRA adapter of one; 404 otherwise."""
        self.auth.check(request.headers)
        card = await self._model_card(await self.adapters.resolve(model), model)
        return Response(card.dump_json(), media_type="application/json")

    async def _model_card(self, target: Target, name: str | None = None) -> ModelCard:
        """`name`: the served name the card is for (a model may have several; adapters have their own)."""
        info = await self._info(target.base_model)
        card = dict(object="model", created=self.created, owned_by="chatserve", max_model_len=info.max_model_len)
        if target.lora is None:
            return ModelCard(id=name, **card)
        parent = self.config.model(target.base_model).names[0]
        return ModelCard(id=target.lora.name, root=target.lora.path, parent=parent, **card)

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's route: serve the PEFT adapter at `lora_path` (inside the model's
        lora.adapter_dir) as `lora_name`, checked by a worker replica first."""
        req = await self._parse_admin(request, LoadLoraAdapterRequest)
        base, path = self.adapters.load_target(req)
        error = await self.workers[base].check_lora_adapter.remote(req.lora_name, path)
        if error is not None:
            raise APIError.from_info(error)
        await self.adapters.register(req.lora_name, base, path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's route: stop serving a run-time adapter (requests already running finish)."""
        req = await self._parse_admin(request, UnloadLoraAdapterRequest)
        await self.adapters.unregister(req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's route (serve_app/dialects/tokenization.py), answered by the model's worker."""
        req = await self._parse_admin(request, tokenization.TokenizeBody, traced=True)
        target = await self._target(req.model)
        worker_req = tokenization.to_tokenize_request(req, self.config.model(target.base_model))
        result = await self._tokenize(target.base_model, worker_req, req.model)
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        return Response(tokenization.tokenize_response(result).dump_json(), media_type="application/json")

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        """OpenAI's route (serve_app/dialects/embeddings.py): each input's vector, pooled by
        the model's worker from its final hidden states in the engine's batches."""
        req = await self._parse(request, embeddings.EmbeddingsRequest, traced=True)
        target = await self._target(req.model)
        if target.lora is not None:
            raise APIError(400, "model: embeddings are served by base models, not LoRA adapters", param="model")
        record = current_record() or self.metrics.begin("")
        embed_request = embeddings.to_embed_request(req)
        if record.trace is not None:
            embed_request = dataclasses.replace(embed_request, trace_context=record.trace.calling_worker(req.model))
        try:
            result = await self.workers[target.base_model].embed.remote(embed_request)
        except asyncio.CancelledError:
            record.finish(STATUS_CLIENT_GONE)
            raise
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        record.prompt_tokens = result.prompt_tokens
        record.finish(200)
        return Response(embeddings.embeddings_response(req, result).dump_json(), media_type="application/json")

    @api.post(COUNT_TOKENS_PATH)
    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's route: the prompt tokens a Messages request would take (system, messages
        and tools, as generation templates them), counted by the model's tokenizer."""
        req = await self._parse_admin(request, CountTokensRequest, traced=True)
        target = await self._target(req.model)
        with MESSAGES.errors():
            body = parse_request(tokenization.TokenizeBody, count_tokens_fields(req))
            worker_req = tokenization.to_tokenize_request(body, self.config.model(target.base_model))
        result = await self._tokenize(target.base_model, worker_req, req.model)
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result, MESSAGES.param_names)
        return Response(TokenCount(input_tokens=len(result.tokens)).dump_json(), media_type="application/json")

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """vLLM's route: token ids -> text, by the model's worker."""
        req = await self._parse_admin(request, tokenization.DetokenizeBody)
        target = await self._target(req.model)
        result = await self.workers[target.base_model].detokenize.remote(tokenization.to_detokenize_request(req))
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        body = tokenization.DetokenizeResponse(prompt=result.prompt).dump_json()
        return Response(body, media_type="application/json")

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> Response:
        """A response stored by this ingress replica (`store: true`), else 404."""
        self.auth.check(request.headers)
        entry = self.dialect_states[RESPONSES.path].get(response_id, param=None)
        return Response(entry.body, media_type="application/json")

    async def _parse(self, request: Request, model_cls: type, traced: bool = False) -> Any:
        """API key, then body size, JSON and fields: the request model or an APIError.
        Starts the request's metrics record (finished by _generate or the error handlers),
        and its spans when `traced` (a generating or embedding route) and tracing is configured."""
        record = self.metrics.begin(_route_path(request))
        if traced and self.tracing is not None:
            record.trace = self.tracing.begin(record, request.method, request.headers)
        self.auth.check(request.headers)
        data = await read_json_body(request, self.config.server.max_request_bytes)
        req = parse_request(model_cls, data)
        record.set_request(req)
        remember_session(request.headers, req)
        return req

    async def _target(self, model: str) -> Target:
        """What `model` names (404 if nothing); an adapter's requests are counted under its
        base model in /metrics (adapter names would make the label set unbounded)."""
        target = await self.adapters.resolve(model)
        if (record := current_record()) is not None:
            record.model = self.metrics.model_label(target.base_model)
        return target

    async def _parse_admin(self, request: Request, model_cls: type, traced: bool = False) -> Any:
        """API key, then the body: the adapter and tokenizer routes' request model or an
        APIError. No metrics: they generate nothing; `traced` routes (the tokenizer's) get
        their spans when tracing is configured, on a record kept out of the metrics, which
        `_tokenize` or the error handlers finish."""
        if traced and self.tracing is not None:
            record = self.metrics.begin(_route_path(request), counted=False)
            record.trace = self.tracing.begin(record, request.method, request.headers, model_operation=False)
        self.auth.check(request.headers)
        data = await read_json_body(request, self.config.server.max_request_bytes)
        return parse_request(model_cls, data)

    async def _tokenize(self, model: str, worker_req: TokenizeRequest, requested: str) -> TokenizeResult | ErrorInfo:
        """The model's worker tokenizes; a traced request's parse span ends at the call, and
        its record finishes with the count (an error: by the handler of the APIError raised)."""
        record = current_record()
        if record is not None and record.trace is not None:
            record.trace.calling_worker(requested)
        try:
            result = await self.workers[model].tokenize.remote(worker_req)
        except asyncio.CancelledError:
            if record is not None:
                record.finish(STATUS_CLIENT_GONE)
            raise
        if record is not None and not isinstance(result, ErrorInfo):
            record.prompt_tokens = len(result.tokens)
            record.finish(200)
        return result

    async def _generate(self, request: Request, dialect: Dialect) -> Response:
        """Every dialect's route: the body parsed, the worker request prepared (`_prepare`),
        the session key added, the worker called, and its chunks streamed as SSE or
        accumulated into one JSON body; finishes the request's metrics record."""
        req = await self._parse(request, dialect.request_model, traced=True)
        prepared = await self._prepare(dialect, req, stream=req.stream)
        record = current_record() or self.metrics.begin("")
        gen_requests = prepared.requests
        record.request_id = prepared.request_id
        if (session_key := current_session()) is not None:
            gen_requests = tuple(dataclasses.replace(r, session_key=session_key) for r in gen_requests)
        if record.trace is not None:
            gen_requests = record.trace.worker_requests(gen_requests, req.model)
        output = prepared.output
        try:
            if len(gen_requests) == 1:
                call = await call_worker(prepared.transport, gen_requests[0], dialect.param_names, record)
            else:
                call = await call_workers(prepared.transport, gen_requests, dialect.param_names, record)
            if record.trace is not None:
                record.trace.first_chunk()
            if req.stream:
                return StreamingResponse(relay(output.events(call.first, call.rest), call, record),
                                         media_type="text/event-stream")
            body = (await accumulate(output, call)).dump_json()
        except asyncio.CancelledError:
            record.finish(STATUS_CLIENT_GONE)
            raise
        record.finish(200)
        return Response(body, media_type="application/json")

    async def _prepare(self, dialect: Dialect, req: Any, stream: bool) -> Prepared:
        """A parsed request of `dialect` as the worker's, with its output (HTTP and the
        handle API): `model` resolved (404 if nothing; an adapter attached), the dialect's
        plan and translation, then token ids checked against the vocabulary and images
        fetched, both inside the dialect's `errors` (which name its own fields)."""
        target = await self._target(req.model)
        transport = self._worker(target.base_model)
        model = self.config.model(target.base_model)
        if model.runner == "pooling":
            raise APIError(400, f"model: `{req.model}` is an embedding model: it serves /v1/embeddings, /tokenize and "
                           "/detokenize, not generation", param="model", code="model_not_supported")
        request_id = dialect.new_id()
        context = CallContext(model, self.config.server, self.dialect_states.get(dialect.path))
        plan = dialect.plan(req, request_id, context)
        parts = dialect.split(plan) if dialect.split is not None else [plan]
        gen_requests = []
        with dialect.errors():
            for number, part in enumerate(parts):
                part_id = request_id if len(parts) == 1 else f"{request_id}~{number}"
                gen_request = dataclasses.replace(dialect.translate(part, part_id, context.model), lora=target.lora)
                await self._check_token_ids(target.base_model, gen_request.params)
                gen_requests.append(await self._with_images(target.base_model, gen_request))
        return Prepared(transport, tuple(gen_requests), dialect.output(plan, request_id, context, stream), request_id)

    def _worker(self, model: str) -> WorkerChannels:
        transport = self.transports.get(model)
        if transport is None:
            raise not_found_model(model, self.config.served_names())
        return transport

    async def _check_token_ids(self, model: str, params: SamplingParams) -> None:
        """Token ids the sampler would index with must exist in the model's vocabulary."""
        for param, token_ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if not token_ids:
                continue
            vocab_size = (await self._info(model)).vocab_size
            bad = sorted(t for t in token_ids if t >= vocab_size)
            if bad:
                raise APIError(400, f"{param}: token ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                               param=param)

    async def _with_images(self, model: str, gen_request: GenerateRequest) -> GenerateRequest:
        """Image parts become bytes (serve_app/media/images.py), once the model is known to take
        images: a text-only model is refused before anything is fetched."""
        param = first_image_param(gen_request.messages or [])
        if param is None:
            return gen_request
        if not (await self._info(model)).accepts_images:
            raise image_error(param, f"the model `{model}` is text-only and does not accept images")
        messages, images = await self.media.resolve(gen_request.messages)
        return dataclasses.replace(gen_request, messages=messages, images=images)

    async def _info(self, model_id: str) -> ModelInfo:
        if model_id not in self._infos:
            self._infos[model_id] = await self.workers[model_id].info.remote()
        return self._infos[model_id]
