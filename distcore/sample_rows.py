"""Batches whose tensors do not all hold one row per sample: a vision-language model's images and videos.

A vision-language model's collated batch holds per-sample tensors (input_ids, attention_mask, labels: dim 0 the
samples) beside per-image ones whose rows are images or their patches, in the samples' order: Qwen2-VL's
`pixel_values` [every image's patches, C*T*P*P] with `image_grid_thw` [images, 3] (each image t*h*w patches, any
number of images per sample, each of its own size), LLaVA's or Gemma 3's `pixel_values` [images, C, H, W]. Splitting
those on dim 0 as if their rows were samples (data parallel's slices, a pipeline's micro-batches) hands a rank other
samples' images: the model raises on its placeholder count, or trains on the wrong pictures.

Each image stands in input_ids as a run of placeholder tokens (`image_token_id`): t*h*w / merge**2 of them for a
grid (Qwen2-VL's processor), the same number for every image without one (LLaVA's, Gemma 3's, PaliGemma's). Counting
a sample's placeholders therefore tells how many of the images, in order, are its own, and their rows. `MediaRows`
describes one kind of media (images, videos) so; `SampleRows` all of a model's; `sample_rows_of(model)` reads them
from a transformers model's config and forward signature (None for a model of text alone, or of a layout this does
not know: its per-image tensors are then refused where they cannot be split by samples, never split wrongly).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..autotune.model import media_configs


# The layouts `sample_rows_of` reads, as the refusals of rows it cannot assign name them.
KNOWN_LAYOUTS = ("a Qwen2-VL-style grid, Pixtral's image sizes, LLaVA-NeXT's or LLaVA-OneVision's any-resolution image "
                 "sizes, LFM2-VL's spatial shapes, or images of one placeholder count")


class Offsets(NamedTuple):
    """A media key's first row of each sample and the end (`rows`), and the items before each sample and in all
    (`items`): samples + 1 offsets each."""

    rows: list[int]
    items: list[int]


@dataclass(frozen=True)
class MediaRows:
    """One kind of media of a batch. `pixels`: the key of its values, `grid`'s t*h*w rows per item where it has a grid
    (Qwen2-VL's patches), else one row per item; `token_id`: the placeholder each item expands to in the ids; `grid`:
    the key of its [items, 3] (t, h, w) grid, each item then `t*h*w // merge**2` placeholders (the spatial merge);
    `per_item`: other keys of one row per item (LLaVA-NeXT's `image_sizes`). `sizes`: the key of each item's (height,
    width) where its placeholders follow from them, (height // patch) x (width // patch) for `patch` of that unit per
    placeholder (Pixtral's `image_sizes` in pixels: its patch size times Mistral 3's spatial merge, the images padded
    to the batch's largest; LFM2-VL's `spatial_shapes` in patches: its downsample factor), or `count(height, width,
    tiled)` of them where it is given (any-resolution images: `anyres_placeholders`); `per_sample`: the key of each
    sample's item count where the batch gives it (LLaVA-OneVision's `batch_num_images`: a sample's items are then those,
    each tiled where it is its sample's only one; without it every item is tiled). Without a grid or sizes
    each item takes the same number of placeholders (the batch's count over its items), or, as many items as samples
    holding some, one item in each of those (images of any size, one to a sample, beside samples of text alone).
    `padded`: one row per sample, padded where it holds fewer images (Idefics3's [samples, images, C, H, W] and its
    `pixel_attention_mask`): a sample's items are its row."""

    token_id: int
    pixels: str
    grid: str | None = None
    merge: int = 1
    per_item: tuple[str, ...] = ()
    padded: bool = False
    sizes: str | None = None
    patch: int = 1
    count: Callable[[int, int, bool], int] | None = None
    per_sample: str | None = None

    def keys(self) -> tuple[str, ...]:
        return (self.pixels, *((self.grid,) if self.grid else ()), *self.per_item)

    def offsets(self, batch: Mapping, ids: torch.Tensor) -> dict[str, Offsets]:
        """Its keys' `Offsets` in `batch` ({} where the batch holds none of its values)."""
        if not torch.is_tensor(batch.get(self.pixels)):
            return {}
        placeholders = (ids == self.token_id).sum(dim=tuple(range(1, ids.dim()))).tolist()
        items = batch[self.pixels].shape[0]
        if self.padded:  # a row per sample; the samples without placeholders hold padding alone
            rows, counts = [1] * len(placeholders), [1] * len(placeholders)
            held = _cumulative([1 if n else 0 for n in placeholders])
        elif self.grid is not None:
            if not torch.is_tensor(batch.get(self.grid)):
                raise ValueError(f"{self.pixels!r} comes without {self.grid!r}, which tells its items' sizes")
            rows = [t * h * w for t, h, w in batch[self.grid].reshape(-1, 3).tolist()]
            counts = _items_per_sample(placeholders, [r // self.merge**2 for r in rows], self.token_id)
        elif self.sizes is not None:
            if not torch.is_tensor(batch.get(self.sizes)):
                raise ValueError(f"{self.pixels!r} comes without {self.sizes!r}, which tells its items' sizes")
            rows, sizes = [1] * items, batch[self.sizes].reshape(-1, 2).tolist()
            if self.per_sample is not None and torch.is_tensor(batch.get(self.per_sample)):
                counts = batch[self.per_sample].reshape(-1).tolist()
                tiled = [n == 1 for n in counts for _ in range(n)]
                tokens = [self.count(h, w, alone) for (h, w), alone in zip(sizes, tiled)]
                _check_items_per_sample(placeholders, tokens, counts, self.per_sample, self.token_id)
            else:
                tokens = [self.count(h, w) if self.count else (h // self.patch) * (w // self.patch) for h, w in sizes]
                counts = _items_per_sample(placeholders, tokens, self.token_id)
        elif items and items == sum(1 for n in placeholders if n):
            # one item in each sample that holds placeholders, of any size (the others of text alone)
            rows, counts = [1] * items, [1 if n else 0 for n in placeholders]
        else:
            total = sum(placeholders)
            if items == 0 or total % items:
                raise ValueError(f"the batch's {total} placeholder token(s) {self.token_id} do not divide evenly over the "
                                 f"{items} item(s) of {self.pixels!r}: without a grid, items of several sizes can be "
                                 "told apart only one per sample")
            rows = [1] * items
            try:
                counts = _items_per_sample(placeholders, [total // items] * items, self.token_id)
            except ValueError as error:  # the images are not of one count after all
                raise ValueError(f"{error}; without a grid or sizes the items of {self.pixels!r} were taken as of one "
                                 f"placeholder count each ({total // items}), which they are not: images of several "
                                 "sizes, several to a sample, are split by samples only where each image's count is "
                                 f"known ({KNOWN_LAYOUTS}); collate at most one image per sample, or use dp=1 and "
                                 "pp=1 for this model") from None
        if not self.padded:
            held = _cumulative(counts)
        found = {self.pixels: Offsets(_offsets(counts, rows), held)}
        for key in (self.grid, *self.per_item):
            if key is not None and torch.is_tensor(batch.get(key)):
                found[key] = Offsets(_offsets(counts, [1] * len(rows)), held)
        for key, offsets in found.items():
            if offsets.rows[-1] != batch[key].shape[0]:
                raise ValueError(f"{key!r} has {batch[key].shape[0]} row(s) where the batch's {len(rows)} item(s) "
                                 f"take {offsets.rows[-1]}")
        return found


def _cumulative(counts: list[int]) -> list[int]:
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


def _items_per_sample(placeholders: list[int], tokens: list[int], token_id: int) -> list[int]:
    """How many of the items, in order, each sample owns: those whose placeholders its own count adds up to."""
    counts, item = [], 0
    for sample, wanted in enumerate(placeholders):
        start = item
        while wanted > 0 and item < len(tokens):
            wanted -= tokens[item]
            item += 1
        if wanted != 0:
            raise ValueError(f"sample {sample}'s {placeholders[sample]} placeholder token(s) {token_id} are not whole "
                             f"items of the batch (items' placeholders {tokens[start:item + 1]} from item {start}): the "
                             "ids and the media tensors do not belong together")
        counts.append(item - start)
    if item != len(tokens):
        raise ValueError(f"{len(tokens) - item} item(s) of the batch have no placeholder token {token_id} in the ids")
    return counts


def _check_items_per_sample(placeholders: list[int], tokens: list[int], counts: list[int], key: str,
                            token_id: int) -> None:
    """Raises where the items `counts` gives each sample (the batch's `key`) are not its placeholders."""
    if len(counts) != len(placeholders) or sum(counts) != len(tokens):
        raise ValueError(f"{key!r} gives {len(counts)} sample(s) {sum(counts)} item(s) where the batch has "
                         f"{len(placeholders)} sample(s) and {len(tokens)} item(s)")
    offsets = _cumulative(counts)
    for sample, (wanted, start, end) in enumerate(zip(placeholders, offsets, offsets[1:])):
        if sum(tokens[start:end]) != wanted:
            raise ValueError(f"sample {sample}'s {wanted} placeholder token(s) {token_id} are not its {end - start} "
                             f"item(s) of {key!r} (their placeholders {tokens[start:end]}): the ids and the media "
                             "tensors do not belong together")


def _offsets(items_per_sample: list[int], rows_per_item: list[int]) -> list[int]:
    offsets, row, item = [0], 0, 0
    for count in items_per_sample:
        row += sum(rows_per_item[item:item + count])
        item += count
        offsets.append(row)
    return offsets


@dataclass(frozen=True)
class SampleRows:
    """A model's media (`MediaRows`), located through the batch's `ids` key."""

    media: tuple[MediaRows, ...]
    ids: str = "input_ids"

    def keys(self) -> set[str]:
        return {key for m in self.media for key in m.keys()}

    def offsets(self, batch: Mapping) -> dict[str, Offsets]:
        """Each media key's `Offsets` in `batch`; {} if the batch holds none. Raises, naming the mismatch, where the
        ids' placeholders and the media do not add up."""
        if not any(key in batch for key in self.keys()):
            return {}
        ids = batch.get(self.ids)
        if not torch.is_tensor(ids):
            raise ValueError(f"the batch holds {sorted(k for k in self.keys() if k in batch)} but no {self.ids!r}, "
                             "whose placeholder tokens tell which sample each item belongs to")
        found: dict[str, Offsets] = {}
        for media in self.media:
            found.update(media.offsets(batch, ids))
        return found


def sample_count(batch: Mapping, media_keys: set[str], *, named_only: bool = False) -> int | None:
    """The batch's samples: dim 0 of its input_ids (else labels, attention_mask, inputs_embeds, else, unless
    `named_only`, its first tensor that is not a media key). None if it holds no such tensor."""
    for key in ("input_ids", "labels", "attention_mask", "inputs_embeds"):
        if key not in media_keys and torch.is_tensor(batch.get(key)) and batch[key].dim() > 0:
            return batch[key].shape[0]
    if named_only:
        return None
    for key, value in batch.items():
        if key not in media_keys and torch.is_tensor(value) and value.dim() > 0:
            return value.shape[0]
    return None


def take_samples(value: torch.Tensor, key: str, offsets: dict[str, Offsets], first: int,
                 end: int) -> torch.Tensor | None:
    """Samples [first, end) of a batch tensor: rows first..end, or for a media key the rows of those samples' items,
    None where they hold none (as a call without images passes it: an empty tensor, or Idefics3's padding alone, would
    run the vision tower on nothing, which models' code does not take)."""
    if key not in offsets:
        return value[first:end]
    rows, items = offsets[key]
    return value[rows[first]:rows[end]] if items[end] > items[first] else None


def sample_rows_of(model: torch.nn.Module) -> SampleRows | None:
    """The media of a transformers vision-language model (`MediaRows` per kind), read from its config and its
    forward's arguments: a grid (`image_grid_thw`, `video_grid_thw`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V) with its
    vision config's `spatial_merge_size`, the images' sizes under a Pixtral tower (`image_sizes`: Pixtral, Mistral 3)
    or with a downsample factor (`spatial_shapes`: LFM2-VL), else `pixel_values` with one placeholder count per image
    (LLaVA, Gemma 3, PaliGemma, InternVL's tiles, ...). None for a model without an image placeholder token in its
    config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        arguments = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None) or 1
    media = []
    for kind, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        token = _token_id(config, kind)
        if token is None or pixels not in arguments:
            continue
        factor = getattr(config, "downsample_factor", None)
        if kind == "image" and "spatial_shapes" in arguments and isinstance(factor, int):
            # LFM2-VL's: a row per image (or tile) of its patches padded to the most, (h // factor) x (w // factor)
            # placeholders of its spatial shape in patches
            media.append(MediaRows(token, pixels, per_item=("spatial_shapes", "pixel_attention_mask"),
                                   sizes="spatial_shapes", patch=factor))
            continue
        if kind == "image" and "pixel_attention_mask" in arguments:  # Idefics2/3's, SmolVLM's: padded per sample
            media.append(MediaRows(token, pixels, per_item=("pixel_attention_mask",), padded=True))
            continue
        grid = f"{kind}_grid_thw" if f"{kind}_grid_thw" in arguments else None
        if grid is None and kind == "video":
            continue  # videos without a grid: a layout this does not know (refused where it cannot be split)
        if kind == "image" and getattr(vision, "model_type", None) == "pixtral" and "image_sizes" in arguments:
            # Pixtral's tower (Pixtral, Mistral 3): any number of images of any size per sample, told by their sizes
            patch = vision.patch_size * (getattr(config, "spatial_merge_size", None) or 1)
            media.append(MediaRows(token, pixels, per_item=("image_sizes",), sizes="image_sizes", patch=patch))
            continue
        if kind == "image" and "image_sizes" in arguments and (count := anyres_placeholders(model)) is not None:
            # LLaVA-NeXT's and LLaVA-OneVision's any-resolution images: any number per sample, each of its own size, its
            # placeholders told by that size through the model's own tiling (OneVision's: and its sample's images)
            media.append(MediaRows(token, pixels, per_item=("image_sizes",), sizes="image_sizes", count=count,
                                   per_sample="batch_num_images" if "batch_num_images" in arguments else None))
            continue
        # Other keys of one row per item: LLaVA-NeXT-like image sizes not read so, Qwen2.5-VL's seconds per video grid
        extra = {"image": ("image_sizes",) if grid is None else (), "video": ("second_per_grid_ts",)}[kind]
        media.append(MediaRows(token, pixels, grid=grid, merge=merge if grid else 1,
                               per_item=tuple(key for key in extra if key in arguments)))
    return SampleRows(tuple(media)) if media else None


def anyres_placeholders(model: torch.nn.Module) -> Callable[[int, int, bool], int] | None:
    """Placeholders of one any-resolution image of (height, width) pixels, `count(height, width, tiled)`, as the model's
    own `pack_image_features` lays its features out (None for a model of another layout): the base image's side x side
    patch features (side = the tower's image size over its patch: the CLS dropped by vision_feature_select_strategy
    "default", or a tower without one under "full"), then, where the image is `tiled`, its tiles' features as a grid
    of (rows x side) x (columns x side) by the model module's own `get_anyres_image_grid_shape`, unpadded to the
    image's aspect by its own `unpad_image`, with one newline feature per row; an image not tiled takes one newline.
    LLaVA-NeXT tiles every image. LLaVA-OneVision tiles the image of a sample that holds one alone (its
    `batch_num_images`; every image without them), and pools a tiled grid larger than `vision_aspect_ratio`'s
    "anyres_max_N" tiles allow (over 1.1x their features) to that many, as its `pack_image_features` does."""
    config = getattr(model, "config", None)
    module = sys.modules.get(type(model).__module__)
    grid_shape, unpad = getattr(module, "get_anyres_image_grid_shape", None), getattr(module, "unpad_image", None)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    vision = getattr(config, "vision_config", None)
    strategy, aspect = getattr(config, "vision_feature_select_strategy", None), getattr(config, "vision_aspect_ratio", None)
    pools = aspect is not None  # (where a tiled grid is larger than the rule allows)
    if pools and not (isinstance(aspect, str) and aspect.removeprefix("anyres_max_").isdigit()):
        return None  # a pooling rule this does not read
    class_token = any(hasattr(m, "class_embedding") for name in media_encoders(model)  # CLIP's: SigLIP's has none
                      for m in model.get_submodule(name).modules())
    if (grid_shape is None or unpad is None or not pinpoints
            or not (strategy == "default" or (strategy == "full" and not class_token))
            or not all(isinstance(getattr(vision, a, None), int) for a in ("image_size", "patch_size"))):
        return None
    side = vision.image_size // vision.patch_size
    most = int(aspect.removeprefix("anyres_max_")) if pools else None  # tiles' worth of features a pooled grid keeps

    def count(height: int, width: int, tiled: bool = True) -> int:
        if not tiled:
            return side * side + 1
        rows, columns = grid_shape([height, width], pinpoints, vision.image_size)
        kept_rows, kept_columns = unpad(torch.empty(0, rows * side, columns * side), [height, width]).shape[1:]
        if pools and (ratio := math.sqrt(kept_rows * kept_columns / (most * side**2))) > 1.1:
            kept_rows, kept_columns = int(kept_rows // ratio), int(kept_columns // ratio)  # (bilinear, to this size)
        return side * side + kept_rows * (kept_columns + 1)  # (get_image_features always passes its image_newline)

    return count


def media_encoders(model: torch.nn.Module) -> list[str]:
    """The outermost modules of a transformers multimodal model that encode its media: those built from one of its
    media sub-configs (`autotune.model.media_configs`: a vision tower's `vision_config`, an audio tower's). A batch slice
    without images never calls them, where the other slices do."""
    subs = media_configs(model)
    found: list[str] = []
    for name, module in model.named_modules():
        if name and any(getattr(module, "config", None) is sub for sub in subs):
            if not any(name.startswith(f"{outer}.") for outer in found):
                found.append(name)
    return found


def _token_id(config, kind: str) -> int | None:
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_rows(batch: Mapping, rows: SampleRows | None, where: str) -> tuple[int | None, dict[str, Offsets]]:
    """(samples, media row starts) of a dict batch; raises naming the tensor where one holds neither a row per
    sample, nor rows `rows` can assign to samples, nor one row that broadcasts over the samples (position ids of
    [1, seq]: every part takes it whole). `where` names the caller in the message."""
    starts = rows.offsets(batch) if rows is not None else {}
    samples = sample_count(batch, set(starts))
    if samples is None:
        return None, starts
    for key, value in batch.items():
        if key in starts or not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] in (samples, 1):
            continue
        raise ValueError(
            f"{where}: the batch's {key!r} has {value.shape[0]} row(s) on dim 0 where the batch has {samples} "
            f"sample(s), so it cannot be split by samples. A vision-language model's images are split by the "
            "placeholder tokens of each sample where tridist knows the model's layout (sample_rows_of: "
            f"{KNOWN_LAYOUTS}); give every sample the same number of images of one size, collate per-image tensors "
            "with one row per sample (padded), or keep tensors that are not per sample out of the batch")
    return samples, starts


def split_samples(batch: Mapping, offsets: dict[str, Offsets], bounds: Sequence[tuple[int, int]]) -> list[dict]:
    """The batch cut at sample bounds [(first, end), ...] (`take_samples`); scalars and other values whole in every
    part."""
    return [{key: take_samples(value, key, offsets, first, end) if torch.is_tensor(value) and value.dim() > 0 else value
             for key, value in batch.items()} for first, end in bounds]
