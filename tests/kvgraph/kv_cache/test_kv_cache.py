"""KV cache specs, allocation and bind_kv_cache: the dict and list forms, sharing, every error."""

import re

import pytest
import torch
from torch import nn

import kvgraph
from kvgraph import KVCacheError

BLOCK, HEADS, KV_HEADS, HEAD, LORA, ROPE = 4, 4, 2, 8, 16, 4


class Block(nn.Module):
    """A decoder layer with attention at a given index, or a non-attention layer."""

    def __init__(self, index: int, kind: str):
        super().__init__()
        name = f"model.layers.{index}.attn"
        if kind == "mla":
            self.attn = kvgraph.MLAAttention(HEADS, LORA, ROPE, 0.1, name)
        elif kind in ("decoder", "encoder_only"):
            self.attn = kvgraph.Attention(HEADS, HEAD, 0.1, KV_HEADS, name, attn_type=kind)
        else:
            self.mlp = nn.Linear(2, 2)


def model_of_layers(kinds):
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(Block(i, kind) for i, kind in enumerate(kinds))
    return model


def layers_of(model):
    """{name: module} for every submodule, attention or not (bind must skip the rest)."""
    return {
        getattr(m, "layer_name", path): m
        for path, m in model.named_modules()
        if path
    }


def alloc(model, num_blocks=6, dtype=torch.float32, **kwargs):
    specs = kvgraph.kv_cache_specs(model, BLOCK, dtype, **kwargs)
    return specs, kvgraph.allocate_kv_caches(specs, num_blocks, "cpu")


def test_specs_shapes_and_bytes_per_block():
    spec = kvgraph.AttentionSpec(16, 8, 128, torch.bfloat16)
    assert spec.shapes(10) == ((10, 16, 8, 128),) * 2
    assert spec.bytes_per_block == 2 * 16 * 8 * 128 * 2
    mla = kvgraph.MLASpec(16, 512, 64, torch.float16)
    assert mla.shapes(3) == ((3, 16, 512), (3, 16, 64))
    assert mla.bytes_per_block == 16 * (512 + 64) * 2
    with pytest.raises(KVCacheError, match="floating point"):
        kvgraph.AttentionSpec(16, 8, 128, torch.int8)
    with pytest.raises(KVCacheError, match="block_size"):
        kvgraph.AttentionSpec(0, 8, 128, torch.float16)


def test_allocation_is_one_separate_tensor_per_role():
    model = model_of_layers(["decoder", "mla"])
    specs, caches = alloc(model)
    key, value = caches["model.layers.0.attn"]
    assert key.shape == value.shape == (6, BLOCK, KV_HEADS, HEAD)
    assert key.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
    kv_c, k_pe = caches["model.layers.1.attn"]
    assert (kv_c.shape, k_pe.shape) == ((6, BLOCK, LORA), (6, BLOCK, ROPE))
    with pytest.raises(KVCacheError, match="num_blocks"):
        kvgraph.allocate_kv_caches(specs, 0, "cpu")


def test_specs_skip_encoder_only_and_shared_layers():
    model = model_of_layers(["decoder", "encoder_only", "decoder"])
    specs = kvgraph.kv_cache_specs(model, BLOCK, torch.float32,
                                   shared_kv_cache_layers={"model.layers.2.attn": "model.layers.0.attn"})
    assert list(specs) == ["model.layers.0.attn"]


def test_bind_dict_form_sets_the_very_tuples():
    model = model_of_layers(["decoder", "mla"])
    _, caches = alloc(model)
    bound = kvgraph.bind_kv_cache(layers_of(model), caches)
    for name, layer in kvgraph.attention_layers(model).items():
        assert layer.kv_cache is bound[name]
        assert all(a is b for a, b in zip(layer.kv_cache, caches[name]))
        assert isinstance(layer.kv_cache, tuple)


