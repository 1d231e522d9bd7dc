"""Typed, validated configuration of one served model (read from the YAML's `args`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
# The output cap of a request that names none. vLLM has none (the rest of the window), so a
# model that never ends its answer (a loop, a badly prompted or broken model) holds a batch
# slot and a whole window of KV (128k tokens on current models) for many minutes; 4096 fits
# nearly every chat answer and a moderate reasoning trace, and a request may ask for more,
# up to the window. MindIE's equivalent, maxIterTimes, defaults to 512.
DEFAULT_MAX_TOKENS = 4096
CPU_DEFAULT_KV_CACHE_GIB = 1.0
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._:/@+-]{1,128}")


def default_cache_dir() -> Path:
    """Where converted models and built kernels are kept when `cache_dir` is unset."""
    return Path(os.environ.get("CHATSERVE_CACHE", Path.home() / ".cache" / "chatserve"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Strict):
    block_size: int = Field(
        16, ge=1, le=1024, description="token slots per KV-cache block (the unit of paging and prefix caching)")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV pool size; default: 1 GiB on cpu, on cuda sized from free memory after a warm-up"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="cuda only: share of the GPU's memory for weights, activations and the KV pool"
    )
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before")
    max_num_seqs: int = Field(64, ge=1, description="sequences the scheduler admits to the running batch at most")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens one model step may compute (decodes plus prompt chunks); a longer prompt is "
        "prefilled in chunks")
    max_prefill_tokens_while_decoding: int | None = Field(
        None, ge=1, description="prompt tokens a step may take beside running decodes (fairness); default: the budget")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="which waiting request the scheduler admits first: `fcfs` in arrival order (a request "
        "with a non-zero `priority` is a 400); `priority` by the request's `priority` (lower first), ties in "
        "arrival order, and the running request with the largest (priority, arrival) is preempted first")
    max_model_len: int | None = Field(None, ge=16, description="default: the model's own window")
    torch_threads: int | None = Field(
        None, ge=1, description="CPU only; default: the container's CPU quota (cgroup), rounded up, at most the "
        "CPUs the worker may run on")
    first_token_timeout_s: float | None = Field(None, gt=0, description="end a request with no token by then")
    request_timeout_s: float | None = Field(None, gt=0, description="end a request still running by then")
    step_hang_timeout_s: float = Field(120, gt=0, description="a model step running longer fails the health check")
    cuda_graph_max_batch_size: int = Field(
        256, ge=0, le=1024, description="cuda: decode steps of up to this many sequences (and max_num_seqs) "
        "replay CUDA graphs captured at start-up; 0: off")
    async_scheduling: bool = Field(
        True, description="cuda: launch the next decode step before this one's tokens are read back, so the "
        "host's work overlaps the device's (plain decodes only); false: one step at a time")
    deterministic: bool | None = Field(
        None, description="cpu: a sequence's logits depend only on its own tokens, never on the batch around it, "
        "its prompt's chunking or a prefix-cache hit: linears with one reduction order per row whatever the batch "
        "(in row slices whose size a load-time probe finds invariant on this CPU), every prompt span attended by the "
        "decode kernel (workers/model/batch_invariant.py). null: on where output tok/s does not change (c=1-64), a "
        "CPU model whose linear layers all keep their weights in quantized blocks with 8-bit activations "
        "(quantization auto, quantized_activations int8x2 or int8: the default model), with no LoRA and not split; "
        "a long prompt's TTFT pays 1.04x (2,000 tokens, AVX2) to 1.34x (AMX Xeon) there. Off elsewhere (a float "
        "checkpoint's row slices cost up to 0.76x output tok/s at c=64 in bfloat16 on AMX). Costs in "
        "docs/BENCHMARKS.md")
    direct_forward: bool = Field(
        True, description="cpu: Llama, Mistral, Qwen2 and Qwen3 models run chatserve's own loop over their layers "
        "instead of transformers' modules (the same logits, fewer operators: the default model's decode step 1.3-1.4x "
        "faster at batch 1); false: transformers' forward")
    stream_interval: int = Field(
        1, ge=1, le=64, description="tokens per streamed chunk after the first (as vLLM's --stream-interval): "
        "larger sends fewer messages through Serve, in bursts")


class AutoscalingConfig(_Strict):
    min_replicas: int = Field(1, ge=0, description="fewest replicas Serve keeps")
    max_replicas: int = Field(1, ge=1, description="most replicas Serve starts")
    target_ongoing_requests: float = Field(
        32, gt=0, description="ongoing requests per replica that Serve scales towards")
    upscale_delay_s: float = Field(
        5, ge=0, description="how long the load must stay above target before adding replicas")
    downscale_delay_s: float = Field(
        30, ge=0, description="how long the load must stay below target before removing replicas")
    metrics_interval_s: float = Field(10, gt=0, description="how often replicas report their load")
    look_back_period_s: float = Field(30, gt=0, description="window the reported load is averaged over")

    def serve_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` option."""
        return self.model_dump()


