"""Images in rows: the contract, decoding and checking, the image processor, and where image tokens sit in a row.

Row contract (both forms): `images` is a list of encoded images (PNG, JPEG or WebP bytes in the msgpack map).
- Text form: each image is referenced, in order, by the placeholder `<|image|>` (`PLACEHOLDER`) in `state` or in a
  question's `text`; the first placeholder is images[0], and so on. The count must match exactly. The worker puts
  the checkpoint's own image marker there (`<|vision_start|><|image_pad|><|vision_end|>`, what Qwen's chat template
  renders for an image) and expands the pad to the image's token count, as transformers' Qwen3-VL processor does.
- Token form: `ids` already holds, for image i, a run of exactly `n_tokens(i)` image-pad ids (the processor's
  expansion); the runs, in order, are the images, and each run must stand alone (not touch the next).
An image bigger than `MAX_IMAGE_BYTES` bytes or `MAX_IMAGE_PIXELS` pixels, one that does not decode, a
placeholder count or pad run that does not match the images: each a RowError with its own code.

`ImageSupport` (one per model) holds the checkpoint's image processor (transformers' AutoImageProcessor for the
folder, its PIL/numpy path: deterministic on the host, no torchvision) and the image token ids; it remembers each
image's grid by the sha256 of its bytes, so a screenshot seen before is not decoded again to be checked.
`positions` gives a row's multimodal rotary positions (transformers' get_rope_index for one sequence); `key_ids`
gives the token list a state is known by in the checkpoint index (each image-pad token replaced by a negative key
derived from its image's hash, so a different screenshot never matches and the same one always does).
Knows nothing of the vision tower, the text model's weights, the cache or the queue.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from statecache.rows.contract import RowError

PLACEHOLDER = "<|image|>"
MAX_IMAGES = 16  # per row
MAX_IMAGE_BYTES = 32 * 2**20
MAX_IMAGE_PIXELS = 8192 * 8192  # before resizing (the processor resizes to its own pixel budget)
FORMATS = ("PNG", "JPEG", "MPO", "WEBP")  # MPO: PIL's name for some cameras' JPEG files


@dataclass(frozen=True)
class ImageRef:
    """One image of one row: its bytes, their sha256, its patch grid (t, h, w) and token count; `start` is the
    index of its first image-pad token in the row (-1 until located)."""

    digest: bytes
    data: bytes
    grid: tuple[int, int, int]
    n: int
    start: int = -1

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def key(self) -> int:
        """The negative int64 the checkpoint index sees at this image's pad tokens (never a real token id)."""
        return -(int.from_bytes(self.digest[:8], "big") >> 1) - 1