def test_bind_list_form_follows_layer_index_with_gaps():
    # Module order 28, 3, 12; name order 12, 28, 3 ("model.layers.12" < "model.layers.28" <
    # "model.layers.3"); layer-index order 3, 12, 28. Each order gives every entry to a different
    # layer, so only sorting by layer index binds the list as asserted.
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([Block(28, "decoder"), Block(5, "encoder_only"),
                                        Block(3, "decoder"), Block(7, "mlp"), Block(12, "decoder")])
    spec = kvgraph.AttentionSpec(BLOCK, KV_HEADS, HEAD, torch.float32)
    caches = [spec.allocate(3, "cpu") for _ in range(3)]
    kvgraph.bind_kv_cache(layers_of(model), caches)
    attn = kvgraph.attention_layers(model)
    for index, cache in zip((3, 12, 28), caches):
        bound = attn[f"model.layers.{index}.attn"].kv_cache
        assert bound[0] is cache[0] and bound[1] is cache[1], index
    assert attn["model.layers.5.attn"].kv_cache == ()
    in_index_order = [f"model.layers.{i}.attn" for i in (3, 12, 28)]
    with pytest.raises(KVCacheError, match=re.escape(f"3 layers keep their own cache, in "
                                                     f"layer-index order: {in_index_order}")):
        kvgraph.bind_kv_cache(layers_of(model), caches[:2])


def test_bind_sharing_reuses_the_target_tuple_through_chains():
    model = model_of_layers(["decoder", "decoder", "decoder"])
    shared = {"model.layers.1.attn": "model.layers.0.attn",
              "model.layers.2.attn": "model.layers.1.attn"}
    _, caches = alloc(model, shared_kv_cache_layers=shared)
    kvgraph.bind_kv_cache(layers_of(model), caches, shared)
    layers = model.model.layers
    assert layers[1].attn.kv_cache is layers[0].attn.kv_cache
    assert layers[2].attn.kv_cache is layers[0].attn.kv_cache


def test_bind_rebinding_replaces_the_tuple():
    model = model_of_layers(["decoder"])
    _, first = alloc(model)
    _, second = alloc(model)
    kvgraph.bind_kv_cache(layers_of(model), first)
    kvgraph.bind_kv_cache(layers_of(model), second)
    assert model.model.layers[0].attn.kv_cache[0] is second["model.layers.0.attn"][0]


def _replace(caches, name, index, tensor):
    cache = list(caches[name])
    cache[index] = tensor
    return {**caches, name: tuple(cache)}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: {k: v for k, v in c.items() if k != "model.layers.1.attn"},
         r"no KV cache given for layer\(s\) \['model.layers.1.attn'\]"),
        (lambda c: {**c, "model.layers.9.attn": c["model.layers.0.attn"]}, "unknown layer 'model.layers.9.attn'"),
        (lambda c: _replace(c, "model.layers.0.attn", 0, torch.zeros(6, BLOCK, KV_HEADS, HEAD + 1)),
         r"key_cache: expected shape \(6, 4, 2, 8\), got \(6, 4, 2, 9\)"),
        (lambda c: _replace(c, "model.layers.0.attn", 1, torch.zeros(5, BLOCK, KV_HEADS, HEAD)),
         r"value_cache: expected shape \(6, 4, 2, 8\), got \(5, 4, 2, 8\)"),
        (lambda c: _replace(c, "model.layers.0.attn", 1, torch.zeros(6, BLOCK, KV_HEADS, HEAD, dtype=torch.float16)),
         "value_cache: expected dtype torch.float32, got torch.float16"),
        (lambda c: _replace(c, "model.layers.1.attn", 1, torch.zeros(6, BLOCK, ROPE + 2)),
         r"k_pe_cache: expected shape \(6, 4, 4\), got \(6, 4, 6\)"),
        (lambda c: {**c, "model.layers.0.attn": c["model.layers.0.attn"][:1]}, "expected 2 cache tensors, got 1"),
        (lambda c: {**c, "model.layers.0.attn": torch.zeros(2, 6, BLOCK, KV_HEADS, HEAD)}, "a tuple of tensors"),
        (lambda c: _replace(c, "model.layers.0.attn", 1, c["model.layers.0.attn"][0]), "separate allocations"),
        (lambda c: _replace(c, "model.layers.0.attn", 1,
                            torch.zeros(6, KV_HEADS, BLOCK, HEAD).transpose(1, 2)), "contiguous"),
    ],
)
def test_bind_errors_name_the_layer_and_what_was_expected(mutate, message):
    model = model_of_layers(["decoder", "mla"])
    _, caches = alloc(model)
    with pytest.raises(KVCacheError, match=message):
        kvgraph.bind_kv_cache(layers_of(model), mutate(caches))
    # Nothing is bound when any check fails.
    assert all(layer.kv_cache == () for layer in kvgraph.attention_layers(model).values())


