"""Every message between the API process and the engine core survives the msgpack round trip
unchanged, each direction decodes only its own messages, and the config crosses as JSON."""
from __future__ import annotations

import msgspec
import pytest

from nybble.config import EngineConfig, decode_config, encode_config
from nybble.runtime.messages import (
    Codec,
    CoreInputs,
    EngineCoreFatal,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStartupFailed,
    EngineStats,
    FromCore,
    RequestLimits,
    RequestsFailed,
    Shutdown,
    SpecDecodeStats,
    ToCore,
    UtilityCall,
    UtilityResult,
)
from nybble.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

STATS = EngineStats(num_running=3, num_waiting=1, num_free_blocks=90, num_blocks=100,
                    kv_cache_usage=0.1, num_preemptions=2, peak_num_seqs_in_step=4,
                    num_steps=17, num_live_tokens=123, block_size=16,
                    num_cached_tokens_total=32, num_prefix_query_tokens_total=64,
                    prefix_cache_hit_rate=0.5,
                    spec_decode=SpecDecodeStats(4, 12, 7, [4, 2, 1]))


def _request(rid: str, seed: int | None) -> EngineCoreRequest:
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=seed,
                            max_tokens=12, stop=["\n", "é"], stop_token_ids=[7],
                            ignore_eos=True, logprobs=3, skip_special_tokens=False)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 403, 407],
                             params=params, stop_token_ids=[7, 2, 1], arrival_time=12.5)


TO_CORE = [
    CoreInputs(adds=[_request("a", SEED_MAX), _request("b", SEED_MIN), _request("c", None)],
               finishes=[("a", 1)], aborts=["b", "z"]),
    CoreInputs(),
    UtilityCall(call_id=7, method="get_stats"),
    Shutdown(),
]
FROM_CORE = [
    EngineCoreOutputs(request_ids=["a", "a", "c"], sample_indices=[0, 1, 0],
                      token_ids=[5, 9, 2], finish_reasons=[0, 2, 1],
                      logprobs=[-0.5, -1.25, -3.0], top_token_ids=[[5, 6], [9, 1], [2, 3]],
                      top_logprobs=[[-0.5, -1.0], [-1.25, -2.0], [-3.0, -4.0]],
                      first_scheduled=["c"], scheduled_time=3.25, stats=STATS),
    EngineCoreOutputs(stats=STATS),
    EngineCoreReady(limits=RequestLimits(512, 512, 8, 20, 13107, 16), eos_token_ids=[2, 1],
                    tokenizer_json='{"version": "1.0"}', threads=3, pid=4242),
    EngineCoreStartupFailed(message="model must be a local folder", user_error=True),
    UtilityResult(call_id=7, result=STATS),
    UtilityResult(call_id=8, error="method must be get_stats, got 'x'"),
    RequestsFailed(request_ids=["a", "c"], message="RuntimeError: boom"),
    EngineCoreFatal(message="3 engine steps failed in a row"),
]


@pytest.mark.parametrize("message", TO_CORE, ids=lambda m: type(m).__name__)
def test_to_core_round_trip(message: object) -> None:
    decoded = Codec(ToCore).decode(Codec(FromCore).encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("message", FROM_CORE, ids=lambda m: type(m).__name__)
def test_from_core_round_trip(message: object) -> None:
    decoded = Codec(FromCore).decode(Codec(ToCore).encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_sampling_params_keep_their_derived_fields() -> None:
    req = TO_CORE[0].adds[0]
    back = Codec(ToCore).decode(Codec(FromCore).encode(CoreInputs(adds=[req]))).adds[0]
    assert back.params.stop_list == ["\n", "é"] and back.max_tokens == 12
    assert isinstance(back.params, SamplingParams)


def test_each_side_refuses_the_other_sides_messages() -> None:
    with pytest.raises(msgspec.ValidationError):
        Codec(ToCore).decode(Codec(FromCore).encode(FROM_CORE[0]))
    with pytest.raises(msgspec.ValidationError):
        Codec(FromCore).decode(Codec(ToCore).encode(TO_CORE[0]))


def test_engine_config_crosses_as_json() -> None:
    config = EngineConfig.from_kwargs(max_num_seqs=7, block_size=32, num_gpu_blocks=99,
                                      enable_prefix_caching=True, dtype="bfloat16", threads=2,
                                      max_logprobs=5, served_model_name="x")
    assert decode_config(encode_config(config)) == config
    spec = EngineConfig.from_kwargs(speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 2})
    assert decode_config(encode_config(spec)) == spec
    bad = encode_config(config).replace('"max_num_seqs":7', '"max_num_seqs":0')
    with pytest.raises(msgspec.ValidationError, match="max_num_seqs must be >= 1"):
        decode_config(bad)
