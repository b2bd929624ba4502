"""Vision-language models of transformers through to_distributed on gloo processes (FOUR_PROCESS_CHECKS on 4, the rest
on 2), trained on batches of images as
users collate them: any number of images per sample, each of its own size, some samples with none (Qwen2.5-VL's
patches of every image in one `pixel_values` with an `image_grid_thw`; LLaVA's [images, C, H, W]). Losses,
first-step gradients and parameters after the steps equal one process's (equivalence.py).

Before (2026-11-30): data parallel split `pixel_values` by its own rows as if they were samples (a crash in the
model's code, or other samples' images), a rank whose samples held no image never ran the vision tower's FSDP units
(gloo aborted), pipeline micro-batches all got every image, and a later stage could not shape its stand-in for the
vision tower (its patch counts come from the grid's values)."""

from __future__ import annotations

import copy
import functools
import inspect

import torch
import torch.distributed as dist
import transformers as hf

from tridist import autotune, distcore
from tests.distributed import equivalence
from tests.distributed.harness import on_rank_0, run_checks

IMAGE, VOCAB, SEQ_LEN, LR = 250, 256, 40, 0.1
PIXTRAL_PATCH = 2  # Pixtral's patches of this many pixels (its images: _samples)
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Each global batch's 4 samples hold these images (grids t, h, w in patches): the second batch's last two samples
# none, so under dp 2 one rank's slice holds no image (it never calls the vision tower) and under pp 2 one
# micro-batch neither. Models with a video grid also get videos (by sample index; of 2 frames or 1), mixed with the
# images in some samples.
IMAGES = ([[(1, 4, 4), (1, 4, 8)], [], [(1, 8, 4)], [(1, 4, 4)]],
          [[(1, 4, 4)], [(1, 8, 8)], [], []])
VIDEOS = {1: [(2, 4, 4)], 3: [(2, 4, 4), (1, 4, 8)], 6: [(2, 4, 4)]}
# Images only in a batch's later samples: in 2 micro-batches, the vision tower's first use is the last micro-batch's
# (the first batch's; under dp 2 x 2 micro-batches, the second's on both replicas, the first's on one only)
LATE_IMAGES = ([[], [], [(1, 4, 4)], [(1, 8, 4)]],
               [[], [(1, 4, 4)], [], [(1, 4, 8)]])


def _qwen2_5_vl():
    torch.manual_seed(0)
    config = hf.Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, fullatt_block_indexes=[1],
                           window_size=8),
        image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2, vision_end_token_id=IMAGE + 3)
    return hf.Qwen2_5_VLForConditionalGeneration(config)


def _llava():
    torch.manual_seed(0)
    config = hf.LlavaConfig(text_config={"model_type": "llama", **TEXT}, image_token_id=IMAGE,
                            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2))
    return hf.LlavaForConditionalGeneration(config)


def _qwen2_vl():
    torch.manual_seed(0)
    config = hf.Qwen2VLConfig(
        text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2, vision_end_token_id=IMAGE + 3)
    return hf.Qwen2VLForConditionalGeneration(config)


def _qwen3_vl(layers: int = TEXT["num_hidden_layers"]):
    """Its vision tower's deepstack features added to the first two text layers' hidden states (Qwen3-VL's)."""
    torch.manual_seed(0)
    config = hf.Qwen3VLConfig(
        text_config={**TEXT, "num_hidden_layers": layers, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2, vision_end_token_id=IMAGE + 3)
    return hf.Qwen3VLForConditionalGeneration(config)


def _gemma3():
    torch.manual_seed(0)
    config = hf.Gemma3Config(text_config={**TEXT, "head_dim": 16, "sliding_window": 8}, mm_tokens_per_image=4,
                             vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=2, image_size=16, patch_size=4),
                             image_token_id=IMAGE, boi_token_index=IMAGE + 1, eoi_token_index=IMAGE + 2)
    return hf.Gemma3ForConditionalGeneration(config)


def _mistral3():
    """Mistral Small 3.1's layout: Pixtral's tower takes images of any size (padded to the batch's largest, each
    cropped to its `image_sizes`), the projector merges 2 x 2 patches: (h / 4) x (w / 4) placeholders per image."""
    torch.manual_seed(0)
    config = hf.Mistral3Config(text_config={"model_type": "mistral", **TEXT, "head_dim": 16}, image_token_index=IMAGE,
                               vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2, image_size=32,
                                                  patch_size=PIXTRAL_PATCH, head_dim=16),
                               spatial_merge_size=2)
    return hf.Mistral3ForConditionalGeneration(config)


