"""Prefill on one device and decode on another: the sequence's KV pages move once, and the
tokens are those of a one-device run. The stage placement's decision rule, on device
descriptions where each choice must win."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gimlet_tvm.llm as gllm  # noqa: E402
from gimlet_tvm.errors import LLMError  # noqa: E402
from gimlet_tvm.errors import RemoteDeviceError  # noqa: E402
from gimlet_tvm.llm.config import LLMConfig  # noqa: E402
from gimlet_tvm.llm.stages import SplitLLM, Workload, place_stages  # noqa: E402
from gimlet_tvm.runtime.remote import RemoteDevice  # noqa: E402
from gimlet_tvm.targets.spec import PerfFacts  # noqa: E402
from tests.llm_models import SMOLLM2_GGUF, random_model  # noqa: E402
from tests.test_rpc import Service, free_port  # noqa: E402

STRONG_WEIGHTS = dict(initializer_range=0.3)  # attention far from uniform: a lost page shows


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder, _ = random_model("llama", dict(num_attention_heads=8, num_key_value_heads=2, **STRONG_WEIGHTS),
                             tmp_path_factory.mktemp("llama"))
    return folder


@pytest.mark.parametrize("prefill,decode", [("vulkan", "llvm"), ("llvm", "vulkan")])
def test_split_run_gives_the_one_device_tokens(llama_folder, prefill, decode):
    alone = gllm.load(llama_folder, target="llvm")
    split = gllm.load(llama_folder, targets=["vulkan", "llvm"], pins={"prefill": prefill, "decode": decode})
    assert split.placement().devices == {"prefill": prefill, "decode": decode}
    rng = np.random.default_rng(1)
    for length in (5, 40):  # within a page, and across pages
        ids = rng.integers(0, alone.config.vocab_size, length).tolist()
        want = alone.generate(ids, max_new_tokens=24)
        moved = split.kv_bytes_moved
        got = split.generate(ids, max_new_tokens=24)
        assert got.token_ids == want.token_ids and got.kv_bytes_moved == split.kv_bytes_moved - moved
        # Pages of whole 16-token pages, keys and values, every layer: moved once.
        config = alone.config
        pages = -(-length // 16)
        assert split.kv_bytes_moved - moved == pages * 16 * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    for engine in split.engines.values():
        assert engine._sequences == {}


@pytest.mark.slow
@pytest.mark.parametrize("prefill,decode", [("vulkan", "llvm"), ("llvm", "vulkan")])
def test_smollm2_split_over_vulkan_and_llvm(prefill, decode):
    """SmolLM2 (real weights): 64 greedy tokens (16 when lavapipe decodes) of a split run are
    the llvm run's."""
    alone = gllm.load(SMOLLM2_GGUF, target="llvm")
    split = gllm.load(SMOLLM2_GGUF, targets=["vulkan", "llvm"], pins={"prefill": prefill, "decode": decode})
    ids = alone.chat_prompt([{"role": "user", "content": "Write a haiku about the sea."}])
    new = 64 if decode == "llvm" else 16
    assert split.generate(ids, max_new_tokens=new).token_ids == alone.generate(ids, max_new_tokens=new).token_ids


@pytest.fixture
def rpc_server():
    service = Service("server", "--port", str(free_port()))
    yield service
    service.stop()


@pytest.mark.parametrize("remote_stage", ["decode", "prefill"])
def test_prefill_and_decode_in_two_processes_over_rpc(rpc_server, remote_stage):
    """SmolLM2 (Q8) with one stage in an RPC server's process on 127.0.0.1: the pages go over
    once, and the tokens are the one-process run's."""
    local = gllm.load(SMOLLM2_GGUF, target="llvm", quantization="q8")
    remote = gllm.load(SMOLLM2_GGUF, target="llvm", quantization="q8",
                       remote=RemoteDevice(server=rpc_server.address, timeout=120))
    assert remote.where == f"llvm on RPC server {rpc_server.address}"
    split = SplitLLM.from_engines(**{remote_stage: remote, ("prefill" if remote_stage == "decode" else "decode"): local})
    ids = local.chat_prompt([{"role": "user", "content": "Name three rivers in Europe."}])
    want = local.generate(ids, max_new_tokens=32)
    assert split.generate(ids, max_new_tokens=32).token_ids == want.token_ids
    assert split.kv_bytes_moved > 0 and remote._sequences == {} and local._sequences == {}
    rpc_server.stop()  # the remote stage's process dies: a typed error naming the server
    with pytest.raises(RemoteDeviceError, match=rpc_server.address):
        split.generate(ids, max_new_tokens=4)


