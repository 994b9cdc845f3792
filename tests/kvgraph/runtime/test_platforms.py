"""Platforms: the CPU graph keeps the device-graph contract; NPU support loads only on request."""

import subprocess
import sys

import pytest
import torch

import kvgraph
from kvgraph.errors import GraphError, PlatformError
from kvgraph.runtime.platforms import get_platform


def test_cpu_graph_replays_into_the_buffers_it_captured():
    graph = get_platform("cpu").make_graph(check_inputs=True)
    x = torch.tensor([1.0, 2.0])
    captured = graph.capture(lambda t: (t * 2, t + 1), (x,), pool=None)
    first = [o.clone() for o in captured]
    x.copy_(torch.tensor([5.0, 7.0]))  # new step: inputs filled in place
    replayed = graph.replay((x,))
    assert all(a is b for a, b in zip(replayed, captured)), "replay must reuse output buffers"
    torch.testing.assert_close(replayed[0], torch.tensor([10.0, 14.0]))
    torch.testing.assert_close(replayed[1], torch.tensor([6.0, 8.0]))
    assert not torch.equal(captured[0], first[0]), "the previous step's output was overwritten"


def test_a_cpu_capture_returns_buffers_not_results_as_a_device_capture_does():
    graph = get_platform("cpu").make_graph(check_inputs=False)
    x = torch.tensor([1.0, 2.0])
    doubled, passed_through, as_int = graph.capture(lambda t: (t * 2, t, (t * 3).long()), (x,),
                                                    pool=None)
    assert torch.isnan(doubled).all(), "a capture's float outputs must not look like results"
    assert (as_int == torch.iinfo(torch.long).min).all()
    assert passed_through is x and x.tolist() == [1.0, 2.0], "an input passed through is kept"
    held = doubled.untyped_storage().nbytes() + as_int.untyped_storage().nbytes()
    assert graph.memory_bytes == held, "outputs the graph owns, not the input passed through"
    graph.replay((x,))
    assert doubled.tolist() == [2.0, 4.0] and as_int.tolist() == [3, 6]
    graph.reset()
    assert graph.memory_bytes == 0 and graph.outputs is None


def test_cpu_graph_refuses_inputs_that_moved_when_checking():
    graph = get_platform("cpu").make_graph(check_inputs=True)
    x = torch.ones(3)
    graph.capture(lambda t: t * 2, (x,), pool=None)
    with pytest.raises(GraphError, match=r"inputs \[0\] are not at the addresses"):
        graph.replay((torch.ones(3),))
    unchecked = get_platform("cpu").make_graph(check_inputs=False)
    unchecked.capture(lambda t: t * 2, (x,), pool=None)
    torch.testing.assert_close(unchecked.replay((torch.full((3,), 4.0),)), torch.full((3,), 8.0))


def test_unknown_device_and_missing_torch_npu_are_clear_errors():
    with pytest.raises(PlatformError, match="no kvgraph platform for device 'tpu'"):
        get_platform("tpu")
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is installed here")
    with pytest.raises(PlatformError, match="needs torch_npu with the Ascend toolkit"):
        get_platform("npu:0")


def test_a_runner_on_an_npu_without_torch_npu_is_a_clear_error():
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is installed here")
    from tests.support.scenario import make_model

    with pytest.raises(PlatformError, match="needs torch_npu with the Ascend toolkit"):
        kvgraph.ModelRunner(make_model("llama"), num_blocks=4, block_size=4, max_num_tokens=8,
                            max_num_seqs=2, device="npu")


def test_importing_kvgraph_does_not_import_torch_npu():
    code = "import sys, kvgraph; print('torch_npu' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.cuda
def test_cuda_graph_replays_into_the_buffers_it_captured():
    platform = get_platform("cuda")
    graph = platform.make_graph(check_inputs=True)
    x = torch.ones(4, device="cuda")
    for _ in range(2):  # warm up outside capture, as the runner does
        x * 2
    torch.cuda.synchronize()
    captured = graph.capture(lambda t: t * 2, (x,), platform.new_graph_pool())
    x.fill_(3.0)
    replayed = graph.replay((x,))  # a weak alias of the memory `captured` still holds
    assert replayed.data_ptr() == captured.data_ptr()
    torch.testing.assert_close(captured, torch.full((4,), 6.0, device="cuda"))
    torch.testing.assert_close(replayed, captured)


def test_cuda_attention_defaults_to_triton_and_the_cpu_to_cpu_paged():
    # Building the CUDA platform touches no device, so its default is checkable here.
    from kvgraph.runtime.platforms.cuda import cuda_platform

    assert cuda_platform().attention_backend == "triton"
    # The C++ kernels reading the cache in place; torch_native stays the reference.
    assert get_platform("cpu").attention_backend == "cpu_paged"


def test_a_device_capture_phase_keeps_the_allocator_cache_and_restores_it_after():
    # torch.cuda.graph empties the allocator's cache on entry; over many captures that frees and
    # re-allocates the warm-up runs' memory each time. Entering the phase touches no device.
    from kvgraph.runtime.platforms.cuda import cuda_platform

    original = torch.cuda.empty_cache
    with cuda_platform().capture_phase():
        assert torch.cuda.empty_cache is not original
        torch.cuda.empty_cache()  # a no-op here, even without a GPU
    assert torch.cuda.empty_cache is original
    with pytest.raises(RuntimeError, match="capture failed"):
        with cuda_platform().capture_phase():
            raise RuntimeError("capture failed")
    assert torch.cuda.empty_cache is original


