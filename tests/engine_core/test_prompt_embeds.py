"""Prompt embeddings on the wire (PromptEmbeds), as clients encode them, and as they key KV blocks."""

from __future__ import annotations

import base64
import io

import msgspec
import pytest
import torch

from engine_core.core.kv_cache_utils import extend_block_hashes
from engine_core.outputs import EngineCoreRequest
from engine_core.prompt_embeds import PromptEmbeds, decode_prompt_embeds, encode_prompt_embeds
from engine_core.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_tensor_crosses_the_request_channel_unchanged(dtype):
    tensor = torch.randn(5, 8).to(dtype)
    embeds = PromptEmbeds.from_tensor(tensor)
    assert (embeds.num_tokens, embeds.hidden_size, embeds.dtype) == (5, 8, str(dtype).removeprefix("torch."))
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[0] * 5, sampling_params=SamplingParams(),
                                prompt_embeds=embeds)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert back.prompt_embeds == embeds
    assert torch.equal(back.prompt_embeds.to_tensor(), tensor)


def test_base64_of_torch_save_decodes_and_a_batch_of_one_is_squeezed():
    tensor = torch.randn(1, 3, 4)
    embeds = decode_prompt_embeds(encode_prompt_embeds(tensor))
    assert torch.equal(embeds.to_tensor(), tensor[0])
    assert torch.equal(decode_prompt_embeds(encode_prompt_embeds(tensor[0]).encode()).to_tensor(), tensor[0])


def _saved(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(("encoded", "problem"), [
    ("not base64!", "base64"),
    (base64.b64encode(b"not a pickle").decode(), "torch.save"),
    (_saved({"a": torch.zeros(2)}), "must be a tensor"),
    (_saved(torch.zeros(3, dtype=torch.float32)), r"\[num_tokens, hidden_size\]"),
    (_saved(torch.zeros(2, 3, 4)), r"\[num_tokens, hidden_size\]"),
    (_saved(torch.zeros(2, 4, dtype=torch.int64)), "one of float32"),
    (_saved(torch.zeros(0, 4)), "at least one row"),
    (_saved(torch.tensor([[1.0, float("nan")]])), "finite"),
])
def test_what_is_not_a_prompts_embeddings_is_refused_with_the_reason(encoded, problem):
    with pytest.raises(ValueError, match=problem):
        decode_prompt_embeds(encoded)


def test_a_struct_whose_bytes_do_not_match_its_shape_does_not_decode():
    good = PromptEmbeds.from_tensor(torch.zeros(2, 4))
    wire = msgspec.msgpack.encode(good)
    assert msgspec.msgpack.decode(wire, type=PromptEmbeds) == good
    bad = msgspec.msgpack.encode(["float32", 3, 4, good.data])
    with pytest.raises(msgspec.ValidationError, match="bytes"):
        msgspec.msgpack.decode(bad, type=PromptEmbeds)


def test_embeddings_larger_than_a_request_frame_are_refused():
    from engine_core.channel import MAX_FRAME_BYTES
    from engine_core.prompt_embeds import MAX_PROMPT_EMBEDS_BYTES

    assert MAX_PROMPT_EMBEDS_BYTES < MAX_FRAME_BYTES
    rows = MAX_PROMPT_EMBEDS_BYTES // (4 * 1024) + 1
    with pytest.raises(ValueError, match="larger than a request may carry"):
        PromptEmbeds("float32", rows, 1024, b"")


def test_last_keeps_the_final_rows():
    tensor = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    embeds = PromptEmbeds.from_tensor(tensor)
    assert torch.equal(embeds.last(2).to_tensor(), tensor[3:])
    assert embeds.last(9) is embeds


def _hashes(embeds: PromptEmbeds | None, num_tokens: int, salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [0] * num_tokens, num_tokens // 4, 4, cache_salt=salt, prompt_embeds=embeds)
    return hashes


def test_block_hashes_follow_the_embeddings_not_the_placeholders():
    rows = torch.randn(10, 8)
    a = PromptEmbeds.from_tensor(rows)
    same = PromptEmbeds.from_tensor(rows.clone())
    changed = rows.clone()
    changed[6] += 1.0  # (in the second block of four)
    b = PromptEmbeds.from_tensor(changed)
    assert _hashes(a, 10) == _hashes(same, 10)
    ha, hb = _hashes(a, 10), _hashes(b, 10)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # Placeholder ids alone (a token prompt of zeros) never share a block with embeddings.
    assert not set(_hashes(None, 10)) & set(ha)
    # The same values in another dtype are other inputs; a salt still keys the first block.
    assert not set(_hashes(PromptEmbeds.from_tensor(rows.half()), 10)) & set(ha)
    assert _hashes(a, 10, salt="s")[0] != ha[0]
    # A block of outputs after the embeddings (rows 8..9 then two generated tokens) is keyed by the rows it holds.
    assert a.block_digest(2, 4) is not None and a.block_digest(3, 4) is None


_CRAFTED = """
import base64, io, sys, torch
from engine_core.prompt_embeds import decode_prompt_embeds
kind = sys.argv[1]
if kind == "index past its shape":  # (vLLM's CVE-2025-62164: to_dense() wrote out of bounds)
    t = torch.sparse_coo_tensor(torch.tensor([[0, 50_000_000], [0, 1]]), torch.tensor([1.0, 2.0]), (2, 4),
                                check_invariants=False, is_coalesced=True)
elif kind == "a huge dense shape":
    t = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (100000, 4096),
                                check_invariants=False)
else:
    t = torch.sparse_csr_tensor(torch.tensor([0, 1, 9]), torch.tensor([0, 7]), torch.tensor([1.0, 2.0]), (2, 4),
                                check_invariants=False)
buffer = io.BytesIO()
torch.save(t, buffer)
try:
    decode_prompt_embeds(base64.b64encode(buffer.getvalue()).decode())
    print("accepted")
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("kind", ["index past its shape", "a huge dense shape", "a bad CSR index"])
def test_a_crafted_sparse_tensor_is_refused_without_harm(kind):
    """In a process of its own: the old decode crashed (a segfault) on the first of these, and
    allocated gigabytes on the second."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CRAFTED, kind], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("refused:"), done.stdout


def test_a_small_sparse_tensor_within_its_shape_still_decodes():
    dense = torch.zeros(3, 4)
    dense[1, 2] = 0.5
    buffer = io.BytesIO()
    torch.save(dense.to_sparse(), buffer)
    embeds = decode_prompt_embeds(base64.b64encode(buffer.getvalue()).decode())
    assert torch.equal(embeds.to_tensor(), dense)
