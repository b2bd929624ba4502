"""A vision-language model's per-image tensors split with their samples (distcore/sample_rows.py): the rows each
sample owns, read from its placeholder tokens; the layouts read from transformers' models; the pipeline's
micro-batches; and the meta run of a stand-in whose shapes come from integers (a vision tower on a later stage)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tridist.distcore.pipeline import _MetaWhereMeta, _to_meta_but_integers, split_micro_batches
from tridist.distcore.sample_rows import (
    MediaRows,
    Offsets,
    SampleRows,
    check_rows,
    media_encoders,
    sample_rows_of,
    split_samples,
)

IMAGE, OTHER = 250, 7
GRID = SampleRows((MediaRows(IMAGE, "pixel_values", grid="image_grid_thw", merge=2),))
FIXED = SampleRows((MediaRows(IMAGE, "pixel_values", per_item=("image_sizes",)),))


def _ids(placeholders: list[int], length: int = 24) -> torch.Tensor:
    ids = torch.full((len(placeholders), length), OTHER)
    for sample, count in enumerate(placeholders):
        ids[sample, 2:2 + count] = IMAGE
    return ids


def _grid_batch():
    """Three samples: two images (4 x 4 and 4 x 8 patches: 4 and 8 placeholders at a 2 x 2 merge), none, one
    (8 x 8: 16). Each patch's row holds its image's index, so a slice shows whose rows it took."""
    grid = torch.tensor([[1, 4, 4], [1, 4, 8], [1, 8, 8]])
    pixels = torch.cat([torch.full((int(t * h * w), 3), float(i)) for i, (t, h, w) in enumerate(grid.tolist())])
    ids = _ids([4 + 8, 0, 16])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "image_grid_thw": grid}


def test_a_grids_images_go_with_the_samples_whose_placeholders_they_fill():
    batch = _grid_batch()
    samples, starts = check_rows(batch, GRID, "test")
    assert samples == 3
    assert starts == {"pixel_values": Offsets([0, 16 + 32, 16 + 32, 16 + 32 + 64], [0, 2, 2, 3]),
                      "image_grid_thw": Offsets([0, 2, 2, 3], [0, 2, 2, 3])}
    first, rest = split_samples(batch, starts, [(0, 1), (1, 3)])
    assert first["pixel_values"][:, 0].unique().tolist() == [0.0, 1.0] and first["pixel_values"].shape[0] == 48
    assert rest["pixel_values"][:, 0].unique().tolist() == [2.0] and rest["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert rest["input_ids"].shape == (2, 24) and torch.equal(rest["attention_mask"], batch["attention_mask"][1:])
    # The sample without images alone: no images (None, as a call of text alone passes), not an empty tensor
    middle, = split_samples(batch, starts, [(1, 2)])
    assert middle["pixel_values"] is None and middle["image_grid_thw"] is None and middle["input_ids"].shape[0] == 1


def test_images_of_one_placeholder_count_go_with_their_samples():
    """LLaVA's layout: [images, C, H, W], each image the same number of placeholders (here 5): samples of 2, 0 and
    1 images."""
    pixels = torch.arange(3.0).reshape(3, 1, 1, 1).expand(3, 3, 2, 2)
    batch = {"input_ids": _ids([10, 0, 5]), "pixel_values": pixels}
    _, starts = check_rows(batch, FIXED, "test")
    assert starts == {"pixel_values": Offsets([0, 2, 2, 3], [0, 2, 2, 3])}
    parts = split_samples(batch, starts, [(0, 1), (1, 2), (2, 3)])
    assert parts[1]["pixel_values"] is None
    assert [parts[i]["pixel_values"][:, 0, 0, 0].tolist() for i in (0, 2)] == [[0.0, 1.0], [2.0]]


@pytest.mark.parametrize("change, words", [
    (lambda b: b["input_ids"].__setitem__((0, 2), OTHER), "not whole items"),  # 11 placeholders: not 4 + 8
    (lambda b: b["input_ids"].__setitem__((2, slice(0, 24)), OTHER), "have no placeholder"),  # the third image's gone
    (lambda b: b.__setitem__("pixel_values", b["pixel_values"][:-1]), r"111 row\(s\) where the batch's 3 item\(s\) take 112"),
    (lambda b: b.pop("image_grid_thw"), "without 'image_grid_thw'"),
    (lambda b: b.pop("input_ids"), "no 'input_ids'"),
])
def test_ids_and_images_that_do_not_belong_together_are_refused(change, words):
    batch = _grid_batch()
    change(batch)
    with pytest.raises(ValueError, match=words):
        check_rows(batch, GRID, "test")


def test_images_of_several_placeholder_counts_without_a_grid():
    """One per sample: each goes with its sample, whatever its size (LLaVA-NeXT's image_sizes with it); several to a
    sample of several counts cannot be told apart: refused."""
    one_each = {"input_ids": _ids([6, 3, 9]), "pixel_values": torch.zeros(3, 5, 3, 2, 2),
                "image_sizes": torch.tensor([[4, 6], [2, 6], [6, 6]])}
    each = Offsets([0, 1, 2, 3], [0, 1, 2, 3])
    assert check_rows(one_each, FIXED, "test")[1] == {"pixel_values": each, "image_sizes": each}
    batch = {"input_ids": _ids([10, 0, 4]), "pixel_values": torch.zeros(3, 3, 2, 2)}  # 14 over 3 images
    with pytest.raises(ValueError, match="do not divide evenly"):
        check_rows(batch, FIXED, "test")
    # 12 over 3 images (6, then 2 and 4 placeholders): divides evenly, but 4 each are no whole images of sample 0
    batch = {"input_ids": _ids([6, 0, 2 + 4]), "pixel_values": torch.zeros(3, 3, 2, 2)}
    with pytest.raises(ValueError, match=r"taken as of one placeholder count each \(4\), which they are not.*collate "
                                         "at most one image per sample, or use dp=1 and pp=1"):
        check_rows(batch, FIXED, "test")


def test_one_image_of_any_size_per_sample_beside_samples_of_text_alone():
    """One image per sample that holds any, of several sizes (LLaVA-NeXT's), beside samples of text alone: each image
    goes with the sample whose placeholders it fills. Before, refused (taken as of one placeholder count, 10 each of
    16 and 4) with the advice to collate one image per sample, which this batch is."""
    batch = {"input_ids": _ids([16, 0, 4]), "pixel_values": torch.arange(2.0).reshape(2, 1, 1, 1).expand(2, 3, 2, 2),
             "image_sizes": torch.tensor([[8, 8], [4, 4]])}
    offsets = check_rows(batch, FIXED, "test")[1]
    assert offsets == {"pixel_values": Offsets([0, 1, 1, 2], [0, 1, 1, 2]), "image_sizes": Offsets([0, 1, 1, 2], [0, 1, 1, 2])}
    first, none, last = split_samples(batch, offsets, [(0, 1), (1, 2), (2, 3)])
    assert first["pixel_values"][:, 0, 0, 0].tolist() == [0.0] and none["pixel_values"] is None
    assert last["image_sizes"].tolist() == [[4, 4]]
    # the pipeline's micro-batches of the same batch: the second (samples 1 and 2) the second image alone
    micro = split_micro_batches((), {**batch, "input_ids": _ids([16, 0, 4, 0])}, 2, FIXED)
    assert micro[0][1]["pixel_values"][:, 0, 0, 0].tolist() == [0.0]
    assert micro[1][1]["pixel_values"][:, 0, 0, 0].tolist() == [1.0]


def test_images_told_apart_by_their_sizes_go_with_their_samples():
    """Pixtral's tower (Pixtral, Mistral 3): any number of images of any size per sample, padded to the batch's
    largest; each takes (h // patch) x (w // patch) placeholders of its `image_sizes` (patch x merge pixels per
    placeholder). Sample 0 holds two images (4 and 8 placeholders at 4 pixels each), sample 1 none, sample 2 one (8):
    before, "not whole items" (the batch's 20 placeholders over 3 images taken as equal). Images and sizes that do
    not add up, or pixels without their sizes, are refused."""
    sized = SampleRows((MediaRows(IMAGE, "pixel_values", per_item=("image_sizes",), sizes="image_sizes", patch=4),))
    pixels = torch.arange(3.0).reshape(3, 1, 1, 1).expand(3, 3, 16, 16)
    batch = {"input_ids": _ids([4 + 8, 0, 8]), "pixel_values": pixels,
             "image_sizes": torch.tensor([[8, 8], [8, 16], [16, 8]])}
    offsets = check_rows(batch, sized, "test")[1]
    assert offsets == {"pixel_values": Offsets([0, 2, 2, 3], [0, 2, 2, 3]), "image_sizes": Offsets([0, 2, 2, 3], [0, 2, 2, 3])}
    first, none, last = split_samples(batch, offsets, [(0, 1), (1, 2), (2, 3)])
    assert first["pixel_values"][:, 0, 0, 0].tolist() == [0.0, 1.0] and none["pixel_values"] is None
    assert last["image_sizes"].tolist() == [[16, 8]]
    with pytest.raises(ValueError, match="are not whole items"):
        check_rows({**batch, "image_sizes": torch.tensor([[8, 8], [8, 8], [16, 8]])}, sized, "test")
    with pytest.raises(ValueError, match="comes without 'image_sizes'"):
        check_rows({key: value for key, value in batch.items() if key != "image_sizes"}, sized, "test")


def test_images_padded_per_sample_go_with_their_samples_or_not_at_all():
    """Idefics3's layout ([samples, images, C, H, W] padded, and its pixel_attention_mask): a row per sample; a part
    whose samples hold no placeholder gets no images (its padding alone crashes Idefics3's vision path)."""
    padded = SampleRows((MediaRows(IMAGE, "pixel_values", per_item=("pixel_attention_mask",), padded=True),))
    batch = {"input_ids": _ids([4, 0, 4]), "pixel_values": torch.arange(3.0).reshape(3, 1, 1).expand(3, 2, 5),
             "pixel_attention_mask": torch.ones(3, 2, 5, dtype=torch.bool)}
    _, offsets = check_rows(batch, padded, "test")
    first, middle, both = split_samples(batch, offsets, [(0, 1), (1, 2), (1, 3)])
    assert first["pixel_values"][:, 0, 0].tolist() == [0.0] and first["pixel_attention_mask"].shape[0] == 1
    assert middle["pixel_values"] is None and middle["pixel_attention_mask"] is None
    assert both["pixel_values"][:, 0, 0].tolist() == [1.0, 2.0]  # rows are samples: its padding row goes with it


def test_a_tensor_of_other_rows_is_refused_where_no_layout_assigns_them():
    """Without a layout (a model tridist does not know), per-image rows would be split as if they were samples."""
    batch = _grid_batch()
    with pytest.raises(ValueError, match=r"'pixel_values' has 112 row\(s\) on dim 0 where the batch has 3 sample"):
        check_rows(batch, None, "shard_dataloader")
    one_each = {"input_ids": _ids([5, 5]), "pixel_values": torch.zeros(2, 3, 2, 2)}  # one image per sample: samples
    assert check_rows(one_each, None, "x") == (2, {})
    broadcast = {"input_ids": _ids([0, 0, 0]), "position_ids": torch.arange(24)[None]}  # one row: every part whole
    assert check_rows(broadcast, None, "x") == (3, {})


def test_pipeline_micro_batches_take_their_samples_images():
    batch = _grid_batch()
    batch["input_ids"] = torch.cat([batch["input_ids"], _ids([0])])  # 4 samples: 2 micro-batches of 2
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    first, second = split_micro_batches((), batch, 2, GRID)
    assert first[1]["pixel_values"].shape[0] == 48 and first[1]["image_grid_thw"].shape[0] == 2
    assert second[1]["pixel_values"][:, 0].unique().tolist() == [2.0] and second[1]["input_ids"].shape[0] == 2
    with pytest.raises(ValueError, match="'pixel_values' has 112 row"):  # no layout: refused, not given to both
        split_micro_batches((), batch, 2, None)


def _tiny(model_type: str):
    import transformers as hf

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                vocab_size=300)
    if model_type == "qwen2_5_vl":
        config = hf.Qwen2_5_VLConfig(text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
                                     vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                                                        out_hidden_size=32, spatial_merge_size=2),
                                     image_token_id=250, video_token_id=251)
        return hf.Qwen2_5_VLForConditionalGeneration(config)
    if model_type == "llava":
        config = hf.LlavaConfig(text_config={"model_type": "llama", **text},
                                vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                                   num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2),
                                image_token_id=250)
        return hf.LlavaForConditionalGeneration(config)
    if model_type == "mistral3":
        config = hf.Mistral3Config(text_config={"model_type": "mistral", **text, "head_dim": 16}, image_token_index=250,
                                   vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                                                      num_hidden_layers=1, num_attention_heads=2, image_size=16,
                                                      patch_size=2, head_dim=8), spatial_merge_size=2)
        return hf.Mistral3ForConditionalGeneration(config)
    if model_type == "lfm2_vl":
        config = hf.Lfm2VlConfig(text_config={"model_type": "lfm2", **text, "layer_types": ["conv", "full_attention"]},
                                 vision_config=dict(model_type="siglip2_vision_model", hidden_size=16,
                                                    intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                    patch_size=2, num_patches=16),
                                 image_token_id=250, projector_hidden_size=32, downsample_factor=2)
        return hf.Lfm2VlForConditionalGeneration(config)
    if model_type == "idefics3":
        config = hf.Idefics3Config(text_config={"model_type": "llama", **text}, scale_factor=2, image_token_id=250,
                                   vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=16, patch_size=4))
        return hf.Idefics3ForConditionalGeneration(config)
    return hf.LlamaForCausalLM(hf.LlamaConfig(**text))