# The engine-load policy, by import path: Serve's controller runs it, and this module stays torch-free.
ENGINE_LOAD_POLICY = "workers.serving.engine_load_policy:EngineLoadPolicy"


class EngineLoadTargets(_Strict):
    """Autoscaling on what the engine reports instead of on ongoing requests
    (workers/serving/engine_load_policy.py), so that a replica holding a few long prompts
    counts as loaded as one holding many short chats. Each replica reports its load every
    metrics_interval_s; each target is a mean per replica over look_back_period_s. A replica
    is added when any signal is over its target, removed when every signal is under it by
    downscale_margin; min_replicas, max_replicas and the delays apply as with ongoing
    requests. null turns a signal off; one at least must stay on."""

    waiting_per_replica: float | None = Field(
        2, gt=0, description="sequences waiting for the scheduler (max_num_seqs or the KV pool is full)")
    kv_cache_usage: float | None = Field(
        0.85, gt=0, le=1, description="share of the KV pool's blocks held by running sequences")
    queued_prompt_tokens_per_replica: float | None = Field(
        None, gt=0, description="prompt tokens not yet prefilled, e.g. a few times engine.max_num_batched_tokens")
    downscale_margin: float = Field(
        0.2, ge=0, lt=1, description="replicas are removed only while every signal, spread over the replicas "
        "left, stays below (1 - margin) x its target: no flapping around a target")

    @model_validator(mode="after")
    def _some_target(self) -> "EngineLoadTargets":
        if (self.waiting_per_replica, self.kv_cache_usage, self.queued_prompt_tokens_per_replica) == (None,) * 3:
            raise ValueError(
                "set at least one of waiting_per_replica, kv_cache_usage, queued_prompt_tokens_per_replica")
        return self


class WorkerAutoscalingConfig(AutoscalingConfig):
    """A model worker's autoscaling: on ongoing requests (Serve's default), or on the engine's load."""

    engine_load: EngineLoadTargets | None = Field(
        None, description="scale on the engine's load (waiting sequences, KV-cache usage, queued prompt tokens) "
        "with these targets; target_ongoing_requests is then unused. Unset: scale on ongoing requests")

    def serve_config(self) -> dict[str, Any]:
        config = self.model_dump(exclude={"engine_load"})
        if self.engine_load is not None:
            targets = self.engine_load.model_dump()
            config["policy"] = {"policy_function": ENGINE_LOAD_POLICY, "policy_kwargs": targets}
        return config


