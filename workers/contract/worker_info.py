"""What a worker says about itself: its model (`ModelInfo`) and its load (`WorkerStats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int
    kv_cache_blocks: int
    block_size: int
    accepts_images: bool = False  # a vision-language model
    dtype: str = ""  # what the weights run in (`auto` resolved), e.g. "bfloat16"
    packed_linear_layers: int = 0  # CPU: layers with oneDNN-packed weights (bfloat16, or float32 where faster)
    fused_projections: int = 0  # groups of sibling projections (q/k/v, gate/up) run as one multiply each
    decode_attention: str = "sdpa"  # "triton" / "cpu": the paged kernel (CUDA / C on CPU); "sdpa": over a gather
    cuda_graph_max_batch: int = 0  # decode steps up to this batch replay CUDA graphs (0: none)
    deterministic: bool = False  # batch-invariant: a sequence's tokens never depend on the batch (engine.deterministic)


@dataclass(frozen=True)
class WorkerStats:
    active_requests: int
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    engine_steps: int
    prefix_cache_query_tokens: int = 0  # counters: prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # ... and found there
    pid: int = 0  # the replica's process: a new pid means the replica was replaced
    rss_bytes: int = 0  # its resident memory (Linux; 0 elsewhere)
    open_channels: int = 0  # ingress replicas with a channel open here (serve_app/transport/)
    requests_by_channel: int = 0  # counters: requests whose chunks went by their ingress's channel
    requests_by_call: int = 0  # ... and by their own call (no channel open yet)
    queued_prompt_tokens: int = 0  # prompt tokens the engine has not prefilled yet
    # Prefill/decode disaggregation (counters): requests handed over (prefill side); hand-overs
    # whose KV blocks were taken in, or missed (the prompt computed again), the prompt
    # tokens taken and those held already (not taken), and the K/V bytes and milliseconds
    # of taking them (decode side).
    kv_handoffs_sent: int = 0
    kv_handoffs_received: int = 0
    kv_handoffs_missed: int = 0
    kv_transfer_tokens: int = 0
    kv_held_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_ms: float = 0.0
    # Speculative decoding (counters): verification chunks, tokens proposed in them, accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