def test_the_layouts_read_from_transformers_models():
    """Qwen2.5-VL: images and videos by their grids (spatial merge 2); LLaVA: images of one placeholder count;
    Mistral 3: images by their sizes (Pixtral's tower); LFM2-VL: images by their spatial shapes (before: taken for
    Idefics3's layout, their pixel_attention_mask); Idefics3: images padded per sample; a Llama: none. Their vision towers are the media encoders (data parallel keeps them in the root's unit)."""
    qwen = _tiny("qwen2_5_vl")
    assert sample_rows_of(qwen) == SampleRows((
        MediaRows(250, "pixel_values", grid="image_grid_thw", merge=2),
        MediaRows(251, "pixel_values_videos", grid="video_grid_thw", merge=2, per_item=("second_per_grid_ts",))))
    assert media_encoders(qwen) == ["model.visual"]
    llava = _tiny("llava")
    assert sample_rows_of(llava) == SampleRows((MediaRows(250, "pixel_values", per_item=("image_sizes",)),))
    assert media_encoders(llava) == ["model.vision_tower"]
    assert sample_rows_of(_tiny("mistral3")) == SampleRows((  # Pixtral's patches of 2 pixels, merged 2 x 2
        MediaRows(250, "pixel_values", per_item=("image_sizes",), sizes="image_sizes", patch=4),))
    assert sample_rows_of(_tiny("lfm2_vl")) == SampleRows((  # a row per image, its spatial shape in patches
        MediaRows(250, "pixel_values", per_item=("spatial_shapes", "pixel_attention_mask"), sizes="spatial_shapes",
                  patch=2),))
    assert sample_rows_of(_tiny("idefics3")) == SampleRows((
        MediaRows(250, "pixel_values", per_item=("pixel_attention_mask",), padded=True),))
    llama = _tiny("llama")
    assert sample_rows_of(llama) is None and media_encoders(llama) == []