class DeploymentConfig(_Strict):
    """Ray Serve deployment options for one deployment."""

    num_replicas: int = Field(1, ge=1, description="fixed replica count; ignored when autoscaling_config is set")
    max_ongoing_requests: int = Field(256, ge=1, description="requests one replica runs at once (Serve's limit)")
    max_queued_requests: int = Field(
        -1, ge=-1, description="requests a caller may queue for the deployment beyond that; more get a 503 with "
        "Retry-After; -1: no bound")
    graceful_shutdown_timeout_s: float = Field(30, ge=0, description="in-flight requests may finish this long")
    autoscaling_config: AutoscalingConfig | None = Field(
        None, description="Serve autoscaling between min_replicas and max_replicas; unset: num_replicas")
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="passed to Ray as given: num_cpus, num_gpus, runtime_env, ...")

    @property
    def max_replicas(self) -> int:
        return self.autoscaling_config.max_replicas if self.autoscaling_config is not None else self.num_replicas

    def serve_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "ray_actor_options": dict(self.ray_actor_options),
        }
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config.serve_config()
        else:
            options["num_replicas"] = self.num_replicas
        return options


class WorkerDeploymentConfig(DeploymentConfig):
    """Ray Serve options of a model's worker deployment: its autoscaling may follow the engine's load."""

    autoscaling_config: WorkerAutoscalingConfig | None = Field(
        None, description="Serve autoscaling between min_replicas and max_replicas; unset: num_replicas")


class DisaggregationConfig(_Strict):
    """Prefill/decode disaggregation (the MindIE documents' PD scenario; Ray Serve LLM's
    PDPrefillServer/PDDecodeServer): the model runs as two worker deployments of the same
    model, config and dtype. A request is prefilled on a prefill replica, which produces
    each choice's first token and keeps the prompt's KV blocks; a decode replica takes
    those blocks (a Ray call pinned to that replica, through the object store) and streams
    the rest. A long prompt's prefill then never shares a step with running streams."""

    prefill: WorkerDeploymentConfig = Field(
        WorkerDeploymentConfig(), description="Ray Serve options of the prefill side's worker deployment "
        "(replicas, autoscaling, ray_actor_options: its cores or GPU)")
    decode: WorkerDeploymentConfig = Field(
        WorkerDeploymentConfig(), description="Ray Serve options of the decode side's worker deployment")
    prefill_nice: int = Field(
        19, ge=0, le=19, description="added to the niceness of the prefill replicas' engine threads (their model's "
        "threads too; at most 19): a core shared with a decode replica or the server's own processes goes to those "
        "first, so running streams do not stall while long prompts are prefilled (make bench-pd on 2 cores: "
        "inter-token p99 1.01x its value without long prompts at 19, 1.03-1.66x at 10, 2.34x at 0); 0: equal "
        "priority")

    def sides(self) -> dict[str, WorkerDeploymentConfig]:
        return {"prefill": self.prefill, "decode": self.decode}