class ImageSupport:
    """The image side of one checkpoint: processor, token ids, merge size. `for_model` returns None for a checkpoint
    without a vision tower or image processor."""

    def __init__(self, image_processor, image_token_id: int, merge: int,
                 tokens: tuple[str, ...] = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"), info_entries: int = 4096):
        """tokens: the texts of the vision-start, image-pad and vision-end tokens (the pad one required)."""
        self.processor = image_processor
        self.image_token_id = int(image_token_id)
        self.image_token = tokens[1]
        self.merge = int(merge)
        self.marker = "".join(tokens)  # what Qwen's chat template renders for an image
        self.reserved = [t for t in tokens if t]  # text must not spell these out
        self._info: OrderedDict[bytes, tuple[tuple[int, int, int], int]] = OrderedDict()
        self.info_entries = info_entries

    @classmethod
    def for_model(cls, model_dir, tokenizer) -> "ImageSupport | None":
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        if raw.get("model_type") != "qwen3_5" or not raw.get("vision_config"):
            return None
        if not (model_dir / "preprocessor_config.json").is_file():
            return None
        from transformers import AutoImageProcessor

        # the PIL/numpy path (use_fast=False): torchvision is not needed, and the result does not depend on it
        proc = AutoImageProcessor.from_pretrained(str(model_dir), use_fast=False)
        vc = raw["vision_config"]
        pad = raw.get("image_token_id", 248056)
        start, end = raw.get("vision_start_token_id"), raw.get("vision_end_token_id")
        tokens = tuple("" if i is None else tokenizer.convert_ids_to_tokens(i) for i in (start, pad, end))
        return cls(proc, pad, vc.get("spatial_merge_size", 2), tokens)

    # ---- checking and preparing -----------------------------------------------------------------------------------

    def prepare(self, images: Any) -> list[ImageRef]:
        """A row's `images` field -> ImageRefs (not yet located); RowError for anything malformed."""
        if not isinstance(images, (list, tuple)):
            raise RowError("bad_type", f"images must be a list of encoded images (bytes), got {type(images).__name__}")
        if len(images) > MAX_IMAGES:
            raise RowError("too_many_images", f"{len(images)} images, more than the limit {MAX_IMAGES}")
        return [self._one(x, i) for i, x in enumerate(images)]

    def _one(self, data: Any, i: int) -> ImageRef:
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise RowError("bad_image", f"images[{i}] must be encoded image bytes (PNG/JPEG), got {type(data).__name__}")
        if len(data) > MAX_IMAGE_BYTES:
            raise RowError("image_too_large", f"images[{i}] is {len(data)} bytes, more than the limit {MAX_IMAGE_BYTES}")
        digest = hashlib.sha256(data).digest()
        got = self._info.get(digest)
        if got is None:
            _, grid = self.pixels(data, i)
            got = (grid, grid[0] * grid[1] * grid[2] // self.merge**2)
            self._info[digest] = got
            while len(self._info) > self.info_entries:
                self._info.popitem(last=False)
        else:
            self._info.move_to_end(digest)
        return ImageRef(digest, data, got[0], got[1])

    def decode(self, data: bytes, i: int = 0):
        """Bytes -> an RGB PIL image, fully decoded; RowError when they are not a whole PNG/JPEG/WebP image of
        allowed size."""
        from PIL import Image

        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise RowError("image_too_large", f"images[{i}]: {e}") from None
        except Exception as e:  # noqa: BLE001 - anything PIL cannot open
            raise RowError("bad_image", f"images[{i}] does not decode as an image ({type(e).__name__}: {e})") from None
        if im.format not in FORMATS:
            raise RowError("bad_image", f"images[{i}] is {im.format}; send PNG, JPEG or WebP")
        w, h = im.size
        if w * h > MAX_IMAGE_PIXELS:
            raise RowError("image_too_large", f"images[{i}] is {w}x{h} pixels, more than the limit {MAX_IMAGE_PIXELS}")
        if w < 1 or h < 1:
            raise RowError("bad_image", f"images[{i}] is {w}x{h} pixels")
        try:
            im.load()
            return im.convert("RGB")
        except Exception as e:  # noqa: BLE001 - truncated or corrupt data
            raise RowError("bad_image", f"images[{i}] does not decode ({type(e).__name__}: {e})") from None

    def pixels(self, data: bytes, i: int = 0):
        """The image processor's output for one image: (pixel_values [patches, C*t*p*p] float32, grid (t, h, w))."""
        im = self.decode(data, i)
        try:
            out = self.processor(images=[im], return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - e.g. an image too thin for the processor's aspect-ratio limit
            raise RowError("bad_image", f"images[{i}] was refused by the image processor ({type(e).__name__}: {e})") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return out["pixel_values"], grid

    # ---- text rows ------------------------------------------------------------------------------------------------

    def check_text(self, text: str, where: str) -> int:
        """Placeholders in one text; RowError if the text spells out the model's own image tokens."""
        for tok in self.reserved:
            if tok in text:
                raise RowError("bad_row", f"{where} contains {tok!r}: reference images with {PLACEHOLDER!r}")
        return text.count(PLACEHOLDER)

    def expand(self, text: str, refs: list[ImageRef], k: int) -> tuple[str, int]:
        """One rendered piece with each placeholder (from image k on) turned into the marker with its image's pad
        tokens expanded (the processor's rule); -> (text, index of the next image)."""
        parts = text.split(PLACEHOLDER)
        out = [parts[0]]
        for p in parts[1:]:
            out.append(self.marker.replace(self.image_token, self.image_token * refs[k].n) + p)
            k += 1
        return "".join(out), k


def locate(ids: list[int], refs: list[ImageRef], pad_id: int) -> list[ImageRef]:
    """The refs with their `start` set from the image-pad runs in ids (searched in C: list.index and slice
    compares); RowError when the runs do not match them: one run per image, in order, each exactly its length."""
    out, i = [], 0
    for k, r in enumerate(refs):
        try:
            a = ids.index(pad_id, i)
        except ValueError:
            raise RowError("image_tokens_mismatch", f"ids hold {k} image-pad run(s), the row has {len(refs)} images") from None
        b = a + r.n
        if ids[a:b] != [pad_id] * r.n or (b < len(ids) and ids[b] == pad_id):
            m = b
            while m < len(ids) and ids[m] == pad_id:
                m += 1
            got = next((j for j in range(a, min(b, len(ids))) if ids[j] != pad_id), m) - a
            raise RowError("image_tokens_mismatch", f"image-pad run {k} at ids[{a}] has {got} tokens, images[{k}] needs "
                           f"{r.n} (one run per image, in order)")
        out.append(ImageRef(r.digest, r.data, r.grid, r.n, a))
        i = b
    if pad_id in ids[i:]:
        raise RowError("image_tokens_mismatch", f"ids hold more image-pad runs than the {len(refs)} image(s)")
    return out


def positions(n: int, refs: list[ImageRef], merge: int) -> np.ndarray:
    """[3, n] int64 multimodal rotary positions (temporal, height, width) of a row whose images are refs (located,
    in order): transformers' Qwen3.5 get_rope_index for one sequence. Text tokens count on from the last position;
    an image's tokens sit on its (t, row, column) grid from the position it starts at, and the text after it
    resumes at that position + max(rows, columns)."""
    pos = np.empty((3, n), dtype=np.int64)
    cur, i = 0, 0
    for r in refs:
        k = r.start - i
        pos[:, i : r.start] = cur + np.arange(k)
        cur += k
        t, h, w = r.grid[0], r.grid[1] // merge, r.grid[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[0, r.start : r.end] = cur + tt.ravel()
        pos[1, r.start : r.end] = cur + hh.ravel()
        pos[2, r.start : r.end] = cur + ww.ravel()
        cur += max(h, w)
        i = r.end
    pos[:, i:n] = cur + np.arange(n - i)
    return pos


def key_ids(ids: list[int], refs: list[ImageRef]) -> list[int]:
    """ids with each image's pad tokens replaced by the image's key (ImageRef.key): the tokens the index compares."""
    out = list(ids)
    for r in refs:
        out[r.start : r.end] = [r.key] * r.n
    return out