def test_a_stand_in_runs_on_meta_with_its_integer_inputs_real():
    """A pipeline stand-in shapes its zeros by running its module's meta copy: a vision tower computes its patch
    counts from its grid's integers (`.tolist()`), which keep their values, while every float is a meta tensor."""

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(3, 5)

        def forward(self, pixels, grid):
            lengths = (grid[:, 1] * grid[:, 2]).tolist()  # data-dependent: needs the values
            return torch.cat([self.proj(part).mean(0, keepdim=True) for part in pixels.split(lengths)])

    tower = Tower().to("meta")
    pixels, grid = torch.randn(16 + 32, 3), torch.tensor([[1, 4, 4], [1, 4, 8]])
    meta_pixels, meta_grid = _to_meta_but_integers(pixels), _to_meta_but_integers(grid)
    assert meta_pixels.is_meta and not meta_grid.is_meta
    with torch.no_grad(), _MetaWhereMeta():
        out = tower(meta_pixels, meta_grid)
    assert out.is_meta and out.shape == (2, 5)


def test_the_cost_model_counts_the_media_encoders_on_the_first_stage():
    """`ModelSpec.media_parameters`: the vision tower (and LLaVA's projector) outside the language model, whole on every
    tp rank of the first pipeline stage (they were left out of the model states: 30% of the tiny Qwen2.5-VL)."""
    from tridist.autotune import ModelSpec
    from tridist.autotune.cost import stage_parameters

    for model_type, media in (("qwen2_5_vl", ["model.visual"]), ("llava", ["model.vision_tower",
                                                                        "model.multi_modal_projector"])):
        model = _tiny(model_type)
        spec = ModelSpec.from_module(model)
        expected = sum(p.numel() for name in media for p in model.get_submodule(name).parameters())
        assert spec.media_parameters == expected > 0, (model_type, spec.media_parameters, expected)
        # The rest is the text model's, biases aside (the cost model's note): within 1% of the real count
        real = sum(p.numel() for p in model.parameters())
        assert abs(spec.num_parameters - real) <= 0.01 * real, (spec.num_parameters, real)
        first, last = stage_parameters(spec, 2, 2, 0), stage_parameters(spec, 2, 2, 1)
        text_only = stage_parameters(dataclasses.replace(spec, media_parameters=0), 2, 2, 0)
        assert first == text_only + expected and last == stage_parameters(dataclasses.replace(spec, media_parameters=0),
                                                                          2, 2, 1)
    assert ModelSpec.from_module(_tiny("llama")).media_parameters == 0


