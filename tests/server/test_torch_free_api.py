"""The API process loads its tokenizer with torch kept out
(kvpilot.engine.model.files.torch_kept_out): a real `kvpilot serve`'s API process maps no torch
library once ready and after a plain request, and still serves structured outputs and tools (whose
xgrammar brings torch in afterwards), in the process and in its big-body worker; the tokenizer
transformers loads without torch gives the same outputs as the one it loads with torch, on
SmolLM2's tokenizer and on a SentencePiece-style one that adds a BOS and normalizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path

from .serve_process import launch_serve

# Loads a tokenizer in a fresh interpreter, with torch kept out or not (argv[2]), and prints what
# the API process asks of it.
TOKENIZE = r"""
import json, sys
from pathlib import Path
from contextlib import nullcontext
from kvpilot.engine.model.files import load_tokenizer, set_offline_defaults, torch_kept_out

set_offline_defaults()
with torch_kept_out() if sys.argv[2] == "without torch" else nullcontext():
    tok = load_tokenizer(Path(sys.argv[1]))
    torch_loaded = sys.modules.get("torch") is not None
assert sys.modules.get("torch", "absent") is not None  # lifted after the load
texts = ["Hello, world!", "  two  spaces\nand a tab\t", "héllo wörld ✓ 日本語", "<s> in text </s>"]
ids = [tok.encode(t) for t in texts]
chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
print(json.dumps({
    "torch": torch_loaded,
    "class": type(tok).__name__,
    "len": len(tok),
    "eos": tok.eos_token_id,
    "encoded": ids,
    "no_specials": [tok.encode(t, add_special_tokens=False) for t in texts],
    "decoded": [tok.decode(i) for i in ids],
    "skipped": tok.batch_decode(ids, skip_special_tokens=True),
    "chat": tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
    "tools": tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False),
    "continued": tok.apply_chat_template(
        [*chat, {"role": "assistant", "content": "Hel"}], continue_final_message=True,
        tokenize=False,
    ),
}))
"""


def tokenize(directory: Path, how: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", TOKENIZE, str(directory), how],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def sentencepiece_style(directory: Path) -> Path:
    """A small Llama-2-like tokenizer: NFKC normalizer, metaspace, a BOS added on encode."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    for word in ("▁Hello", "▁world", "!", ",", "▁two", "▁spaces", "▁and", "▁a", "▁tab", "▁in"):
        vocab.setdefault(word, len(vocab))
    for char in sorted(set("Hellowrdtspacnbhéöü✓日本語xi<>/\n\t")):
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
        "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
    )
    fast.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("which", ["smollm2", "sentencepiece-style"])
def test_the_tokenizer_without_torch_gives_what_it_gives_with_torch(
    which: str, tmp_path: Path
) -> None:
    if which == "smollm2":
        directory = gguf_to_hf_dir(bundled_gguf_path())
    else:
        directory = sentencepiece_style(tmp_path / "tokenizer")
    without = tokenize(directory, "without torch")
    with_torch = tokenize(directory, "with torch")
    assert without.pop("torch") is False
    with_torch.pop("torch")
    assert without == with_torch
    # The comparison compared something: real ids, the special tokens, the template's output.
    assert all(without["encoded"]) and without["chat"] and without["continued"]
    if which == "sentencepiece-style":
        assert all(ids[0] == 1 for ids in without["encoded"])  # the BOS the post-processor adds


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def chat(url: str, **body: object) -> httpx.Response:
    messages = body.pop("messages", [{"role": "user", "content": "Hi"}])
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8, **body},
        timeout=120,
    )


def test_the_served_api_process_loads_no_torch_and_still_serves_grammars() -> None:
    with launch_serve() as served:
        answer = chat(served.url)
        assert answer.status_code == 200, answer.text
        api_maps = Path(f"/proc/{served.proc.pid}/maps").read_text()
        core_maps = Path(f"/proc/{served.core_pid()}/maps").read_text()
        # What needs torch in the API process still works once the load is over: xgrammar
        # checks a schema and a forced tool call's grammar...
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        answer = chat(served.url, response_format=schema)
        assert answer.status_code == 200, answer.text
        answer = chat(served.url, tools=[TOOL], tool_choice="required")
        assert answer.status_code == 200, answer.text
        # ... and in the big-body worker (over 1 MiB): the schema is checked there, then the
        # prompt is refused by its length, a 400, not a 500.
        big = [{"role": "user", "content": "word " * 300_000}]
        answer = chat(served.url, messages=big, response_format=schema)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert "libtorch" not in api_maps
    assert "libtorch" in core_maps  # what the check looks for is what torch's import maps
