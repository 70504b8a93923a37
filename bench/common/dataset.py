"""The serving benchmarks' synthetic workload: seeded requests of common words, their bodies, and
Poisson arrival times.

Request i gets an input length drawn uniformly from [input_len * (1 - range_ratio),
input_len * (1 + range_ratio)] and an output length drawn the same way from output_len; its prompt
is that many words drawn uniformly from a fixed list of 136 common English words (one token each,
with their leading space, in GPT-2/Llama-style BPE vocabularies), so prompt lengths in tokens are
close to the drawn lengths. With a prefix length P, every prompt starts with the same P-word prefix
(the system message on the chat endpoint). Every body asks to ignore EOS, so each request produces
exactly its drawn output length.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

_WORDS_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view"
)
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prefix: str
    text: str
    input_len: int  # drawn, in words
    output_len: int


def draw_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def synthetic_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
) -> list[BenchRequest]:
    """The seeded workload described in the module docstring (same seed, same requests)."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
    requests = []
    for i in range(num_prompts):
        n_in = draw_len(rng, input_len, range_ratio)
        n_out = draw_len(rng, output_len, range_ratio)
        text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        requests.append(BenchRequest(i, prefix, text, n_in, n_out))
    return requests


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `request_rate`; all 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, offsets = 0.0, []
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


def request_prompt(req: BenchRequest, endpoint: str) -> str | list[dict[str, str]]:
    """What the request sends: the completions prompt, or the chat messages."""
    if endpoint == "chat":
        messages = [{"role": "user", "content": req.text}]
        if req.prefix:
            messages.insert(0, {"role": "system", "content": req.prefix})
        return messages
    return f"{req.prefix} {req.text}" if req.prefix else req.text


def request_body(
    req: BenchRequest, endpoint: str, model: str, temperature: float = 0.0
) -> dict[str, Any]:
    common = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = request_prompt(req, endpoint)
    return {**common, "messages" if endpoint == "chat" else "prompt": prompt}
