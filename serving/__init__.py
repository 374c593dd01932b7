"""raypai.serving: Ray Serve model servers, the OpenAI-compatible router, the deploy API."""

from raypai.serving.api import create_app
from raypai.serving.control import Controller

__all__ = ["create_app", "Controller"]