def test_bind_checks_device_and_dtype_when_asked():
    model = model_of_layers(["decoder"])
    _, caches = alloc(model)
    with pytest.raises(KVCacheError, match="expected device meta, got cpu"):
        kvgraph.bind_kv_cache(layers_of(model), caches, device="meta")
    with pytest.raises(KVCacheError, match="expected dtype torch.bfloat16"):
        kvgraph.bind_kv_cache(layers_of(model), caches, dtype=torch.bfloat16)
    mixed = model_of_layers(["decoder", "decoder"])
    _, mixed_caches = alloc(mixed)
    mixed_caches["model.layers.1.attn"] = tuple(t.to("meta") for t in mixed_caches["model.layers.1.attn"])
    with pytest.raises(KVCacheError, match="layer 'model.layers.1.attn' key_cache: expected device cpu"):
        kvgraph.bind_kv_cache(layers_of(mixed), mixed_caches)


@pytest.mark.parametrize(
    "shared, message",
    [
        ({"model.layers.0.attn": "model.layers.2.attn"}, "does not come earlier"),
        ({"model.layers.1.attn": "model.layers.1.attn"}, "cycle"),
        ({"model.layers.0.attn": "model.layers.1.attn", "model.layers.1.attn": "model.layers.0.attn"}, "cycle"),
        ({"model.layers.1.attn": "model.layers.7.attn"}, "target 'model.layers.7.attn' is not an attention layer"),
        ({"model.layers.3.attn": "model.layers.0.attn"}, "layer 'model.layers.3.attn' is not an attention layer"),
    ],
)
def test_bind_sharing_errors(shared, message):
    model = model_of_layers(["decoder", "decoder", "decoder", "encoder_only"])
    _, caches = alloc(model)
    with pytest.raises(KVCacheError, match=message):
        kvgraph.bind_kv_cache(layers_of(model), caches, shared)


def test_bind_rejects_a_cache_for_a_sharing_layer_and_a_misnamed_key():
    model = model_of_layers(["decoder", "decoder"])
    _, caches = alloc(model)
    with pytest.raises(KVCacheError, match="shares the cache of 'model.layers.0.attn'; drop its entry"):
        kvgraph.bind_kv_cache(layers_of(model), caches, {"model.layers.1.attn": "model.layers.0.attn"})
    with pytest.raises(KVCacheError, match="key the dict by each layer's layer_name"):
        kvgraph.bind_kv_cache({"wrong": model.model.layers[0].attn}, caches)


def test_list_form_needs_layer_indices_and_duplicate_names_are_rejected():
    layer = kvgraph.Attention(HEADS, HEAD, 0.1, KV_HEADS, "attn")
    cache = kvgraph.AttentionSpec(BLOCK, KV_HEADS, HEAD, torch.float32).allocate(2, "cpu")
    with pytest.raises(KVCacheError, match="cannot tell the layer index of 'attn'"):
        kvgraph.bind_kv_cache({"attn": layer}, [cache])
    model = nn.Sequential(layer, kvgraph.Attention(HEADS, HEAD, 0.1, KV_HEADS, "attn"))
    with pytest.raises(KVCacheError, match="share the layer_name 'attn'"):
        kvgraph.attention_layers(model)


def test_one_cache_bound_to_two_layers_without_declaring_it_is_refused():
    model = model_of_layers(["decoder", "decoder"])
    _, caches = alloc(model)
    caches["model.layers.1.attn"] = caches["model.layers.0.attn"]
    with pytest.raises(KVCacheError, match=r"'model.layers.0.attn' and 'model.layers.1.attn' were "
                       r"given the same cache tensor.*shared_kv_cache_layers"):
        kvgraph.bind_kv_cache(layers_of(model), caches)
    assert all(layer.kv_cache == () for layer in kvgraph.attention_layers(model).values())


def test_a_dtype_that_is_not_a_torch_dtype_is_a_clear_error():
    model = model_of_layers(["decoder"])
    _, caches = alloc(model)
    with pytest.raises(KVCacheError, match="dtype: expected a torch.dtype.*'float32'"):
        kvgraph.bind_kv_cache(layers_of(model), caches, dtype="float32")


def test_a_failed_rebind_leaves_the_previous_binding():
    model = model_of_layers(["decoder", "mla"])
    _, first = alloc(model)
    kvgraph.bind_kv_cache(layers_of(model), first)
    _, second = alloc(model)
    second["model.layers.1.attn"] = second["model.layers.1.attn"][:1]  # one tensor short
    with pytest.raises(KVCacheError, match="expected 2 cache tensors"):
        kvgraph.bind_kv_cache(layers_of(model), second)
    for name, layer in kvgraph.attention_layers(model).items():
        assert all(a is b for a, b in zip(layer.kv_cache, first[name], strict=True)), name
