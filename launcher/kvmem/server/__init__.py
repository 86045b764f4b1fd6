"""The OpenAI-compatible API process: aiohttp routes in front of one engine process."""

from __future__ import annotations