def test_a_device_graph_keeps_only_weak_references_to_its_outputs():
    """The reference discipline that lets a runner's sizes share one pool (vLLM's): a device
    graph's outputs stay alive only while the step's forward uses them, and a last graph's
    (the forward's own) not even that long. Checked with StreamGraph over a stand-in for the
    device graph API that runs the callable eagerly on the CPU."""
    import contextlib
    import gc
    import weakref

    from kvgraph.runtime.platforms.stream import StreamGraph

    class Graph:
        def replay(self):
            pass

        def reset(self):
            pass

    @contextlib.contextmanager
    def graph_context(graph, pool=None):
        yield

    for last in (False, True):
        made = []

        def fn(x):
            y = x * 2
            made.append(weakref.ref(y))
            return (y,)

        graph = StreamGraph(Graph(), graph_context, lambda pool: 0, False, "piece", last)
        (returned,) = graph.capture(fn, (torch.ones(4),), pool=None)
        pointer = returned.data_ptr()
        gc.collect()
        assert (made[0]() is None) == last, "a last graph's outputs are released in capture"
        del returned
        gc.collect()
        assert made[0]() is None, "the graph kept its output alive"
        assert graph.replay((torch.ones(4),))[0].data_ptr() == pointer, "same memory each replay"


# --- the defaults a serving engine asks of a platform ---------------------------------------


def protocol_members(protocol: type) -> set[str]:
    declared = set(getattr(protocol, "__annotations__", {}))
    return declared | {name for name, value in vars(protocol).items()
                       if callable(value) and not name.startswith("_")}


def test_every_platform_answers_the_whole_protocol():
    from kvgraph.runtime.platforms import Platform
    from kvgraph.runtime.platforms.cuda import cuda_platform

    for platform in (get_platform("cpu"), cuda_platform()):
        missing = [m for m in sorted(protocol_members(Platform)) if not hasattr(platform, m)]
        assert not missing, f"{platform.name} lacks {missing}"


def test_the_cpu_serves_with_its_measured_defaults():
    from kvgraph.runtime.platforms.base import SERVING_CORES

    cpu = get_platform("cpu")
    assert cpu.default_graph_mode is kvgraph.GraphMode.FULL
    assert (cpu.default_max_num_tokens, cpu.captures_decode_only) == (1024, True)
    assert (cpu.default_burst_gap_ms, cpu.serving_cores) == (3.0, SERVING_CORES)
    assert (cpu.distributed_backend, cpu.device_memory) == ("gloo", None)
    assert cpu.rank_device(0) == cpu.rank_device(3) == "cpu"  # the ranks share the CPU
    cpu.set_device(3)
    assert cpu.total_memory("cpu") > 2**20


def test_a_gpu_serves_with_kvgraphs_defaults_and_its_own_collectives():
    # Building the CUDA platform touches no device ("gpu": the cuda keyword marks GPU tests).
    from kvgraph.runtime.platforms.cuda import cuda_platform

    gpu = cuda_platform()
    assert gpu.default_graph_mode is None  # kvgraph's own, piecewise
    assert (gpu.default_max_num_tokens, gpu.captures_decode_only) == (128, False)
    assert (gpu.default_burst_gap_ms, gpu.distributed_backend) == (0.0, "nccl")
    assert gpu.device_memory is torch.cuda  # its caching allocator sizes the KV cache
    assert gpu.rank_device(1) == "cuda:1"


def test_the_cpu_packs_weights_then_moves_them_to_huge_pages_and_keeps_freed_memory(
        monkeypatch):
    from kvgraph.runtime.platforms import cpu as cpu_module

    calls: list[str] = []
    for name in ("pack_linear_weights", "use_small_batch_linear", "use_huge_pages"):
        monkeypatch.setattr(cpu_module, name, lambda model, name=name: calls.append(name))
    monkeypatch.setattr(cpu_module.malloc_policy, "keep_freed_memory",
                        lambda: calls.append("keep_freed_memory"))
    cpu = get_platform("cpu")
    model = torch.nn.Linear(2, 2)
    cpu.prepare_model(model, pack_weights=True, huge_pages=True)
    cpu.prepare_process(keep_freed_memory=True)
    assert calls == ["pack_linear_weights", "use_small_batch_linear", "use_huge_pages",
                     "keep_freed_memory"]  # huge pages after packing: the final bytes
    calls.clear()
    cpu.prepare_model(model, pack_weights=False, huge_pages=False)
    cpu.prepare_process(keep_freed_memory=False)
    assert calls == []


def test_a_gpu_leaves_the_weights_and_the_allocator_as_they_are():
    from kvgraph.runtime.platforms.cuda import cuda_platform

    model = torch.nn.Linear(2, 2)
    weight = model.weight
    cuda_platform().prepare_model(model, pack_weights=True, huge_pages=True)
    cuda_platform().prepare_process(keep_freed_memory=True)
    assert model.weight is weight and model.weight.layout == torch.strided
