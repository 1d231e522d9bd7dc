"""The worker's /tokenize and /detokenize (workers/serving/tokenization.py) on the tiny
tokenizer: a chat counts what generation feeds the engine, and bad ids are a 400."""

from __future__ import annotations

from tests.support.tiny_vlm import IMAGE_TOKEN, build_vlm_processor
from workers.contract.chunks import ErrorInfo
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.contract.tokenize import DetokenizeRequest, TokenizeRequest
from workers.serving.tokenization import Tokenization
from workers.text.prompts import PromptBuilder
from workers.text.vision_prompts import VisionPromptBuilder

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
WINDOW = 64


def tokenization(tokenizer) -> Tokenization:
    return Tokenization(tokenizer, PromptBuilder(tokenizer), WINDOW)


def test_chat_tokens_are_what_generation_feeds_the_engine(tiny_tokenizer):
    generated = PromptBuilder(tiny_tokenizer).build(GenerateRequest("r", SamplingParams(), messages=MESSAGES))
    result = tokenization(tiny_tokenizer).tokenize(TokenizeRequest(messages=MESSAGES, add_special_tokens=False))
    assert result.tokens == generated.token_ids
    assert result.max_model_len == WINDOW and result.token_strs is None


def test_template_endings(tiny_tokenizer):
    tok = tokenization(tiny_tokenizer)
    chat = [*MESSAGES, {"role": "assistant", "content": "General Kenobi"}]
    closed = tok.tokenize(TokenizeRequest(messages=chat, add_special_tokens=False, add_generation_prompt=False))
    open_ = tok.tokenize(TokenizeRequest(messages=chat, add_special_tokens=False, add_generation_prompt=False,
                                         continue_final_message=True))
    assert tiny_tokenizer.decode(closed.tokens).rstrip().endswith("<|im_end|>")
    assert tiny_tokenizer.decode(open_.tokens).endswith("General Kenobi")
    assert open_.tokens == closed.tokens[: len(open_.tokens)]


def test_prompt_with_token_strs_and_past_the_window(tiny_tokenizer):
    text = "the quick brown fox " * 40
    result = tokenization(tiny_tokenizer).tokenize(TokenizeRequest(prompt=text, return_token_strs=True))
    assert result.tokens == tiny_tokenizer(text)["input_ids"]
    assert len(result.tokens) > WINDOW  # counted, not refused
    assert result.token_strs == tiny_tokenizer.convert_ids_to_tokens(result.tokens)
    assert tiny_tokenizer.decode(result.tokens) == text


def test_a_template_error_is_a_400_naming_messages(tiny_tokenizer):
    tok = tokenization(tiny_tokenizer)
    result = tok.tokenize(TokenizeRequest(messages=MESSAGES, chat_template_kwargs={"add_generation_prompt": False}))
    assert isinstance(result, ErrorInfo) and (result.status, result.param) == (400, "messages")


def test_detokenize_round_trip_and_out_of_vocabulary(tiny_tokenizer):
    tok = tokenization(tiny_tokenizer)
    ids = tiny_tokenizer("Paris is lovely")["input_ids"]
    assert tok.detokenize(DetokenizeRequest(ids)).prompt == "Paris is lovely"
    assert tok.detokenize(DetokenizeRequest([])).prompt == ""
    vocab = len(tiny_tokenizer)
    bad = tok.detokenize(DetokenizeRequest([*ids, vocab + 3, vocab]))
    assert isinstance(bad, ErrorInfo)
    assert (bad.status, bad.param, bad.code) == (400, "tokens", "invalid_token_id")
    assert str(vocab + 3) in bad.message


def test_a_vision_models_chat_goes_through_its_processor():
    processor = build_vlm_processor()
    vision = VisionPromptBuilder(processor, processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), 10_000)
    tok = Tokenization(processor.tokenizer, PromptBuilder(processor.tokenizer), WINDOW, vision)
    generated = vision.build(GenerateRequest("r", SamplingParams(), messages=MESSAGES))
    assert tok.tokenize(TokenizeRequest(messages=MESSAGES, add_special_tokens=False)).tokens == generated.token_ids
    refused = tok.tokenize(TokenizeRequest(messages=MESSAGES, add_special_tokens=False, add_generation_prompt=False))
    assert isinstance(refused, ErrorInfo)
    assert (refused.status, refused.param, refused.code) == (400, "add_generation_prompt", "unsupported_parameter")
