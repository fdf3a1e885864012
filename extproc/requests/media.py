"""Media references (data URIs, URLs, base64 blocks) -> `MediaItem`: identity, resolution
and token cost. Remote media are never fetched; inline media are decoded once, hashed, and
only their header bytes are read.

Errors are `BadRequest`s naming the field (`messages[2].content[0].image_url.url: invalid
base64`); they never quote the client's data.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Mapping
from urllib.parse import unquote_to_bytes, urlsplit, urlunsplit

import pybase64

from extproc.core import MediaItem, Modality
from extproc.errors import BadRequest
from extproc.hashing.estimate import ImageEstimator
from extproc.hashing.media import content_digest, url_digest
from extproc.protocol import VIDEO_DURATION_HEADER, VIDEO_FPS_HEADER, VIDEO_RESOLUTION_HEADER
from extproc.requests.settings import ParseSettings
from extproc.requests.sniff import InvalidMedia, image_size, wav_duration_s

_DEFAULT_PORTS = {"http": 80, "https": 443}


def decode_base64(data: str, field: str) -> bytes:
    """Strict base64 (no stray characters, correct padding), else a 400 naming `field`."""
    # pybase64 (SIMD) decodes ~50x faster than binascii: 0.06 vs 3 ms for a 1 MB image.
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise BadRequest(f"{field}: invalid base64") from None


def decode_data_uri(uri: str, field: str) -> bytes:
    """Bytes of a `data:[<type>][;base64],<data>` URI."""
    comma = uri.find(",")
    if comma < 0:
        raise BadRequest(f"{field}: malformed data URI")
    header = uri[5:comma]
    if header.lower().endswith(";base64"):
        return decode_base64(uri[comma + 1 :], field)
    try:
        return unquote_to_bytes(uri[comma + 1 :])
    except (ValueError, TypeError):
        raise BadRequest(f"{field}: malformed data URI") from None


def normalize_url(url: str, field: str) -> str:
    """The identity of a remote asset: scheme and host lower-cased, default port and
    fragment dropped; path and query kept as sent (they are case-sensitive on servers)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise BadRequest(f"{field}: malformed URL") from None
    scheme = parts.scheme.lower()
    if not scheme:
        raise BadRequest(f"{field}: must be a data URI or a URL")
    host = (parts.hostname or "").lower()
    if scheme in _DEFAULT_PORTS and not host:
        raise BadRequest(f"{field}: URL without a host")
    netloc = host if ":" not in host else f"[{host}]"
    if parts.username is not None:
        netloc = f"{parts.netloc.rpartition('@')[0]}@{netloc}"
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        netloc = f"{netloc}:{port}"
    return urlunsplit((scheme, netloc, parts.path, parts.query, ""))


class MediaResolver:
    """Resolves the media of one request against the model's estimators.

    Built per request (it reads the `x-llm-d-video-*` headers, lazily, only if a video shows
    up); not shared between threads.
    """

    __slots__ = ("_headers", "_image", "_model", "_settings", "_video")

    def __init__(self, settings: ParseSettings, model: str, headers: Mapping[str, str]) -> None:
        self._settings = settings
        self._model = model
        # Matched on the first image: most requests carry none, and the glob walk is not free.
        self._image: ImageEstimator | None = None
        self._headers = headers
        self._video: tuple[float, float, int, int] | None = None

    def _image_estimator(self) -> ImageEstimator:
        if self._image is None:
            self._image = self._settings.image_estimator(self._model)
        return self._image

    def image_url(self, url: str, field: str) -> MediaItem:
        """An `image_url`-style reference: a data URI or a remote URL."""
        if url[:5].lower() == "data:":
            return self.image_bytes(decode_data_uri(url, field), field)
        return self.remote_image(normalize_url(url, field))

    def image_bytes(self, data: bytes, field: str) -> MediaItem:
        try:
            size = image_size(data)
        except InvalidMedia as exc:
            raise BadRequest(f"{field}: {exc}") from None
        s = self._settings
        width, height = size if size is not None else (s.url_image_width, s.url_image_height)
        return MediaItem(
            Modality.IMAGE,
            content_digest(data).hex(),
            self._image_estimator().image_tokens(width, height),
            width=width,
            height=height,
        )

    def remote_image(self, identity: str) -> MediaItem:
        """An image known only by name (a normalized URL, a file id): default resolution."""
        s = self._settings
        w, h = s.url_image_width, s.url_image_height
        return MediaItem(
            Modality.IMAGE,
            url_digest(identity).hex(),
            self._image_estimator().image_tokens(w, h),
            is_remote=True,
            width=w,
            height=h,
        )

    def audio_bytes(self, data: bytes, field: str) -> MediaItem:
        audio = self._settings.audio
        try:
            duration_s = wav_duration_s(data)
        except InvalidMedia as exc:
            raise BadRequest(f"{field}: {exc}") from None
        if duration_s is None:
            duration_s = len(data) / audio.fallback_bytes_per_s
        return MediaItem(Modality.AUDIO, content_digest(data).hex(), audio.audio_tokens(duration_s))

    def audio_url(self, url: str, field: str) -> MediaItem:
        if url[:5].lower() == "data:":
            return self.audio_bytes(decode_data_uri(url, field), field)
        audio = self._settings.audio
        identity = normalize_url(url, field)
        tokens = audio.audio_tokens(audio.default_duration_s)
        return MediaItem(Modality.AUDIO, url_digest(identity).hex(), tokens, is_remote=True)

    def video_url(self, url: str, field: str) -> MediaItem:
        """A video: identity from its bytes or URL, cost from headers or defaults (inline
        video is hashed but never demuxed)."""
        if url[:5].lower() == "data:":
            digest, remote = content_digest(decode_data_uri(url, field)), False
        else:
            digest, remote = url_digest(normalize_url(url, field)), True
        duration_s, fps, width, height = self._video_params()
        video = self._settings.video
        per_frame = self._image_estimator().image_tokens(width, height)
        tokens = video.video_tokens(per_frame, duration_s, fps)
        return MediaItem(
            Modality.VIDEO, digest.hex(), tokens, is_remote=remote, width=width, height=height
        )

    def _video_params(self) -> tuple[float, float, int, int]:
        if self._video is None:
            v, h = self._settings.video, self._headers
            duration_s = _positive_header(h, VIDEO_DURATION_HEADER, v.default_duration_s)
            fps = _positive_header(h, VIDEO_FPS_HEADER, v.default_fps)
            width, height = v.default_width, v.default_height
            if (res := h.get(VIDEO_RESOLUTION_HEADER)) is not None:
                width, height = _resolution(res)
            self._video = (duration_s, fps, width, height)
        return self._video


def _positive_header(headers: Mapping[str, str], name: str, default: float) -> float:
    raw = headers.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{name}: must be a positive number") from None
    if not (math.isfinite(value) and value > 0):
        raise BadRequest(f"{name}: must be a positive number")
    return value


def _resolution(raw: str) -> tuple[int, int]:
    w, sep, h = raw.strip().lower().partition("x")
    if sep and raw.isascii() and w.isdigit() and h.isdigit() and len(w) <= 6 and len(h) <= 6:
        width, height = int(w), int(h)
        if width > 0 and height > 0:
            return width, height
    raise BadRequest(f"{VIDEO_RESOLUTION_HEADER}: must be WIDTHxHEIGHT")