def test_any_resolution_images_take_as_many_placeholders_as_the_model_gives_them_features():
    """LLaVA-NeXT's any-resolution images: the placeholders read from an image's size (anyres_placeholders: the base
    image's patch features, the best-fitting grid's tiles unpadded to the image's aspect, a newline per row) equal the
    model's own features of it at sizes on and off the tower's grid; the layout reads them by the images' sizes. A
    CLIP tower that keeps its CLS feature ("full"), or a pooling rule other than OneVision's, is not read so."""
    import importlib

    import transformers as hf

    from tridist.distcore.sample_rows import anyres_placeholders

    torch.manual_seed(0)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                vocab_size=300)
    config = hf.LlavaNextConfig(text_config={"model_type": "llama", **text}, image_token_index=250,
                                vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                                   num_hidden_layers=1, num_attention_heads=2, image_size=8,
                                                   patch_size=2),
                                image_grid_pinpoints=[[8, 16], [16, 8], [16, 16], [8, 24], [24, 8]])
    model = hf.LlavaNextForConditionalGeneration(config)
    count = anyres_placeholders(model)
    modeling = importlib.import_module(type(model).__module__)
    for size in [(8, 8), (16, 16), (16, 32), (32, 16), (13, 27), (30, 11), (8, 20), (100, 30)]:
        tiles = modeling.image_size_to_num_patches(list(size), config.image_grid_pinpoints, 8)
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values=torch.randn(1, tiles, 3, 8, 8),
                                                      image_sizes=torch.tensor([size])).pooler_output
        assert count(*size) == sum(f.shape[0] for f in features), size
    (read,) = sample_rows_of(model).media  # (its count a closure of its own: compared by its values)
    assert dataclasses.replace(read, count=None) == MediaRows(250, "pixel_values", per_item=("image_sizes",),
                                                              sizes="image_sizes")
    assert [read.count(*size) for size in [(8, 8), (13, 27)]] == [count(8, 8), count(13, 27)]
    model.config.vision_feature_select_strategy = "full"  # CLIP's CLS feature kept: the model's tiling refuses it
    assert anyres_placeholders(model) is None
    model.config.vision_feature_select_strategy, model.config.vision_aspect_ratio = "default", "pooled somehow"
    assert anyres_placeholders(model) is None and anyres_placeholders(_tiny("llava")) is None


