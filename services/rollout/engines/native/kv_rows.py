"""Row surgery on a Hugging Face DynamicCache of left-padded rows, for continuous batching (continuous.py).

Rows of one decode batch are left-padded to a common width W: row r's KV of column c is real where mask[r, c] is 1.
Joining rows of another width pads the narrower side on the left (masked zeros); dropping rows can leave leading
columns that no row uses any more, which `crop_left` removes. Only caches whose layers all hold plain keys and
values [batch, heads, length, head_dim] (full attention) are supported: `check_supported` says why not otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import DynamicCache


def check_supported(cache: DynamicCache) -> str | None:
    """None when every layer of `cache` (a DynamicCache after a forward) is plain full attention, else why not."""
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer" or getattr(layer, "is_sliding", False):
            return f"cache layer {type(layer).__name__} (continuous batching needs full-attention layers)"
    return None


class _KVLayer(Protocol):
    keys: torch.Tensor  # [batch, heads, length, head_dim]
    values: torch.Tensor


def _kv_layers(cache: DynamicCache) -> list[_KVLayer]:
    """The cache's layers as check_supported accepted them: plain keys and values (transformers types a layer as any
    of its kinds, some without them)."""
    return cast("list[_KVLayer]", cache.layers)


def _pad_left(t: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H, L, D] keys or values with `columns` zero columns before L."""
    return F.pad(t, (0, 0, columns, 0)) if columns else t


def join(cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor) -> torch.Tensor:
    """Appends `other`'s rows to `cache` in place (either side padded on the left to the wider); returns the joined
    mask [rows + other rows, width]."""
    width, other_width = mask.shape[1], other_mask.shape[1]
    total = max(width, other_width)
    for layer, extra in zip(_kv_layers(cache), _kv_layers(other), strict=True):
        layer.keys = torch.cat([_pad_left(layer.keys, total - width), _pad_left(extra.keys, total - other_width)])
        layer.values = torch.cat([_pad_left(layer.values, total - width), _pad_left(extra.values, total - other_width)])
    return torch.cat([F.pad(mask, (total - width, 0)), F.pad(other_mask, (total - other_width, 0))])


def crop_left(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drops the leading columns no row uses (mask 0 everywhere); returns the cropped mask."""
    used = mask.any(0)
    first = int(used.int().argmax()) if bool(used.any()) else mask.shape[1]
    if first == 0:
        return mask
    for layer in _kv_layers(cache):
        layer.keys = layer.keys[:, :, first:]
        layer.values = layer.values[:, :, first:]
    return mask[:, first:]