class SpeculativeConfig(_Strict):
    """Speculative decoding (vLLM's `speculative_config` names): a decoding sequence feeds
    proposed next tokens beside its last one, and one forward of the model checks them
    all (workers/speculative/). Greedy output is the same tokens as without; sampled
    output keeps its distribution (and a seeded request its tokens)."""

    method: Literal["ngram", "suffix", "draft"] = Field(
        description="ngram: proposals are the tokens that followed the latest earlier occurrence of the sequence's "
        "last few tokens in its own prompt and output (no second model: pays where answers repeat their input, "
        "as edits, code and extraction do); suffix: ngram's lookup plus the model's earlier answers (the last "
        "suffix_decoding_max_cached_requests finished ones, matched on the last prompt_lookup_max tokens), taking "
        "whichever source matched more of the sequence's end: pays where answers repeat earlier answers (agent "
        "tool loops, retried or re-run requests). Its proposals never change an output, but a request's speed can tell whether an earlier "
        "answer held the same text: use it where the callers trust each other; draft: a smaller model with the "
        "same tokenizer (draft_source) proposes its own greedy continuation, run by the same engine with its own "
        "KV cache")
    draft_source: str | None = Field(
        None, description="method draft: the draft model, in any form `source` takes (loaded with this model's "
        "device, dtype and quantization; its tokenizer must be this model's). Its KV pool holds as many tokens "
        "as this model's, on top of engine.kv_cache_memory_gib")
    num_speculative_tokens: int = Field(
        ge=1, le=16, description="proposed tokens a sequence feeds at most per step; each sequence proposes as many "
        "as pay by its own recent rate of accepted proposals, and pauses while not even one does")
    prompt_lookup_min: int = Field(2, ge=1, le=32, description="ngram and suffix: the shortest suffix looked up")
    prompt_lookup_max: int = Field(4, ge=1, le=32, description="ngram and suffix: the longest suffix looked up "
                                   "(longest first)")
    suffix_decoding_max_cached_requests: int = Field(
        256, ge=1, le=100_000, description="method suffix: finished answers kept per replica to propose from, the "
        "oldest leaving first; cancelled requests' partial answers are not kept. vLLM's default is 10,000; here "
        "each kept token costs ~0.25 KB in the worker's memory (256 answers of 500 tokens: ~28 MB)")
    disable_by_batch_size: int | None = Field(
        3, ge=1, description="no proposals while this many sequences or more are running (default: proposals "
        "while one or two run): on a CPU the products are compute-bound from a few rows, so a wider step costs "
        "nearly its width (make bench-spec, default model, 2-core AVX2, proposing at any batch: an edit load "
        "1.24x / 1.04x / 0.70x at 2 / 4 / 16 sequences, the chat load 1.08x / 0.93x / 0.84x); null: any batch")

    @model_validator(mode="after")
    def _known_method(self) -> "SpeculativeConfig":
        if self.method == "draft" and not self.draft_source:
            raise ValueError("method 'draft' needs draft_source (the draft model)")
        if self.method != "draft" and self.draft_source is not None:
            raise ValueError(f"draft_source is for method 'draft'; method {self.method!r} proposes without a second "
                             "model")
        kept = type(self).model_fields["suffix_decoding_max_cached_requests"].default
        if self.method != "suffix" and self.suffix_decoding_max_cached_requests != kept:  # (a dump carries the default)
            raise ValueError("suffix_decoding_max_cached_requests is for method 'suffix'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class ParallelConfig(_Strict):
    """How one worker replica splits its model (workers/parallel/): its layers in
    `pipeline_parallel_size` stages, each stage split the Megatron way over
    `tensor_parallel_size` shards; each shard a Ray actor in the replica's placement group
    (the replica itself is shard 0). On cpu the replica's `ray_actor_options.num_cpus` is
    split evenly over its shards; on cuda each shard takes one GPU."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="shards one replica splits the model's heads, MLP and vocabulary over (it must "
        "divide the attention heads, KV heads and intermediate size): Llama, Mistral, Qwen2 and Qwen3 by chatserve's "
        "own forward, and families whose transformers config has a column/row tensor-parallel plan (Gemma, OLMo, "
        "Granite, ...) by transformers' forward, their vocabulary whole on every shard")
    pipeline_parallel_size: int = Field(
        1, ge=1, le=64, description="layer stages one replica splits the model into (Llama, Mistral, Qwen2 and "
        "Qwen3), each of tensor_parallel_size shards (one step in the pipeline at a time; a step of 256 tokens or "
        "more runs through the stages in micro-batches, so they overlap)")
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="how Ray places the shards' bundles: STRICT_PACK keeps the replica on one node; "
        "PACK lets it spill to other nodes (bundles are in shard order, a stage's tensor shards consecutive, so "
        "PACK tends to keep a stage on one node, but Ray does not promise it)")

    @property
    def shards(self) -> int:
        """Processes one replica runs the model in (itself included)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def split_field(self) -> str:
        """The field that splits the model, as errors name it."""
        return "tensor_parallel_size" if self.tensor_parallel_size > 1 else "pipeline_parallel_size"


class ResumeConfig(_Strict):
    """How a request outlives the worker replica serving it (serve_app/transport/)."""

    enabled: bool = Field(True, description="a request whose worker replica dies, is scaled down or is replaced "
                          "goes on from the tokens already sent, on another replica of the model (the client's "
                          "stream pauses); false: it ends with a 503 worker_failed error")
    max_resumes: int = Field(3, ge=0, le=100, description="replica losses one request survives; the next one "
                             "ends it with 503 worker_failed")
    replica_wait_s: float = Field(60, gt=0, description="how long a broken request keeps trying to reach a "
                                  "replica (a new one may be starting) before it ends with 503 worker_failed")


class RoutingConfig(_Strict):
    """How the ingress picks a worker replica for a request (serve_app/transport/prefix_routing.py)."""

    prefix_aware: bool = Field(True, description="send a request to the replica that was sent the longest prefix "
                               "of its prompt (its KV blocks are likely cached there), or that its session "
                               "(`x-session-id` header, else the body's `user`) belongs to; false: Serve's "
                               "power of two choices by load alone")
    block_chars: int = Field(128, ge=16, le=4096, description="prompt text is matched in blocks of this many "
                             "characters (about a quarter as many tokens)")
    load_margin: int = Field(8, ge=0, description="the preferred replica is skipped when it runs more than this "
                             "many requests above the least loaded one")
    max_blocks: int = Field(100_000, ge=1, description="prompt blocks each ingress replica remembers (least "
                            "recently used forgotten first; about 100 bytes each)")


class LoraConfig(_Strict):
    """LoRA adapters on one base model (workers/lora/): PEFT directories, served by name."""

    adapters: dict[str, str] = Field(
        default_factory=dict, description="adapters served from the start: name (what clients pass as `model`) "
        "-> PEFT directory (adapter_config.json + adapter_model.safetensors); checked when the worker starts")
    adapter_dir: str | None = Field(
        None, min_length=1, description="POST /v1/load_lora_adapter loads only paths that resolve inside this "
        "directory (symlinks followed); unset: no adapters loaded at run time")
    max_loras: int = Field(
        4, ge=1, le=64, description="adapters one worker replica holds at once (device slots; Serve routes an "
        "adapter's requests to replicas holding it); more are evicted least recently used first")
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="the largest adapter rank accepted (the slots are this wide); a larger one "
        "is a 400")

    @model_validator(mode="after")
    def _names(self) -> "LoraConfig":
        for name in self.adapters:
            check_adapter_name(name)
        return self