@pytest.mark.parametrize("tower, strategy", [("siglip_vision_model", "full"), ("clip_vision_model", "default")])
def test_onevision_images_take_their_features_alone_or_several_to_a_sample(tower, strategy):
    """LLaVA-OneVision: an image alone in its sample is tiled (LLaVA-NeXT's count, then its unpadded grid pooled to
    `vision_aspect_ratio`'s "anyres_max_N" tiles where it is over 1.1x that: N = 1 here, so grids of 2 or more tiles
    pool), several images to a sample take their base features and a newline each (`batch_num_images`). The counts
    equal the model's own features at sizes on and off its grid, for SigLIP's tower (no CLS, "full": OneVision's
    default) and CLIP's ("default"). A batch's images then go with their samples by `batch_num_images`; counts that do
    not add up are refused. Before: one image per sample only ("not whole items")."""
    import importlib

    import transformers as hf

    from tridist.distcore.sample_rows import anyres_placeholders

    torch.manual_seed(0)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                vocab_size=300)
    config = hf.LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **text}, image_token_index=250, video_token_index=251,
        vision_config=dict(model_type=tower, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=2),
        image_grid_pinpoints=[[8, 16], [16, 8], [16, 16], [8, 24], [24, 8], [24, 24]], vision_aspect_ratio="anyres_max_1",
        vision_feature_select_strategy=strategy)
    model = hf.LlavaOnevisionForConditionalGeneration(config)
    count = anyres_placeholders(model)
    modeling = importlib.import_module(type(model).__module__)
    sizes = [(8, 8), (16, 16), (16, 32), (32, 16), (13, 27), (30, 11), (8, 20), (100, 30), (24, 24), (50, 50)]
    for size in sizes:
        for images in (1, 2):  # alone in its sample (tiled), or beside another (its base tile and a newline)
            tiles = modeling.image_size_to_num_patches(list(size), config.image_grid_pinpoints, 8) if images == 1 else 1
            with torch.no_grad():
                features = model.model.get_image_features(
                    pixel_values=torch.randn(images, tiles, 3, 8, 8), image_sizes=torch.tensor([size] * images),
                    batch_num_images=torch.tensor([images])).pooler_output
            assert [f.shape[0] for f in features] == [count(*size, images == 1)] * images, (size, images)
    assert count(16, 16) < 16 + 8 * 9 and count(8, 8, False) == 17  # (a 2 x 2 grid pooled; 4 x 4 base + a newline)
    (read,) = sample_rows_of(model).media
    assert dataclasses.replace(read, count=None) == MediaRows(250, "pixel_values", per_item=("image_sizes",),
                                                              sizes="image_sizes", per_sample="batch_num_images")
    # samples: two images (their bases), none, one alone (tiled): the rows are images, padded to the most tiles
    sizes = torch.tensor([[8, 8], [16, 32], [13, 27]])
    placeholders = [count(8, 8, False) + count(16, 32, False), 0, count(13, 27)]
    batch = {"input_ids": _ids(placeholders, length=64), "pixel_values": torch.arange(3.0).reshape(3, 1, 1, 1, 1).expand(3, 4, 3, 8, 8),
             "image_sizes": sizes, "batch_num_images": torch.tensor([2, 0, 1])}
    offsets = check_rows(batch, sample_rows_of(model), "test")[1]
    assert offsets["pixel_values"] == Offsets([0, 2, 2, 3], [0, 2, 2, 3]) == offsets["image_sizes"]
    first, none, last = split_samples(batch, offsets, [(0, 1), (1, 2), (2, 3)])
    assert first["pixel_values"][:, 0, 0, 0, 0].tolist() == [0.0, 1.0] and none["pixel_values"] is None
    assert last["image_sizes"].tolist() == [[13, 27]] and last["batch_num_images"].tolist() == [1]
    with pytest.raises(ValueError, match="are not its 3 item"):  # the last image counted with the first sample
        check_rows({**batch, "batch_num_images": torch.tensor([3, 0, 0])}, sample_rows_of(model), "test")
    with pytest.raises(ValueError, match="gives 3 sample"):
        check_rows({**batch, "batch_num_images": torch.tensor([2, 0, 2])}, sample_rows_of(model), "test")
    # without batch_num_images the model tiles every image, and so the counts read them
    alone = {**{k: v for k, v in batch.items() if k != "batch_num_images"},
             "input_ids": _ids([count(8, 8) + count(16, 32), 0, count(13, 27)], length=128)}
    assert check_rows(alone, sample_rows_of(model), "test")[1]["pixel_values"] == Offsets([0, 2, 2, 3], [0, 2, 2, 3])
    # OneVision's own rule, anyres_max_9, on grids up to 6 x 6 tiles: pooled only over 1.1x 9 tiles' features (the
    # sizes where a threshold of 1.0 would pool too, and grids pooled to sizes that floor differently)
    model.config.vision_aspect_ratio = "anyres_max_9"
    model.config.image_grid_pinpoints = [[8 * rows, 8 * columns] for rows in range(1, 7) for columns in range(1, 7)]
    count = anyres_placeholders(model)
    for size in [(17, 29), (40, 16), (48, 48), (30, 47), (45, 21), (8, 48)]:
        tiles = modeling.image_size_to_num_patches(list(size), model.config.image_grid_pinpoints, 8)
        with torch.no_grad():
            features = model.model.get_image_features(
                pixel_values=torch.randn(1, tiles, 3, 8, 8), image_sizes=torch.tensor([size]),
                batch_num_images=torch.tensor([1]), vision_aspect_ratio="anyres_max_9").pooler_output
        assert features[0].shape[0] == count(*size), size