def _pixtral():
    """Pixtral 12B's layout: LLaVA with Pixtral's tower, no merge: a placeholder per patch of each image."""
    torch.manual_seed(0)
    config = hf.LlavaConfig(text_config={"model_type": "mistral", **TEXT, "head_dim": 16}, image_token_index=IMAGE,
                            vision_feature_select_strategy="full", vision_feature_layer=-1,  # Pixtral 12B's
                            vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, image_size=32,
                                               patch_size=PIXTRAL_PATCH, head_dim=16))
    return hf.LlavaForConditionalGeneration(config)


def _lfm2_vl():
    """LFM2-VL's layout: SigLIP 2's patches of each image in a row padded to the most (`pixel_attention_mask`), its
    `spatial_shapes` in patches, (h / 2) x (w / 2) placeholders at the downsample factor 2; LFM2's short convolutions
    in the text model."""
    torch.manual_seed(0)
    config = hf.Lfm2VlConfig(text_config={"model_type": "lfm2", **TEXT, "layer_types": ["conv", "full_attention"]},
                             vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2, patch_size=2,
                                                num_patches=64),
                             image_token_id=IMAGE, projector_hidden_size=64, downsample_factor=2)
    return hf.Lfm2VlForConditionalGeneration(config)


def _internvl():
    """InternVL 3's layout: each image cut into tiles of 8 x 8 pixels (the processor's dynamic tiling), every tile
    (8 / 2)**2 patches pixel-shuffled by 0.5: 4 placeholders per tile, the tiles of all images in one `pixel_values`."""
    torch.manual_seed(0)
    config = hf.InternVLConfig(text_config={"model_type": "qwen2", **TEXT, "head_dim": 16}, image_token_id=IMAGE,
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=2, image_size=[8, 8], patch_size=[2, 2]),
                               downsample_ratio=0.5)
    return hf.InternVLForConditionalGeneration(config)


def _llava_next():
    """LLaVA-NeXT's any-resolution images (LLaVA-1.6): each image its base tile and the tiles of the grid its size fits
    best (the pinpoints), its placeholders the base's 2 x 2 patch features and the tiles' unpadded to its aspect with a
    newline per row: counts that differ by size, several images to a sample."""
    torch.manual_seed(0)
    config = hf.LlavaNextConfig(text_config={"model_type": "llama", **TEXT}, image_token_index=IMAGE,
                                vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=2, image_size=4,
                                                   patch_size=2),
                                image_grid_pinpoints=[[4, 8], [8, 4], [8, 8]])
    return hf.LlavaNextForConditionalGeneration(config)


def _llava_onevision():
    """LLaVA-OneVision's any-resolution images: an image alone in its sample tiled as LLaVA-NeXT's, its tiles' features
    pooled where they are over `vision_aspect_ratio`'s "anyres_max_N" tiles (N = 1 here: grids of 2 tiles pool);
    several images to a sample each its base tile and a newline (`batch_num_images`). SigLIP's tower (no CLS feature,
    "full"), a Qwen2 text model, as OneVision's checkpoints."""
    torch.manual_seed(0)
    config = hf.LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **TEXT}, image_token_index=IMAGE, video_token_index=IMAGE + 1,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=4, patch_size=2),
        image_grid_pinpoints=[[4, 8], [8, 4], [8, 8]], vision_aspect_ratio="anyres_max_1")
    return hf.LlavaOnevisionForConditionalGeneration(config)


def _glm4v():
    """GLM-4.1V's layout: Qwen2-VL's grid of patches merged 2 x 2, its text model's partial rotary over 3-D positions
    (the rotary half of each 16-wide head in sections of 2, 1 and 1 pairs)."""
    torch.manual_seed(0)
    config = hf.Glm4vConfig(
        text_config={**TEXT, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}},
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, image_size=8),
        image_token_id=IMAGE, video_token_id=IMAGE + 1, image_start_token_id=IMAGE + 2, image_end_token_id=IMAGE + 3,
        video_start_token_id=IMAGE + 4, video_end_token_id=IMAGE + 5)
    return hf.Glm4vForConditionalGeneration(config)


# What scripts/sweep_vision.py runs under every strategy; the checks below take three of them.
MODELS = {"qwen2_5_vl": _qwen2_5_vl, "qwen2_vl": _qwen2_vl, "qwen3_vl": _qwen3_vl, "llava": _llava, "gemma3": _gemma3,
          "mistral3": _mistral3, "pixtral": _pixtral, "lfm2_vl": _lfm2_vl, "internvl": _internvl, "glm4v": _glm4v,
          "llava_next": _llava_next, "llava_onevision": _llava_onevision}