def test_exported_pages_continue_a_sequence_exactly():
    """SmolLM2 (real weights) on llvm: a sequence exported and imported into another engine's
    cache decodes to the same logits as the original, bit for bit."""
    one, other = gllm.load(SMOLLM2_GGUF, target="llvm"), gllm.load(SMOLLM2_GGUF, target="llvm")
    ids = one.chat_prompt([{"role": "user", "content": "What is the tallest mountain?"}])
    seq = one.add_sequence()
    one.prefill([seq], [ids])
    pages = one.export_sequence(seq)
    assert pages.length == len(ids) and other.sequence_length(copy := other.import_sequence(pages)) == len(ids)
    token = 504
    for _ in range(8):
        a, b = one.decode([seq], [token])[0], other.decode([copy], [token])[0]
        np.testing.assert_array_equal(a, b)
        token = int(np.argmax(a))
    one.remove_sequence(seq)
    other.remove_sequence(copy)


def test_pages_of_another_layout_are_refused(llama_folder, tmp_path):
    folder, _ = random_model("llama", dict(num_attention_heads=4, num_key_value_heads=4), tmp_path)
    source, target = gllm.load(llama_folder, target="llvm"), gllm.load(folder, target="llvm")
    seq = source.add_sequence()
    source.prefill([seq], [[1, 2, 3]])
    with pytest.raises(LLMError, match="do not fit this model's cache"):
        target.import_sequence(source.export_sequence(seq))
    assert target._sequences == {} and target.generate([1, 2, 3], max_new_tokens=2).token_ids


SMOLLM2 = LLMConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, context_length=8192, norm_eps=1e-5,
                    hidden_act="silu")
CPU = PerfFacts(peak_gflops=200, memory_gbps=40, launch_us=1, link_gbps=None, copy_us=0)
# Much arithmetic, little bandwidth (prefills best) / the opposite (decodes best).
COMPUTE = PerfFacts(peak_gflops=20000, memory_gbps=20, launch_us=5, link_gbps=25, copy_us=10)
BANDWIDTH = PerfFacts(peak_gflops=1000, memory_gbps=2000, launch_us=5, link_gbps=25, copy_us=10)


def test_each_stage_goes_where_it_is_cheapest():
    placed = place_stages(SMOLLM2, None, {"cpu": CPU, "compute": COMPUTE, "bandwidth": BANDWIDTH},
                          Workload(prompt_tokens=2048, new_tokens=256))
    assert placed.devices == {"prefill": "compute", "decode": "bandwidth"}
    assert placed.predicted["move_s"] > 0 and "moving the KV cache" in placed.reasons["decode"]


def test_a_slow_link_keeps_both_stages_on_one_device():
    slow = {"cpu": CPU, "compute": dataclasses.replace(COMPUTE, link_gbps=0.001),
            "bandwidth": dataclasses.replace(BANDWIDTH, link_gbps=0.001)}
    placed = place_stages(SMOLLM2, None, slow, Workload(prompt_tokens=2048, new_tokens=256))
    assert placed.devices["prefill"] == placed.devices["decode"] and placed.predicted["move_s"] == 0


def test_short_prompts_skip_the_prefill_device():
    """A 4-token prompt is not worth moving: everything decodes where decode is fastest."""
    placed = place_stages(SMOLLM2, None, {"compute": COMPUTE, "bandwidth": BANDWIDTH},
                          Workload(prompt_tokens=4, new_tokens=256))
    assert placed.devices == {"prefill": "bandwidth", "decode": "bandwidth"}


def test_pins_and_the_draft():
    facts = {"cpu": CPU, "compute": COMPUTE, "bandwidth": BANDWIDTH}
    draft = (LLMConfig(**{**SMOLLM2.to_json(), "num_layers": 4}), "q4")
    placed = place_stages(SMOLLM2, None, facts, Workload(2048, 256), pins={"decode": "cpu"}, draft=draft)
    assert placed.devices == {"prefill": "compute", "decode": "cpu", "draft": "bandwidth"}
    assert placed.reasons["decode"].startswith("pinned")
    with pytest.raises(LLMError, match="pins must map"):
        place_stages(SMOLLM2, None, facts, pins={"decode": "tpu"})