def check_adapter_name(name: str) -> None:
    """An adapter name is what clients pass as `model`: printable, no spaces, at most 128 characters."""
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r} must be 1-128 characters of letters, digits and ._:/@+-")


class PoolerConfig(BaseModel):
    """How `/v1/embeddings` makes one vector of a prompt (vLLM's `pooler_config` names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = Field(
        None, description="LAST: the last prompt token's final hidden state (what decoder-only embedding models "
        "train); MEAN: the mean over every prompt token (on a generating model it then skips the prefix cache); CLS: "
        "the first token's (encoders only, as BERT-like models train). null: the checkpoint's own choice, read from "
        "its sentence-transformers pooling config (1_Pooling/config.json) when it has one, else CLS for an encoder "
        "and LAST for a generating model")
    normalize: bool = Field(True, description="scale each vector to unit length")
    is_matryoshka: bool = Field(
        False, description="the model was trained so that a vector's first values are an embedding too: requests "
        "may ask for fewer `dimensions` (else such a request is a 400)")


class ModelConfig(_Strict):
    id: str = Field(min_length=1, description="the model's name in the config, its deployment and /metrics; the "
                    "name clients pass as `model` unless served_model_name is set")
    served_model_name: list[str] | None = Field(
        None, min_length=1, description="the names clients pass as `model` (vLLM's --served-model-name; a name or a "
        "list): each one reaches this model and is listed by /v1/models; responses name the one asked for; "
        "default: [id]")
    source: str = Field(
        BUILTIN_DEFAULT_MODEL,
        description="a transformers model directory, a .gguf file, a Hugging Face Hub id (org/name or "
        "org/name@revision: safetensors and configs fetched into huggingface_hub's cache, HF_HUB_CACHE or "
        "HF_HOME; read from the cache alone with HF_HUB_OFFLINE=1; org/name:Q4_K_M: the GGUF file of a GGUF "
        "repository whose name ends with the tag), or " + BUILTIN_DEFAULT_MODEL + ". A GGUF "
        "file is converted once into a float copy in the model cache; a GPTQ, AWQ (4-bit) or FP8 checkpoint is "
        "dequantized once into a float copy (see quantization for the weights kept packed)",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where the model runs; cuda needs deployment.ray_actor_options.num_gpus > 0")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto on CPU: float32 for weights kept quantized, else bfloat16 on CPUs with AMX "
        "and float32 elsewhere; the checkpoint's own on CUDA")
    pack_cpu_weights: bool = Field(
        True, description="CPU: pack linear weights for oneDNN once at load; bfloat16 always (same numbers, "
        "faster), float32 where a load-time probe finds it faster on this CPU")
    quantization: Literal["auto", "none"] = Field(
        "auto", description="auto: on a CPU, a GGUF file's Q4_0, Q4_1, Q8_0 weights stay in their blocks (Q4_K, Q5_K, "
        "Q6_K, GPTQ/AWQ 4-bit weights with groups of 32n inputs, and FP8 e4m3 weights with per-tensor, per-row or "
        "32n-wide block scales, in blocks of 32 with float32 scales) and multiply through chatserve's C kernels "
        "(built once with the host's gcc; the default model's weights take 97 MB instead of 540); on CUDA the same "
        "weights multiply through a Triton kernel; other formats load as floats. none: the float copy")
    quantized_activations: Literal["int8x2", "int8", "float32"] = Field(
        "int8x2", description="quantization auto, how the quantized linears take their input: int8 rounds it to 8 "
        "bits a block and multiplies as integers, as llama.cpp does (fastest: 2-5x the float copy's products on a "
        "2-core AVX2 CPU; its rounding can change greedy text, the default model's first answer included); int8x2 "
        "also multiplies what that rounding left out (within ~2e-5 of float; 1-5x the float copy's speed); float32 "
        "multiplies the dequantized weights exactly (the float copy's speed). The output layer never takes int8's "
        "single rounding (int8x2 then); FP8 weights always take float32")
    fuse_projections: bool = Field(
        True, description="run each layer's q/k/v projections, and its gate/up projections, as one matrix "
        "multiply each (fewer, wider weight passes)")
    resume: ResumeConfig = Field(ResumeConfig(), description="resuming requests on another replica")
    routing: RoutingConfig = Field(RoutingConfig(), description="choosing a worker replica per request")
    engine: EngineConfig = Field(EngineConfig(), description="the continuous-batching engine's limits and options")
    deployment: WorkerDeploymentConfig = Field(
        WorkerDeploymentConfig(), description="Ray Serve options of the model's worker deployment")
    cache_dir: str | None = Field(
        None, description="where GGUF models converted to safetensors (and GPTQ/AWQ/FP8 checkpoints dequantized) "
        "are kept, one copy a source file: a changed file's new copy replaces the old one; default: "
        "$CHATSERVE_CACHE, else ~/.cache/chatserve")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="vision models: a larger image (width x height, read from its header) is a 400"
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "openai"] = Field(
        "hermes", description="the format the model writes tool calls in (serve_app/output/tool_parsers.py): hermes "
        "(`<tool_call>{json}</tool_call>`: Qwen 2.5/3, Hermes), llama3_json (a JSON answer: Llama 3.1+), mistral "
        "(`[TOOL_CALLS]`), pythonic (`[f(x=1)]`: Llama 3.2/4), qwen3_coder (`<function=...>` XML), deepseek_v3 "
        "(DeepSeek's call tokens), openai (gpt-oss's harmony messages `to=functions.NAME`). mistral's, deepseek_v3's "
        "and openai's tags are special tokens in their models' tokenizers, read only from output decoded with "
        "`skip_special_tokens: false` (what the ingress asks with tools in play)")
    default_max_tokens: int | None = Field(
        DEFAULT_MAX_TOKENS, ge=1, description="the output cap of a request that names none (`max_tokens`, "
        "`max_completion_tokens`; MindIE's maxIterTimes); the context window stays the hard limit; null: the rest "
        "of the window")
    reasoning_parser: Literal["deepseek_r1", "qwen3", "openai_gptoss"] | None = Field(
        None, description="split the reasoning into reasoning_content on /v1: `<think>...</think>` "
        "(serve_app/output/reasoning.py): deepseek_r1, or qwen3 (the same tags; a `<think>` repeated after the "
        "template opened one is dropped); or gpt-oss's harmony analysis channel, openai_gptoss "
        "(serve_app/output/harmony.py; its answer is the final channel, its calls are read by "
        "`tool_call_parser: openai`)")
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto", description="what the model serves (vLLM's `--runner`): generate, the chat, completion and "
        "embedding routes through the continuous-batching engine; pooling, an encoder (BERT, RoBERTa, XLM-R, "
        "MPNet, ... as transformers' AutoModel loads it) serving /v1/embeddings, /tokenize and /detokenize only, "
        "in padded batches of at most engine.max_num_seqs inputs and engine.max_num_batched_tokens padded tokens "
        "(workers/serving/encoder_worker.py); auto: pooling when the checkpoint's config.json "
        "names an encoder `model_type`, else generate (read when the app is built: a local directory, or a Hub "
        "id's config.json)")
    pooler_config: PoolerConfig = Field(
        PoolerConfig(), description="/v1/embeddings: how the model's final hidden states pool into one vector")
    lora: LoraConfig | None = Field(
        None, description="LoRA adapters served on this model, each by its own name; unset: none (no LoRA code "
        "on the model's path)")
    parallel: ParallelConfig = Field(ParallelConfig(), description="splitting the model over several devices")
    speculative: SpeculativeConfig | None = Field(
        None, description="speculative decoding; unset: off (one token per sequence per step)")
    disaggregation: DisaggregationConfig | None = Field(
        None, description="run prefill and decode on separate worker deployments (their options here replace "
        "`deployment`); unset: each replica does both")

    @model_validator(mode="after")
    def _gpu_needs_gpu(self) -> "ModelConfig":
        for where, side in self.worker_sides().items():
            gpus = side.ray_actor_options.get("num_gpus", 0)
            if self.device == "cuda" and not gpus:
                raise ValueError(f"device 'cuda' needs {where}.ray_actor_options.num_gpus > 0")
            if self.device == "cpu" and gpus:
                raise ValueError(f"device 'cpu' with {where}.ray_actor_options.num_gpus > 0 wastes a GPU")
        if self.lora is not None and (own := sorted(set(self.names) & set(self.lora.adapters))):
            raise ValueError(f"lora.adapters: adapter names {own} are the model's own names")
        self._check_parallel(self.deployment.ray_actor_options.get("num_gpus", 0))
        self._check_disaggregation()
        self._check_deterministic()
        self._check_draft()
        if self.runner == "pooling" and (conflict := pooling_conflict(self)) is not None:
            raise ValueError(f"runner: pooling: {conflict}")
        return self

    def _check_draft(self) -> None:
        if self.speculative is None or self.speculative.method != "draft" or self.parallel.shards == 1:
            return
        raise ValueError(f"speculative.method: 'draft' is not available on a model split over shards "
                         f"(parallel.{self.parallel.split_field}; not built)")

    def _check_deterministic(self) -> None:
        """The batch-invariant mode covers what it was built and tested for; the rest is refused."""
        if not self.engine.deterministic:
            return
        refused = {"device: cuda": self.device == "cuda", "lora": self.lora is not None,
                   f"parallel.{self.parallel.split_field}": self.parallel.shards > 1}
        for what, present in refused.items():
            if present:
                raise ValueError(f"engine.deterministic: not available with {what} (batch-invariant kernels are "
                                 "built for one CPU device, without adapters)")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name_or_a_list(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list) and "" in names:
            raise ValueError("a served model name cannot be empty")
        return names

    @property
    def names(self) -> list[str]:
        """The names clients pass as `model` for this model (the first is its name in listings of adapters)."""
        return self.served_model_name or [self.id]

    @property
    def decode_deployment(self) -> WorkerDeploymentConfig:
        """The options of the deployment whose replicas stream the output (the decode side's
        with disaggregation)."""
        return self.deployment if self.disaggregation is None else self.disaggregation.decode

    def worker_sides(self) -> dict[str, WorkerDeploymentConfig]:
        """The options of each worker deployment of the model, by their place in the config."""
        if self.disaggregation is None:
            return {"deployment": self.deployment}
        return {f"disaggregation.{name}": side for name, side in self.disaggregation.sides().items()}

    def _check_disaggregation(self) -> None:
        if self.disaggregation is None:
            return
        if self.deployment != WorkerDeploymentConfig():  # (a dumped config repeats the default: allowed)
            raise ValueError("deployment: with disaggregation, set each side's options under "
                             "disaggregation.prefill and disaggregation.decode")
        if self.parallel.shards > 1:
            raise ValueError(f"disaggregation: a model split over shards (parallel.{self.parallel.split_field}) "
                             "is not disaggregated (not built)")
        if not self.engine.enable_prefix_caching:
            raise ValueError("disaggregation: the prefill side hands the prompt's KV blocks over from its prefix "
                             "cache; set engine.enable_prefix_caching: true")
        for where, side in self.worker_sides().items():
            if side.autoscaling_config is not None and side.autoscaling_config.min_replicas < 1:
                raise ValueError(f"{where}.autoscaling_config.min_replicas: each side needs a replica at all times "
                                 "(a request starts on one and ends on the other)")

    def _check_parallel(self, gpus: float) -> None:
        if self.parallel.shards == 1:
            return
        where = f"parallel.{self.parallel.split_field}"
        if not self.engine.direct_forward:
            raise ValueError(f"{where}: a split model runs the direct forward; set engine.direct_forward: true")
        if self.device == "cuda" and gpus != 1:
            raise ValueError(f"{where}: each shard takes one GPU; set deployment.ray_actor_options.num_gpus: 1")
        if self.device == "cuda" and self.engine.kv_cache_memory_gib is None:
            raise ValueError(f"{where}: on cuda set engine.kv_cache_memory_gib (the pool is not profiled per shard)")

    def worker_serve_options(self, side: str = "decode") -> dict[str, Any]:
        """Serve's options for the worker deployment (with disaggregation: the `side`'s): one
        placement-group bundle per shard when the model is split (the replica's actor takes
        the first)."""
        deployment = self.deployment if self.disaggregation is None else self.disaggregation.sides()[side]
        options = deployment.serve_options()
        shards = self.parallel.shards
        if shards == 1:
            return options
        actor = options["ray_actor_options"]
        bundle = {"CPU": actor.get("num_cpus", 1) / shards}
        if self.device == "cuda":
            bundle["GPU"] = 1
        actor["num_cpus"] = bundle["CPU"]
        if not any(bundle.values()):
            return options  # nothing reserved (num_cpus 0 on cpu): the shards are plain actors
        options["placement_group_bundles"] = [dict(bundle) for _ in range(shards)]
        options["placement_group_strategy"] = self.parallel.placement_group_strategy
        return options


def pooling_conflict(model: ModelConfig) -> str | None:
    """What in `model`'s config an encoder (runner pooling) cannot serve, or None: it runs
    whole on one device, with no decoding features."""
    present = {"speculative": model.speculative is not None, "disaggregation": model.disaggregation is not None,
               "lora": model.lora is not None, f"parallel.{model.parallel.split_field}": model.parallel.shards > 1}
    unusable = [name for name, set_ in present.items() if set_]
    if not unusable:
        return None
    return f"an encoder serves embeddings only, whole on one device; remove {', '.join(unusable)}"