def _samples(model, images_of_batches=IMAGES) -> list[dict]:
    """The samples as a dataset holds them: token ids with each image's placeholders (a Qwen2.5-VL image of t*h*w
    patches takes t*h*w/4 of them at its 2 x 2 merge; a LLaVA image one per patch, 16; a Gemma 3 image its
    mm_tokens_per_image), labels -100 on them, and the images and videos (Gemma 3's token_type_ids and Qwen's
    mm_token_type_ids mark them, as their processors do)."""
    vision = model.config.vision_config
    grid = hasattr(vision, "spatial_merge_size")
    # Pixtral's: a grid's h x w as an image of h * merge / 2 x w * merge / 2 patches, h * w / 4 placeholders as a grid's
    sized = vision.model_type == "pixtral"
    merge = getattr(model.config, "spatial_merge_size", 1)
    patches = vision.model_type == "siglip2_vision_model"  # LFM2-VL's: h x w patches in a row, h * w / 4 placeholders
    tiles = model.config.model_type == "internvl"  # InternVL's: h x w as h * w / 16 tiles of 4 placeholders each
    # LLaVA-NeXT's: an image of h + 1 x w pixels in the model's tiles of its any-resolution grid (padded to the batch's
    # most), its placeholders as many as the model's own features of it
    anyres = model.config.model_type in ("llava_next", "llava_onevision")
    onevision = model.config.model_type == "llava_onevision"  # an image tiled only where it is its sample's one
    tokens_per_image = None if grid or sized or patches or tiles or anyres else getattr(
        model.config, "mm_tokens_per_image", (vision.image_size // vision.patch_size) ** 2)
    arguments = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(0)
    samples = []
    for batch in images_of_batches:
        for images in batch:
            ids = torch.randint(3, 200, (SEQ_LEN,), generator=generator)
            sample, position = {"input_ids": ids}, 2
            pixels, grids = [], []
            if anyres and images:  # each image's tiles (OneVision's: its base alone beside others), the model's features
                pixels = [_anyres_tiles(model, (h + 1, w), generator, tiled=not onevision or len(images) == 1)
                          for _, h, w in images]
                with torch.no_grad():
                    anyres_tokens = [f.shape[0] for f in model.model.get_image_features(
                        pixel_values=_padded_rows(pixels), image_sizes=torch.tensor([(h + 1, w) for _, h, w in images]),
                        **({"batch_num_images": torch.tensor([len(images)])} if onevision else {})).pooler_output]
            for t, h, w in images:
                tokens = t * h * w // 4 if grid or sized or patches or tiles else tokens_per_image
                if anyres:
                    tokens = anyres_tokens.pop(0)
                ids[position:position + tokens] = IMAGE
                position += tokens + 1
                if anyres:
                    pass
                elif tiles:
                    pixels.append(torch.randn(h * w // 16, 3, *vision.image_size, generator=generator))
                elif patches:
                    pixels.append(torch.randn(h * w, 3 * vision.patch_size**2, generator=generator))
                elif sized:
                    pixels.append(torch.randn(3, h * merge // 2 * PIXTRAL_PATCH, w * merge // 2 * PIXTRAL_PATCH,
                                              generator=generator))
                else:
                    pixels.append(torch.randn(t * h * w, 24, generator=generator) if grid else
                                  torch.randn(1, 3, vision.image_size, vision.image_size, generator=generator))
                grids.append((t, h, w))
            if images and patches:  # a row per image of its patches, padded to the most
                sample["pixel_values"] = _padded_rows(pixels)
                sample["pixel_attention_mask"] = _padded_rows([torch.ones(len(p), dtype=torch.long) for p in pixels])
                sample["spatial_shapes"] = torch.tensor([(h, w) for _, h, w in images])
            elif images and anyres:  # each image's tiles, padded to the most
                sample["pixel_values"] = _padded_rows(pixels)
                sample["image_sizes"] = torch.tensor([(h + 1, w) for _, h, w in images])
            elif images and sized:  # padded to the largest, as Pixtral's processor pads a batch
                sample["pixel_values"] = _padded(pixels)
                sample["image_sizes"] = torch.tensor([image.shape[1:] for image in pixels])
            elif images:
                sample["pixel_values"] = torch.cat(pixels)
                if grid:
                    sample["image_grid_thw"] = torch.tensor(grids)
            if onevision:  # its processor's images per sample (none too), which tell the model whether to tile them
                sample["batch_num_images"] = torch.tensor(len(images))
            # (GLM-4.1V's processor writes a video's frames as image tokens between video start and end tokens, which
            # these samples do not: images alone there; LLaVA-OneVision's videos have no grid: images alone)
            videos = (VIDEOS.get(len(samples), []) if "pixel_values_videos" in arguments
                      and model.config.model_type not in ("glm4v", "llava_onevision") else [])
            for t, h, w in videos:  # Qwen3-VL's processor gives each frame its own placeholders (and a timestamp)
                frames = t if model.config.model_type.startswith("qwen3") else 1
                for _ in range(frames):
                    ids[position:position + t * h * w // 4 // frames] = IMAGE + 1
                    position += t * h * w // 4 // frames + 1
            if videos:
                sample["pixel_values_videos"] = torch.cat([torch.randn(t * h * w, 24, generator=generator)
                                                           for t, h, w in videos])
                sample["video_grid_thw"] = torch.tensor(videos)
            if "mm_token_type_ids" in arguments:  # Qwen2-VL's and Qwen3-VL's: 1 on image, 2 on video placeholders
                sample["mm_token_type_ids"] = (ids == IMAGE).long() + 2 * (ids == IMAGE + 1).long()
            if model.config.model_type == "gemma3":
                sample["token_type_ids"] = (ids == IMAGE).long()
            sample["labels"] = ids.masked_fill((ids == IMAGE) | (ids == IMAGE + 1), -100)
            samples.append(sample)
    return samples


def _anyres_tiles(model, size: tuple[int, int], generator: torch.Generator, tiled: bool = True) -> torch.Tensor:
    """[tiles, C, S, S]: as many random tiles as LLaVA-NeXT's model takes for an image of `size` (height, width) pixels
    (its image_size_to_num_patches: the base image and its any-resolution grid's tiles of the tower's S x S), or the
    base image alone where it is not `tiled` (LLaVA-OneVision's images several to a sample)."""
    import importlib

    modeling = importlib.import_module(type(model).__module__)
    side = model.config.vision_config.image_size
    tiles = modeling.image_size_to_num_patches(list(size), model.config.image_grid_pinpoints, side) if tiled else 1
    return torch.randn(tiles, 3, side, side, generator=generator)


def _padded(images: list[torch.Tensor]) -> torch.Tensor:
    """[images, C, H, W] of images of several sizes, each at the top left, zeros around (Pixtral's processor's)."""
    height, width = max(image.shape[-2] for image in images), max(image.shape[-1] for image in images)
    out = torch.zeros(len(images), images[0].shape[-3], height, width)
    for i, image in enumerate(images):
        out[i, :, :image.shape[-2], :image.shape[-1]] = image
    return out


def _padded_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[rows, most, ...] of rows of several lengths, zeros after each (LFM2-VL's processor's patches and mask)."""
    out = rows[0].new_zeros(len(rows), max(len(row) for row in rows), *rows[0].shape[1:])
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _collate(samples: list[dict]) -> dict:
    """A user's collate_fn: ids and labels stacked, every sample's images in one tensor in sample order (Pixtral's
    padded to the batch's largest)."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "labels", "token_type_ids",
                                                                    "mm_token_type_ids", "batch_num_images")
             if key in samples[0]}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "image_sizes",
                "spatial_shapes", "pixel_attention_mask"):
        if any(key in s for s in samples):
            values = [s[key] for s in samples if key in s]
            if key == "pixel_values" and values[0].dim() == 5:  # LLaVA-NeXT's tiles of each image, padded to the most
                batch[key] = _padded_rows([image for value in values for image in value])
            elif key == "pixel_values" and any("image_sizes" in s for s in samples):  # Pixtral's: of several sizes
                batch[key] = _padded([image for value in values for image in value])
            elif key in ("pixel_values", "pixel_attention_mask") and any("spatial_shapes" in s for s in samples):
                batch[key] = _padded_rows([row for value in values for row in value])  # LFM2-VL's patch rows
            else:
                batch[key] = torch.cat(values)
    return batch


def _loader(model, images=IMAGES):
    return torch.utils.data.DataLoader(_samples(model, images), batch_size=4, collate_fn=_collate)


def train(build, strategy: autotune.Strategy | None, *, mixed_precision: str | None = None,
          images=IMAGES) -> autotune.Strategy:
    """`build()`'s model trained by to_distributed under `strategy` (None: searched) on the batches above (`images`:
    each sample's), asserted equal to one process (fp32; to bf16 rounding under `mixed_precision="bfloat16"`); returns
    the strategy applied."""
    def one_process() -> equivalence.Trace:
        single = copy.deepcopy(model)
        return equivalence.train_keywords(single, [torch.optim.SGD(single.parameters(), lr=LR)], _loader(single, images))

    model = build()
    model.config.use_cache = False
    reference = on_rank_0(one_process)
    model, optimizer, loader = distcore.to_distributed(
        model, torch.optim.SGD(model.parameters(), lr=LR), _loader(model, images), device_num=dist.get_world_size(),
        config=distcore.ToDistributedConfig(strategy=strategy, mixed_precision=mixed_precision))
    assert strategy is None or model.distributed_strategy == strategy
    assert not any(hasattr(m, "_tridist_global_view") for m in model.modules())  # the text blocks checked, local view
    # LLaVA's last vision layer feeds nothing (its features come from the one before): FSDP2's zero gradient until
    # the step, as for any parameter no rank used (equivalence.py)
    rounding = {} if mixed_precision is None else dict(rtol=equivalence.BF16_RTOL, loss_rtol=equivalence.BF16_LOSS_RTOL)
    equivalence.assert_same_training(equivalence.train_keywords(model, [optimizer], loader()), reference,
                                     unused_zero=True, **rounding)
    return model.distributed_strategy


def check_images_of_any_size_under_data_and_pipeline_parallel():
    """Qwen2.5-VL with images and videos under dp 2 x pp 2 at ZeRO-3, 2 micro-batches of one sample (4 processes).
    The second batch's last replica gets a video in its first micro-batch and nothing in its second: the vision tower
    stays in the root's FSDP unit (its gradients zeros where unused); its micro-batches' media differ in shape from the
    other replica's, which must not make one replica alone re-infer the stages' shapes (a backward whose reductions
    ran out of step: gloo aborted); the second stage shapes its stand-in's zeros from the grid's values."""
    train(_qwen2_5_vl, autotune.Strategy(2, 1, 2, sharding_level=3, micro_batch_size=1, num_micro_batches=2))
    # Qwen3-VL under tp 2 + sp x pp 2, its deepstack layers on the first stage: the later stage's stand-ins of them
    # return zeros of the whole sequence's shape, to which its deepstack rows are added whole (SequenceSlicedRows)
    train(functools.partial(_qwen3_vl, layers=4), autotune.Strategy(1, 2, 2, sequence_parallel=True, micro_batch_size=2,
                                                                     num_micro_batches=2, layers_per_stage=(3, 1)))
    # LFM2-VL under tp 2 x pp 2: the second stage's stand-in for its vision tower shapes its zeros on the meta device
    # from the patch mask, which the tower sends to its embeddings' device there and asks `.all()` of (kept real: before,
    # refused, "Tensor.item() cannot be called on meta tensors")
    train(_lfm2_vl, autotune.Strategy(1, 2, 2, micro_batch_size=2, num_micro_batches=2))


def check_images_under_tensor_parallel():
    """LLaVA under tp 2 with sequence parallel: the vision tower whole on each rank, the text blocks checked in local
    view (the block check's probe of token ids never reaches the vision blocks, which it no longer waits for)."""
    train(_llava, autotune.Strategy(1, 2, 1, sequence_parallel=True, micro_batch_size=4))


def check_deepstack_features_under_sequence_parallel():
    """Qwen3-VL adds its vision tower's deepstack features to its first text layers' outputs at the image and video
    tokens' positions over the whole sequence (visual_pos_masks, deepstack_visual_embeds), which sequence parallel
    splits: each tp rank takes its slice of the mask and those rows (SequenceSlicedRows), their gradients summed over
    the ranks so that the vision tower, whole on each, gets the whole gradient (without the sum its deepstack mergers'
    gradients are a third off). Under tp 2 + sp, images and videos mixed: equal to one process (before: refused by
    name, an IndexError in transformers before that)."""
    train(_qwen3_vl, autotune.Strategy(1, 2, 1, sequence_parallel=True, micro_batch_size=4))


def check_any_resolution_images_several_to_a_sample():
    """LLaVA-NeXT (LLaVA-1.6) under dp 2: its any-resolution images, two in the first sample, each of its own tile count
    (padded to the batch's most) and placeholder count (10, 14, 16, 24 here), go with their samples: each image's
    placeholders read from its size through the model's own tiling (sample_rows.anyres_placeholders). Before: split
    only with one image to a sample ("not whole items" otherwise).
    And under pp 2: the image features' newline token (`image_newline`, a bare parameter of the model) lives on the
    first stage with the vision tower, the second stage's model code before its layers reading zeros in its place
    (before: placed on the last stage, as an LM-head weight is; refused at the first step)."""
    train(_llava_next, autotune.Strategy(2, 1, 1, micro_batch_size=2))
    train(_llava_next, autotune.Strategy(1, 1, 2, micro_batch_size=2, num_micro_batches=2))
    # LLaVA-OneVision: the first sample's two images untiled (base and newline each: 5 placeholders), the others'
    # tiled and their 2-tile grids pooled; `batch_num_images` split with the samples (before: "not whole items")
    train(_llava_onevision, autotune.Strategy(2, 1, 1, micro_batch_size=2))
    train(_llava_onevision, autotune.Strategy(1, 1, 2, micro_batch_size=2, num_micro_batches=2))


def check_bf16_mixed_precision_under_pipeline_stages_and_gradient_accumulation():
    """LLaVA under pp 2 with mixed_precision="bfloat16" (FSDP2 computing in bf16, reducing in fp32), 2 micro-batches:
    FSDP2 accumulates the micro-batches' gradients in fp32 and reduces once per step, where the last vision layer (it
    feeds nothing) brings bf16 zeros, and, with images only in the last micro-batch (LATE_IMAGES), the vision tower
    fresh bf16 gradients; both go to fp32 as the others did (pipeline._uniform_gradient_dtypes). Before: FSDP2's
    "expects uniform gradient dtype" on the first stage, the second waiting (pytorch/pytorch#196996). So under dp 2
    with gradient accumulation over 2 micro-batches (a one-stage pipeline), which failed alike (one replica's first
    batch holds no image: zeros for the whole tower). Training equals one fp32 process to bf16 rounding."""
    pp2 = autotune.Strategy(1, 1, 2, micro_batch_size=2, num_micro_batches=2)
    train(_llava, pp2, mixed_precision="bfloat16")
    train(_llava, pp2, mixed_precision="bfloat16", images=LATE_IMAGES)
    train(_llava, autotune.Strategy(2, 1, 1, micro_batch_size=1, num_micro_batches=2), mixed_precision="bfloat16",
          images=LATE_IMAGES)


def check_images_of_several_sizes_told_apart_by_their_sizes():
    """Mistral 3 (Pixtral's tower: no grid; images of several sizes, several to a sample, padded to the batch's
    largest) under dp 2: each rank gets its samples' images by their `image_sizes` (before: refused, "not whole
    items", the batch's placeholders spread over its images as if they were of one size)."""
    train(_mistral3, autotune.Strategy(2, 1, 1, micro_batch_size=2))


def check_what_cannot_be_split_is_refused():
    """A batch tensor whose rows are neither samples nor images of a known layout: refused by the loader, naming it;
    Qwen3-VL's deepstack layers split over pipeline stages: refused up front."""
    model = _llava()
    model, _, loader = distcore.to_distributed(
        model, None, [{"input_ids": torch.zeros(4, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3, 8])}],
        device_num=dist.get_world_size(), config=distcore.ToDistributedConfig(
            strategy=autotune.Strategy(2, 1, 1, micro_batch_size=2)))
    try:
        next(iter(loader))
    except ValueError as error:
        assert "'cu_seqlens' has 3 row(s) on dim 0 where the batch has 4 sample(s)" in str(error), error
    else:
        raise AssertionError("a tensor of 3 rows in a batch of 4 samples was split")
    # Qwen3-VL's two text layers both take deepstack features: no pipeline stage may end with either (before: refused
    # at the first step, "does not receive the previous layer's output unchanged")
    try:
        distcore.to_distributed(_qwen3_vl(), None, _loader(_qwen3_vl()), device_num=dist.get_world_size(),
                                config=distcore.ToDistributedConfig(strategy=autotune.Strategy(
                                    1, 1, 2, micro_batch_size=2, num_micro_batches=2)))
    except autotune.InvalidStrategy as error:
        assert "adds to the outputs of its first 2 layers" in str(error), error
    else:
        raise AssertionError("Qwen3-VL's deepstack layers split over pipeline stages were not refused")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}
FOUR_PROCESS_CHECKS = ["check_images_of_any_size_under_data_and_pipeline_parallel"]

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)
